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
it had not replicated may be lost: the sidecar writes again every registration and epoch it made
(it keeps them: a lost registration is made again, a lost cold restart retires the old epoch
again), and takes its instances again, then its recent record writes (the store's journal of the
last minute, those of a lost holder onto its new one), and asks every 0.5-era worker for a full
sync at its next heartbeat: engines that never heartbeat (LMCache 0.5.6's default) heal too.
Ops of a worker this process registered are never dropped as unregistered because the registry
lost the registration: it is written again first (unless the departures log shows the worker left).

With ``overlap`` (the sidecar's ``lmcache_overlap_writes``, default on) a slice's write is left in
flight (issue 18 item 3): the next flush builds its own write while Redis works, then reads the
replies of the one in flight, then sends; the loop reads and decodes messages meanwhile. The write
in flight is settled (its replies read) before anything that reads or writes the registry: any
request, any push message other than chunk ops, a worker not known registered, a failover's heal,
a probe or a reap, a flush of all; so order per worker and against retirements is that of inline
writes. A failed write goes back to the head of the queue (the slice built behind it after it),
as an inline one does.

A registration or deregistration arriving while Redis cannot answer (a stopped server, a
failover) waits in the op queue (sidecar.opqueue ``registry``) and is applied, before any op,
once Redis answers; a 0.5-era worker gets its ``RegisterRetMsg`` at once (its push loop waits
for it; LMCache never retries a registration answered ``ErrorMsg``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from kvlookup import metrics
from kvlookup.index import staleness
from kvlookup.index.failover import MasterWatch
from kvlookup.index.store import ADMIT, EVICT, HoldersLost, NotRegistered, Refused, Store, chunk_text
from kvlookup.sidecar.admission import InstancePolicy
from kvlookup.sidecar.opqueue import Batch, OpQueue, RegistryWrite
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

    def seen(self, conn: Any, instance_id: str, worker_id: int, redis_ok: bool = True) -> bool | None: ...

    def registered(self, instance_id: str, worker_id: int) -> None: ...

    def forget(self, instance_id: str, worker_id: int) -> None: ...


@dataclass
class Held:
    """A registration this process made: what to write again if the registry loses it.
    at_ms: when (Redis server time, unix ms); epoch: the epoch Redis gave it."""

    ip: str
    port: int
    url: str | None
    epoch: int
    at_ms: int


@dataclass
class InFlight:
    """A slice whose write was sent (``lmcache_overlap_writes``): its batches (put back at the
    head of the queue if the write fails), the function that reads its replies, its ops."""

    batches: list[Batch]
    finish: Callable[[], None]
    ops: int


#: Push messages that only queue chunk ops: the write in flight is not settled before them.
OP_TAGS = frozenset({"KVAdmitMsg", "KVEvictMsg", "BatchedKVOperationMsg", "FullSyncBatchMsg"})


class Unobserved:
    """The :class:`Observer` of an ingest given none: it ignores everything."""

    def seen(self, conn: Any, instance_id: str, worker_id: int, redis_ok: bool = True) -> bool | None:
        return True

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
    ids are accepted (default: any). overlap: :meth:`flush` with a budget leaves its slice's write
    in flight (sent, replies read at the next flush or before any other message is handled:
    ``lmcache_overlap_writes``); False writes each slice before returning.
    """

    def __init__(self, store: Store, sidecar_id: str = "", heartbeat_url: str = "",
                 observer: Observer | None = None, policy: InstancePolicy | None = None, overlap: bool = False):
        self.store = store
        self.overlap = overlap
        self._in_flight: InFlight | None = None  # a slice sent, its replies not read yet (overlap)
        self.sidecar_id = sidecar_id
        self.policy = policy or InstancePolicy()
        self.heartbeat_url = heartbeat_url
        self.observer: Observer = observer or Unobserved()
        self.queue = OpQueue()
        self._registered: set[tuple[str, int]] = set()  # known registered (cache; NotRegistered resets)
        self._synced: set[tuple[str, int]] = set()  # registered or full-synced by this process
        self._gaps: set[tuple[str, int]] = set()  # skipped a seq: its next heartbeat asks a full sync
        self._redis_failures = 0
        self._held: dict[tuple[str, int], Held] = {}  # registrations made by this process
        self._down = False  # the last Redis call failed to connect: registry writes queue
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
            if self._refuse(tag, msg):
                continue
            metrics.MESSAGES.labels(tag).inc()
            if self._in_flight is not None and tag not in OP_TAGS:
                self.settle_quietly()  # a registry message: after the write sent before it, as when written inline
            try:
                self._seen(conn, msg)
                self._on_push(tag, msg)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # the loop backs off; what is queued stays queued
            except Refused as exc:
                self._refused(tag, exc)
            except Exception:  # a bad message never stops the loop
                metrics.REJECTED.labels("lmcache", "handler_error").inc()
                log.exception("failed to handle %s", tag)

    def _refuse(self, tag: str, msg: Any) -> str:
        self.policy.offline = self._down  # Redis known down: the claims read would only wait
        return self.policy.refuse(tag, msg)

    def _seen(self, conn: Any, msg: Any) -> None:
        if self.observer.seen(conn, msg.instance_id, msg.worker_id, redis_ok=not self._down) is False:
            self._down = True  # Redis did not answer: registry writes queue, later messages do not wait

    def _on_push(self, tag: str, msg: Any) -> None:
        if tag == "KVAdmitMsg" or tag == "KVEvictMsg":
            admit = tag == "KVAdmitMsg"
            self._add(msg.instance_id, msg.worker_id, msg.location, ((text(msg.key), ADMIT if admit else EVICT),),
                      implicit=admit)
        elif tag == "BatchedKVOperationMsg":
            self._check_seq(msg)
            self._add(msg.instance_id, msg.worker_id, msg.location, _folded(msg.operations))
        elif tag == "FullSyncBatchMsg":
            self._add(msg.instance_id, msg.worker_id, msg.location, dict.fromkeys(map(text, msg.keys), ADMIT))
        elif tag == "RegisterMsg":
            self._register(msg)
        elif tag == "HeartbeatMsg":  # 0.3.5-0.3.9 heartbeats come on PUSH: nothing to answer
            if (msg.instance_id, msg.worker_id) in self.queue.registry or self._down:
                return  # its registration waits for Redis; heartbeats come again
            try:
                known = self.store.heartbeat_worker(msg.instance_id, msg.worker_id)
            except (redis.ConnectionError, redis.TimeoutError):
                self._down = True
                return
            if not known:
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
        """Chunk operations queued or in flight, not known written yet (folded per chunk and holder)."""
        return self.queue.queued_ops + (self._in_flight.ops if self._in_flight is not None else 0)

    def drop_queued(self, instance_id: str, worker_id: int, location: str | None = None) -> int:
        """Drop the queued ops of a worker (of one location, when given): its holder is being
        retired, so they are moot. Returns the ops dropped."""
        gone = self.queue.drop(instance_id, worker_id, location)
        for b in gone:
            metrics.count_ops(b.ops, "superseded")
        return sum(len(b.ops) for b in gone)

    def lag_s(self) -> float:
        """How long the oldest queued or in-flight op has waited (seconds; 0 when nothing is queued)."""
        if self._in_flight is not None and self._in_flight.batches:
            return max(self.queue.lag_s(), time.monotonic() - self._in_flight.batches[0].queued_at)
        return self.queue.lag_s()

    def redis_down(self) -> None:
        """Redis could not be reached (the service loop saw it): registry writes queue at once
        until the next flush writes again."""
        self._down = True

    @property
    def down(self) -> bool:
        """Did the last Redis call fail to connect or time out (registry writes queue)?"""
        return self._down

    # -- writing ---------------------------------------------------------------------------

    def flush(self, budget: int | None = None) -> int:
        """Write up to ``budget`` queued ops (all when None), oldest first; returns ops taken.

        On a Redis error the ops stay queued and the error propagates; the service loop backs
        off and calls flush again. Connection errors are retried until Redis is back; other
        errors (BUSY, OOM, READONLY...) up to ``MAX_REDIS_FAILURES`` times, then the ops are
        dropped and counted. First, if a master was replaced since the last look, the journal
        is written again (:meth:`after_failover`).

        With ``overlap``, a budgeted slice is left in flight: the next flush builds its own write
        first, then settles that one (:meth:`settle`: its errors raise here, as an inline write's
        would, with both slices back at the head of the queue in order), then sends. Anything
        else that touches the registry settles first; a flush of all (budget None) completes its
        write before returning.
        """
        if budget is None or self._failed_over or self.queue.registry or self._down:
            self.settle()
        if self._failed_over or (not self._down and self.masters.replaced()):  # down: one blocking call a turn
            self.settle()
            self.after_failover()
        if self.queue.registry:
            self._apply_registry()
        self._down = False
        taken = self.queue.take(budget)
        if not taken:
            self.settle()
            return 0
        n = sum(len(b.ops) for b in taken)
        pending, self._in_flight = self._in_flight, None
        if pending is not None and not all((b.instance_id, b.worker_id) in self._registered for b in taken):
            self._settle(pending, taken)  # the registry is read (maybe written) for them: after the write in flight
            pending = None
        try:
            built = self._guarded(taken, lambda: self._prepare(taken), last=False)
        except BaseException:
            self._in_flight = pending  # this slice is back at the head; the one in flight settles next time
            raise
        if pending is not None:
            self._settle(pending, taken)
        if built is not None:
            read = self._guarded(taken, built, last=False)
            if read is not None:
                if self.overlap and budget is not None:
                    self._in_flight = InFlight(taken, read, n)
                else:
                    self._guarded(taken, read)
        return n

    def settle(self) -> None:
        """Read the replies of the slice in flight, if any (a no-op without ``overlap``). A failed
        write is handled as an inline one: its ops go back to the head of the queue (connection
        errors; other Redis errors up to ``MAX_REDIS_FAILURES`` times, then dropped and counted)
        and the error raises."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            self._settle(pending)

    def _settle(self, pending: InFlight, behind: list[Batch] | None = None) -> None:
        """Read a sent slice's replies; when it fails and stays queued, ``behind`` (a slice taken
        after it, not sent) goes back too, after it."""
        self._guarded(pending.batches, pending.finish, behind=behind or [])

    def settle_quietly(self) -> None:
        """:meth:`settle` before a registry message or request: a Redis error is logged (its ops
        are back in the queue, Redis marked down on a connection error) and the message goes on."""
        try:
            self.settle()
        except redis.RedisError as exc:
            log.warning("the write in flight failed (%s); its ops are queued again", exc)

    def _guarded(self, taken: list[Batch], step: Callable[[], Any], last: bool = True,
                 behind: list[Batch] | None = None) -> Any:
        """Run one step of a slice's write (``last``: the step that completes it, whose success
        resets the failure count); on a Redis error put the slice back, ``behind`` after it (or
        drop the slice after ``MAX_REDIS_FAILURES``) and raise; returns what the step returns
        (None when dropped)."""
        try:
            out = step()
            if last:
                self._redis_failures = 0
            return out
        except (redis.ConnectionError, redis.TimeoutError):
            self.queue.put_back([*taken, *(behind or [])])
            self._down = True
            raise
        except redis.RedisError as exc:
            self._redis_failures += 1
            if self._redis_failures < MAX_REDIS_FAILURES:
                self.queue.put_back([*taken, *(behind or [])])
                raise
            self._redis_failures = 0
            for b in taken:
                metrics.count_ops(b.ops, "redis_error")
            log.error("dropped %d batches after %d Redis errors: %s", len(taken), MAX_REDIS_FAILURES, exc)
            return None

    def _prepare(self, taken: list[Batch]) -> Callable[[], Callable[[], None] | None] | None:
        """Build the writable batches' write (Store.apply_prepare); returns the function that
        sends it and returns the one that reads its replies and counts the ops (None: nothing
        to read), or None when there is nothing to send."""
        writable = [b for b in taken if self._writable(b)]
        todo = [(b.instance_id, b.worker_id, b.location, b.ops) for b in writable]
        try:
            prepared = self.store.apply_prepare(todo, lost_raises=True)
        except NotRegistered:  # a worker left the registry since we looked (nothing sent)
            return lambda: self._one_by_one(writable)

        def send() -> Callable[[], None]:
            read = prepared()

            def finish() -> None:
                try:
                    try:
                        read()
                    except HoldersLost as exc:  # a holder or registration a failover lost: heal the registry first
                        log.warning("%s: healing before writing them", exc)
                        self.after_failover()
                        self.store.apply(todo)
                except NotRegistered:
                    self._one_by_one(writable)
                    return
                for b in writable:
                    metrics.count_ops(b.ops, "applied")

            return finish

        return send

    def _one_by_one(self, writable: list[Batch]) -> None:
        """A worker left the registry since we looked: sort the batches out one by one."""
        self._registered.clear()
        for b in writable:
            if self._writable(b):
                try:
                    self._apply([b])
                except NotRegistered:
                    metrics.count_ops(b.ops, "unregistered")
                    log.info("dropped %d ops of unregistered worker %s/%s", len(b.ops), b.instance_id,
                             b.worker_id)
                    continue
                metrics.count_ops(b.ops, "applied")

    def _apply(self, batches: list[Batch]) -> None:
        """Write batches; one that meets a holder or a registration a failover lost heals the
        registry first (:meth:`after_failover`: the watch may not have told yet), then writes."""
        todo = [(b.instance_id, b.worker_id, b.location, b.ops) for b in batches]
        try:
            self.store.apply(todo, lost_raises=True)
        except HoldersLost as exc:
            log.warning("%s: healing before writing them", exc)
            self.after_failover()
            self.store.apply(todo)

    def _writable(self, b: Batch) -> bool:
        """Is the batch's worker registered? A 0.3-era admit registers it; else it is dropped."""
        key = (b.instance_id, b.worker_id)
        if key in self._registered:
            return True
        if self.store.is_registered(*key):  # registered through another sidecar (one killed, say): its now
            try:
                self.store.own(self.sidecar_id, key[0])
            except Refused as exc:  # another writer holds it after all (the policy's answer was a second old)
                self._refused("KVAdmitMsg", exc)
                metrics.count_ops(b.ops, "unregistered")
                return False
            self._registered.add(key)
            return True
        if key in self._held and self._heal(key):
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
        healed = sum(self._heal(key) for key in list(self._held) if key not in self.queue.registry)
        for instance_id in {i for i, _w in self._held}:
            try:
                self.store.own(self.sidecar_id, instance_id)
            except Refused as exc:  # another writer holds it now: this sidecar's copy is not re-asserted
                self._refused("RegisterMsg", exc)
        ops, span = self.store.rewrite_journal()
        self._failed_over = False
        log.warning("failover: wrote the ops of the last %.0f s again (%d); %d of %d workers registered again; "
                    "full sync of every worker at its next heartbeat", span, ops, healed, len(self._held))

    def _heal(self, key: tuple[str, int]) -> bool:
        """Write again a registration of this process the registry lost (Store.reassert_worker);
        True when it was missing or older. A worker that left since is forgotten."""
        held = self._held[key]
        try:
            self.store.own(self.sidecar_id, key[0])  # first: another writer's instance is not re-asserted
            epoch = self.store.reassert_worker(*key, held.epoch, held.at_ms, held.ip, held.port, held.url)
        except Refused as exc:
            self._refused("RegisterMsg", exc)
            epoch = None
        if epoch is None:
            if not self.store.is_registered(*key):
                self.forget(*key)
            return False
        held.epoch = epoch
        self._registered.add(key)
        log.warning("the registry lost worker %s/%s (a failover?): registered it again, epoch %d", *key, epoch)
        return True

    # -- registry --------------------------------------------------------------------------

    def _register(self, msg: proto.Register) -> int | None:
        url = msg.peer_init_url if msg.peer_init_url is not None else msg.distributed_url
        return self._register_worker(msg.instance_id, msg.worker_id, msg.ip, msg.port, url)

    def _register_worker(self, instance_id: str, worker_id: int, ip: str = "", port: int = 0,
                         url: str | None = None) -> int | None:
        """Register now, or queue the registration while Redis cannot answer; returns the
        epoch, or None when queued."""
        self.drop_queued(instance_id, worker_id)  # a new epoch: queued ops of the old one are moot
        self._reset_seq(instance_id, worker_id)
        write = RegistryWrite(True, ip, port, url)
        if not self._down and not self.queue.registry:
            try:
                return self._apply_registration((instance_id, worker_id), write)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._down = True
                log.warning("Redis cannot answer (%s): the registration of %s worker %d waits for it", exc,
                            instance_id, worker_id)
        self.queue.put_registry(instance_id, worker_id, write)
        return None

    def _apply_registration(self, key: tuple[str, int], w: RegistryWrite) -> int:
        at_ms = self.store.clock.now_ms()
        self.store.own(self.sidecar_id, key[0])  # first: OtherWriter before any write (issue 20 item 10)
        epoch = self.store.register_worker(*key, w.ip, w.port, w.url)
        self.store.expect_epoch(*key, epoch)
        staleness.clear(self.store.r, key[0])  # a new epoch: nothing old counts
        self._held[key] = Held(w.ip, w.port, w.url, epoch, at_ms)
        self._registered.add(key)
        self._synced.add(key)
        self.observer.registered(*key)
        log.info("registered %s worker %d (%s:%d), epoch %d", *key, w.ip, w.port, epoch)
        return epoch

    def _apply_registry(self) -> None:
        """Apply the registry writes queued while Redis could not answer, oldest first (each
        leaves the queue once written; a Redis error propagates with the rest kept)."""
        while self.queue.registry:
            key, w = next(iter(self.queue.registry.items()))
            try:
                if w.register:
                    self._apply_registration(key, w)
                else:
                    self.store.deregister_worker(*key)
            except (redis.ConnectionError, redis.TimeoutError):
                self._down = True
                raise
            except Refused as exc:  # e.g. too many workers: as it would have been answered at once
                self._refused("RegisterMsg", exc)
            except redis.RedisError as exc:
                self._redis_failures += 1
                if self._redis_failures < MAX_REDIS_FAILURES:
                    raise
                self._redis_failures = 0
                log.error("dropped the queued registry write of %s/%s after %d Redis errors: %s", *key,
                          MAX_REDIS_FAILURES, exc)
            self.queue.registry.pop(key, None)
            log.info("applied the queued %sregistration of %s worker %d (waited %.1f s)",
                     "" if w.register else "de", *key, time.monotonic() - w.queued_at)

    def _deregister(self, instance_id: str, worker_id: int) -> None:
        self.drop_queued(instance_id, worker_id)
        self.forget(instance_id, worker_id)
        self.observer.forget(instance_id, worker_id)
        if not self._down and not self.queue.registry:
            try:
                known = self.store.deregister_worker(instance_id, worker_id)
                log.info("deregistered %s worker %d%s", instance_id, worker_id, "" if known else " (was unknown)")
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._down = True
                log.warning("Redis cannot answer (%s): the deregistration of %s worker %d waits for it", exc,
                            instance_id, worker_id)
        self.queue.put_registry(instance_id, worker_id, RegistryWrite(False))

    def forget(self, instance_id: str, worker_id: int | str) -> None:
        """Drop what this process knows of a worker that left the registry, so its next
        heartbeat or record re-registers it (and, for 0.5.x, asks for a full sync)."""
        wid = int(worker_id) if isinstance(worker_id, str) and worker_id.isdigit() else worker_id
        self._registered.discard((instance_id, wid))
        if self._held.pop((instance_id, wid), None) is not None:  # type: ignore[arg-type]
            self.store.expect_epoch(instance_id, wid, None)
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
        if refused := self._refuse(tag, msg):
            return proto.encode(proto.ErrorMsg(error=refused))
        metrics.MESSAGES.labels(tag).inc()
        self.settle_quietly()  # every request reads or writes the registry: after the write sent before it
        try:
            self._seen(conn, msg)
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

    def _heartbeat(self, msg: proto.Register) -> proto.HeartbeatRetMsg | proto.ErrorMsg:
        """Refresh a worker. One this process has not registered or synced since it started
        (or that skipped a seq) is asked for a full sync, once."""
        key = (msg.instance_id, msg.worker_id)
        if key in self.queue.registry:  # its registration waits for Redis: no error for a transient failure
            return proto.HeartbeatRetMsg()
        if self._down:  # answer at once rather than after a socket timeout (the worker's is 30 s)
            return proto.ErrorMsg(error="index unavailable: Redis cannot answer")
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


def _folded(operations) -> dict[str, str]:
    """A frame's ops as {chunk hash text: its last op (ADMIT or EVICT)}: one dict the queue
    merges in one ``update`` (a generator of pairs cost ~0.5 us an op more, in Python calls).
    ``str`` is :func:`chunk_text` for the int and str keys the wire allows, without a Python call
    an op (0.44-0.53 vs 0.63-0.68 us an op, timeit)."""
    return {str(op.key): (ADMIT if op.op_type == "admit" else EVICT) for op in operations}
