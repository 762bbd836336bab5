"""Apply LMCache worker messages to the index (no sockets here; see sidecar.service).

Push frames (PULL socket) are decoded one by one; their admits and evicts queue up in arrival
order and :meth:`LMCacheIngest.flush` writes at most a budget of them per call, so one huge
message never holds the loop for long. A registry message never waits for queued ops: a
re-registration, deregistration or full-sync start drops the queued ops it makes moot (they
belong to a holder being retired), so order holds without flushing.

Ops of a worker the registry does not know are dropped and counted, as LMCache 0.5 does,
except 0.3-era admits (``KVAdmitMsg``): 0.3 workers register once and never again, so an
admit registers its worker implicitly, as LMCache 0.3 would store it.

After a (re)start the sidecar does not know what it missed: the first heartbeat of each 0.5-era
worker gets a ``full_sync`` command (``controller_restart``; ``worker_re_registered`` for a
worker the registry lost) whatever arrived before it, as LMCache's own controller asks.
A frame that fails to decode or apply is counted and logged; the rest of the batch goes on.

After a failover (a Redis master that served the index was replaced, kvlookup.index.failover), writes
it had not replicated may be lost: the sidecar writes its recent record writes again (the
store's journal of the last minute) and asks every 0.5-era worker for a full sync at its next
heartbeat.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import redis

from kvlookup import metrics
from kvlookup.index import staleness
from kvlookup.index.failover import MasterWatch
from kvlookup.index.store import ADMIT, EVICT, NotRegistered, Refused, Store, chunk_text
from kvlookup.sidecar.admission import InstancePolicy
from kvlookup.sidecar.opqueue import Batch, OpQueue
from kvlookup.wire import lmcache as proto
from kvlookup.wire.errors import WireError

text = chunk_text

log = logging.getLogger(__name__)

#: Non-connection Redis errors (BUSY, OOM, READONLY...) tolerated for the head of the queue
#: before it is dropped and counted, so a persistent error cannot wedge the sidecar.
MAX_REDIS_FAILURES = 5


class Observer(Protocol):
    """What the ingest tells about workers (sidecar.liveness.Liveness implements it): a message
    of a worker arrived on a connection; a worker registered; a worker left the registry."""

    def seen(self, conn: Any, instance_id: str, worker_id: int) -> None: ...

    def registered(self, instance_id: str, worker_id: int) -> None: ...

    def forget(self, instance_id: str, worker_id: int) -> None: ...


class Unobserved:
    """The :class:`Observer` of an ingest given none: it ignores everything."""

    def seen(self, conn: Any, instance_id: str, worker_id: int) -> None:
        pass

    def registered(self, instance_id: str, worker_id: int) -> None:
        pass

    def forget(self, instance_id: str, worker_id: int) -> None:
        pass


class LMCacheIngest:
    """Turns decoded LMCache messages into index writes.

    store: the index. sidecar_id: the owner this sidecar registers its instances under.
    heartbeat_url: advertised to 0.3.12+ workers in RegisterRetMsg so their heartbeats reach
    this sidecar ("" = none). observer: told of every message naming a worker (with its
    connection), of registrations and of departures (:class:`Observer`). policy: which instance
    ids are accepted (default: any).
    """

    def __init__(self, store: Store, sidecar_id: str = "", heartbeat_url: str = "",
                 observer: Observer | None = None, policy: InstancePolicy | None = None):
        self.store = store
        self.sidecar_id = sidecar_id
        self.policy = policy or InstancePolicy()
        self.heartbeat_url = heartbeat_url
        self.observer: Observer = observer or Unobserved()
        self.queue = OpQueue()
        self._registered: set[tuple[str, int]] = set()  # known registered (cache; NotRegistered resets)
        self._synced: set[tuple[str, int]] = set()  # registered or full-synced by this process
        self._gaps: set[tuple[str, int]] = set()  # skipped a seq: its next heartbeat asks a full sync
        self._redis_failures = 0
        self._next_seq: dict[tuple[str, int, str], int] = {}
        self.masters = MasterWatch(store.r)  # failover: rewrite the journal, ask for full syncs
        self._failed_over = False
        store.keep_journal()

    # -- push channel ----------------------------------------------------------------------

    def handle_push(self, frames: list[bytes], conn: Any = None) -> None:
        """Decode one multipart PUSH message (one LMCache message per frame) and queue it."""
        for frame in frames:
            try:
                tag, msg = proto.decode_frame(frame)
            except WireError as exc:
                metrics.REJECTED.labels("lmcache", exc.reason).inc()
                log.warning("rejected frame (%d bytes): %s", len(frame), exc)
                continue
            if self.policy.refuse(tag, msg):
                continue
            metrics.MESSAGES.labels(tag).inc()
            try:
                self.observer.seen(conn, msg.instance_id, msg.worker_id)
                self._on_push(tag, msg)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # the loop backs off; what is queued stays queued
            except Refused as exc:
                self._refused(tag, exc)
            except Exception:  # a bad message never stops the loop
                metrics.REJECTED.labels("lmcache", "handler_error").inc()
                log.exception("failed to handle %s", tag)

    def _on_push(self, tag: str, msg: Any) -> None:
        if tag == "KVAdmitMsg" or tag == "KVEvictMsg":
            admit = tag == "KVAdmitMsg"
            self._add(msg.instance_id, msg.worker_id, msg.location, ((text(msg.key), ADMIT if admit else EVICT),),
                      implicit=admit)
        elif tag == "BatchedKVOperationMsg":
            self._check_seq(msg)
            self._add(msg.instance_id, msg.worker_id, msg.location,
                      ((text(op.key), ADMIT if op.op_type == "admit" else EVICT) for op in msg.operations))
        elif tag == "FullSyncBatchMsg":
            self._add(msg.instance_id, msg.worker_id, msg.location, dict.fromkeys(map(text, msg.keys), ADMIT))
        elif tag == "RegisterMsg":
            self._register(msg)
        elif tag == "HeartbeatMsg":  # 0.3.5-0.3.9 heartbeats come on PUSH: nothing to answer
            if not self.store.heartbeat_worker(msg.instance_id, msg.worker_id):
                self._register(msg)
        elif tag == "DeRegisterMsg":
            self._deregister(msg.instance_id, msg.worker_id)
        elif tag == "FullSyncEndMsg":
            log.info("full sync %s of %s/%s/%s ended with %d keys", msg.sync_id, msg.instance_id,
                     msg.worker_id, msg.location, msg.actual_total_keys)
        else:
            metrics.REJECTED.labels("lmcache", "wrong_channel").inc()
            log.warning("%s is a request; it belongs on the reply socket", tag)

    def _add(self, instance_id: str, worker_id: int, location: str, ops, implicit: bool = False) -> None:
        self.queue.add(instance_id, worker_id, location, ops, implicit)

    @property
    def queued_ops(self) -> int:
        """Chunk operations queued, not written yet (folded per chunk and holder)."""
        return self.queue.queued_ops

    def drop_queued(self, instance_id: str, worker_id: int, location: str | None = None) -> int:
        """Drop the queued ops of a worker (of one location, when given): its holder is being
        retired, so they are moot. Returns the ops dropped."""
        gone = self.queue.drop(instance_id, worker_id, location)
        for b in gone:
            metrics.count_ops(b.ops, "superseded")
        return sum(len(b.ops) for b in gone)

    def lag_s(self) -> float:
        """How long the oldest queued op has waited (seconds; 0 when nothing is queued)."""
        return self.queue.lag_s()

    # -- writing ---------------------------------------------------------------------------

    def flush(self, budget: int | None = None) -> int:
        """Write up to ``budget`` queued ops (all when None), oldest first; returns ops taken.

        On a Redis error the ops stay queued and the error propagates; the service loop backs
        off and calls flush again. Connection errors are retried until Redis is back; other
        errors (BUSY, OOM, READONLY...) up to ``MAX_REDIS_FAILURES`` times, then the ops are
        dropped and counted. First, if a master was replaced since the last look, the journal
        is written again (:meth:`after_failover`).
        """
        if self.masters.replaced() or self._failed_over:
            self.after_failover()
        taken = self.queue.take(budget)
        if not taken:
            return 0
        try:
            self._write(taken)
            self._redis_failures = 0
        except (redis.ConnectionError, redis.TimeoutError):
            self.queue.put_back(taken)
            raise
        except redis.RedisError as exc:
            self._redis_failures += 1
            if self._redis_failures < MAX_REDIS_FAILURES:
                self.queue.put_back(taken)
                raise
            self._redis_failures = 0
            for b in taken:
                metrics.count_ops(b.ops, "redis_error")
            log.error("dropped %d batches after %d Redis errors: %s", len(taken), MAX_REDIS_FAILURES, exc)
        return sum(len(b.ops) for b in taken)

    def _write(self, taken: list[Batch]) -> None:
        writable = [b for b in taken if self._writable(b)]
        try:
            self.store.apply([(b.instance_id, b.worker_id, b.location, b.ops) for b in writable])
        except NotRegistered:  # a worker left the registry since we looked: sort them out one by one
            self._registered.clear()
            for b in writable:
                if self._writable(b):
                    try:
                        self.store.apply([(b.instance_id, b.worker_id, b.location, b.ops)])
                    except NotRegistered:
                        metrics.count_ops(b.ops, "unregistered")
                        continue
                    metrics.count_ops(b.ops, "applied")
            return
        for b in writable:
            metrics.count_ops(b.ops, "applied")

    def _writable(self, b: Batch) -> bool:
        """Is the batch's worker registered? A 0.3-era admit registers it; else it is dropped."""
        key = (b.instance_id, b.worker_id)
        if key in self._registered:
            return True
        if self.store.is_registered(*key):
            self._registered.add(key)
            return True
        if b.implicit:
            log.info("0.3-era admits of unregistered worker %s/%s: registering it", *key)
            try:
                self._register_worker(b.instance_id, b.worker_id)
            except Refused as exc:
                self._refused("KVAdmitMsg", exc)
                metrics.count_ops(b.ops, "unregistered")
                return False
            return True
        metrics.count_ops(b.ops, "unregistered")
        log.info("dropped %d ops of unregistered worker %s/%s", len(b.ops), *key)
        return False

    def after_failover(self) -> None:
        """A master replaced: what it acknowledged but had not replicated is lost. Write the
        record writes of the last minute again (Store.rewrite_journal) and ask every worker
        for a full sync at its next heartbeat (0.3.12+ workers). On a Redis error it is tried
        again at the next flush."""
        self._failed_over = True
        self._synced.clear()
        ops, span = self.store.rewrite_journal()
        self._failed_over = False
        log.warning("failover: wrote the ops of the last %.0f s again (%d); full sync of every worker at its "
                    "next heartbeat", span, ops)

    # -- registry --------------------------------------------------------------------------

    def _register(self, msg: proto.Register) -> int:
        url = msg.peer_init_url if msg.peer_init_url is not None else msg.distributed_url
        return self._register_worker(msg.instance_id, msg.worker_id, msg.ip, msg.port, url)

    def _register_worker(self, instance_id: str, worker_id: int, ip: str = "", port: int = 0,
                         url: str | None = None) -> int:
        self.drop_queued(instance_id, worker_id)  # a new epoch: queued ops of the old one are moot
        epoch = self.store.register_worker(instance_id, worker_id, ip, port, url)
        self.store.own(self.sidecar_id, instance_id)
        staleness.clear(self.store.r, instance_id)  # a new epoch: nothing old counts
        key = (instance_id, worker_id)
        self._registered.add(key)
        self._synced.add(key)
        self._reset_seq(instance_id, worker_id)
        self.observer.registered(instance_id, worker_id)
        log.info("registered %s worker %d (%s:%d), epoch %d", instance_id, worker_id, ip, port, epoch)
        return epoch

    def _deregister(self, instance_id: str, worker_id: int) -> None:
        self.drop_queued(instance_id, worker_id)
        known = self.store.deregister_worker(instance_id, worker_id)
        self.forget(instance_id, worker_id)
        self.observer.forget(instance_id, worker_id)
        log.info("deregistered %s worker %d%s", instance_id, worker_id, "" if known else " (was unknown)")

    def forget(self, instance_id: str, worker_id: int | str) -> None:
        """Drop what this process knows of a worker that left the registry, so its next
        heartbeat or record re-registers it (and, for 0.5.x, asks for a full sync)."""
        wid = int(worker_id) if isinstance(worker_id, str) and worker_id.isdigit() else worker_id
        self._registered.discard((instance_id, wid))
        self._synced.discard((instance_id, wid))
        self._gaps.discard((instance_id, wid))
        self._reset_seq(instance_id, wid)

    def _reset_seq(self, instance_id: str, worker_id: int | str) -> None:
        """Forget the expected seq_num of every location of a worker (new epoch or reaped)."""
        for source in [s for s in self._next_seq if s[:2] == (instance_id, worker_id)]:
            del self._next_seq[source]

    def _check_seq(self, msg: proto.BatchedKVOperation) -> None:
        if not msg.operations:
            return
        source = (msg.instance_id, msg.worker_id, msg.location)
        expected = self._next_seq.get(source)
        first = msg.operations[0].seq_num
        if expected is not None and first != expected:
            metrics.SEQ_GAPS.labels("lmcache").inc()
            log.warning("seq gap from %s: expected %d, got %d; full sync at its next heartbeat",
                        source, expected, first)
            self._synced.discard(source[:2])
            self._gaps.add(source[:2])
        self._next_seq[source] = msg.operations[-1].seq_num + 1

    # -- request channel (ROUTER) ----------------------------------------------------------

    def handle_request(self, payload: bytes, conn: Any = None) -> bytes:
        """Answer one worker request (0.3.12+ DEALER, or a 0.3.x REQ); returns the reply frame."""
        try:
            tag, msg = proto.decode_frame(payload)
        except WireError as exc:
            metrics.REJECTED.labels("lmcache", exc.reason).inc()
            log.warning("rejected request (%d bytes): %s", len(payload), exc)
            return proto.encode(proto.ErrorMsg(error=f"{exc.reason}: {exc}"))
        if refused := self.policy.refuse(tag, msg):
            return proto.encode(proto.ErrorMsg(error=refused))
        metrics.MESSAGES.labels(tag).inc()
        try:
            self.observer.seen(conn, msg.instance_id, msg.worker_id)
            return proto.encode(self._on_request(tag, msg))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return proto.encode(proto.ErrorMsg(error=f"index unavailable: {exc}"))
        except Refused as exc:
            self._refused(tag, exc)
            return proto.encode(proto.ErrorMsg(error=str(exc)))
        except Exception as exc:
            metrics.REJECTED.labels("lmcache", "handler_error").inc()
            log.exception("failed to answer %s", tag)
            return proto.encode(proto.ErrorMsg(error=f"controller error: {exc}"))

    def _refused(self, tag: str, exc: Refused) -> None:
        """A message the index refused on purpose (kvlookup.index.store.Refused): counted and
        logged (at most once a minute per reason), never a traceback."""
        metrics.REJECTED.labels("lmcache", exc.reason).inc()
        self.policy.quiet.warn(f"refused:{exc.reason}", f"refused {tag}: {exc}")

    def _on_request(self, tag: str, msg: Any) -> Any:
        if tag == "RegisterMsg":
            self._register(msg)
            extra = {"heartbeat_url": self.heartbeat_url} if self.heartbeat_url else {}
            return proto.RegisterRetMsg(extra_config=extra)
        if tag == "HeartbeatMsg":
            return self._heartbeat(msg)
        if tag == "FullSyncStartMsg":
            return self._full_sync_start(msg)
        if tag == "FullSyncStatusMsg":
            return proto.FullSyncStatusRetMsg(sync_id=msg.sync_id, is_complete=True, global_progress=1.0,
                                              can_exit_freeze=True)
        if tag == "BatchedP2PLookupMsg":
            return proto.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
        # a push message sent on the request channel: apply it, acknowledge with an error
        self._on_push(tag, msg)
        return proto.ErrorMsg(error=f"{tag} is not a request")

    def _full_sync_start(self, msg: proto.FullSyncStart) -> proto.FullSyncStartRetMsg:
        key = (msg.instance_id, msg.worker_id)
        if not self.store.is_registered(*key):
            return proto.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=False,
                                             error_msg="worker is not registered; register first")
        self.drop_queued(msg.instance_id, msg.worker_id, msg.location)
        self.store.retire_location(msg.instance_id, msg.worker_id, msg.location)
        staleness.clear(self.store.r, msg.instance_id)
        self._next_seq.pop((msg.instance_id, msg.worker_id, msg.location), None)
        self._synced.add(key)
        log.info("full sync %s of %s/%s/%s: %d keys in %d batches", msg.sync_id, msg.instance_id,
                 msg.worker_id, msg.location, msg.total_keys, msg.batch_count)
        return proto.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=True)

    def _heartbeat(self, msg: proto.Register) -> proto.HeartbeatRetMsg:
        """Refresh a worker. One this process has not registered or synced since it started
        (or that skipped a seq) is asked for a full sync, once."""
        key = (msg.instance_id, msg.worker_id)
        known = self.store.heartbeat_worker(msg.instance_id, msg.worker_id)
        if known and key in self._synced:
            return proto.HeartbeatRetMsg()
        if known:
            reason = "sync_failed_retry" if key in self._gaps else "controller_restart"
            self._gaps.discard(key)
            self._synced.add(key)
            self._registered.add(key)
            self.store.own(self.sidecar_id, msg.instance_id)
        else:
            reason = "worker_re_registered"
            self._register(msg)
        metrics.RESYNCS.labels("lmcache", reason).inc()
        log.info("asking %s worker %d for a full sync (%s)", msg.instance_id, msg.worker_id, reason)
        return proto.HeartbeatRetMsg(commands=[proto.FullSyncCommand(reason=reason)])
