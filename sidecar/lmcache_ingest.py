"""Apply LMCache worker messages to the index (no sockets here; see sidecar.service).

Push frames (PULL socket) are decoded one by one; admits and evicts are gathered and written
in one pipelined round trip per multipart message, in arrival order per (instance, worker,
location). Registry messages flush pending writes first, so order holds across them too.
A frame that fails to decode or apply is counted and logged; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from kvlookup import lmcache_protocol as proto
from kvlookup import metrics
from kvlookup.store import ADMIT, EVICT, NotRegistered, Store
from sidecar.admission import InstancePolicy

log = logging.getLogger(__name__)

Batch = tuple[str, int, str, list[tuple[str, Any]]]

#: Non-connection Redis errors (BUSY, OOM, READONLY...) tolerated for one pending batch
#: before it is dropped and counted, so a persistent error cannot wedge the sidecar.
MAX_REDIS_FAILURES = 5


class LMCacheIngest:
    """Turns decoded LMCache messages into index writes.

    store: the index. heartbeat_url: advertised to 0.3.12+ workers in RegisterRetMsg so their
    heartbeats reach this sidecar ("" = none). policy: which instance ids are accepted (any).
    """

    def __init__(self, store: Store, heartbeat_url: str = "", policy: InstancePolicy | None = None):
        self.store = store
        self.policy = policy or InstancePolicy()
        self.heartbeat_url = heartbeat_url
        self.instances: set[str] = set()  # instances whose liveness this sidecar refreshes
        self.pinned: set[str] = set()  # configured instances: refreshed even with no worker seen
        self._workers: dict[str, set[int]] = {}  # workers registered through this process
        self._redis_failures = 0
        self._next_seq: dict[tuple[str, int, str], int] = {}
        self._pending: list[Batch] = []

    # -- push channel ----------------------------------------------------------------------

    def handle_push(self, frames: list[bytes]) -> None:
        """Apply one multipart PUSH message (one LMCache message per frame)."""
        for frame in frames:
            try:
                tag, msg = proto.decode_frame(frame)
            except proto.FrameError as exc:
                metrics.REJECTED.labels("lmcache", exc.reason).inc()
                log.warning("rejected frame (%d bytes): %s", len(frame), exc)
                continue
            if self.policy.refuse(tag, msg):
                continue
            metrics.MESSAGES.labels(tag).inc()
            try:
                self._on_push(tag, msg)
            except Exception:  # a bad message never stops the loop
                metrics.REJECTED.labels("lmcache", "handler_error").inc()
                log.exception("failed to handle %s", tag)
        self.flush()

    def _on_push(self, tag: str, msg: Any) -> None:
        if tag == "KVAdmitMsg" or tag == "KVEvictMsg":
            self._queue(msg.instance_id, msg.worker_id, msg.location,
                        [(ADMIT if tag == "KVAdmitMsg" else EVICT, msg.key)])
        elif tag == "BatchedKVOperationMsg":
            self._check_seq(msg)
            ops = [(ADMIT if op.op_type == "admit" else EVICT, op.key) for op in msg.operations]
            self._queue(msg.instance_id, msg.worker_id, msg.location, ops)
        elif tag == "FullSyncBatchMsg":
            self._queue(msg.instance_id, msg.worker_id, msg.location, [(ADMIT, k) for k in msg.keys])
        elif tag in ("RegisterMsg", "HeartbeatMsg"):
            self.flush()
            if tag == "RegisterMsg" or not self.store.heartbeat_worker(msg.instance_id, msg.worker_id):
                self._register(msg)
        elif tag == "DeRegisterMsg":
            self.flush()
            self._deregister(msg.instance_id, msg.worker_id)
        elif tag == "FullSyncEndMsg":
            log.info("full sync %s of %s/%s/%s ended with %d keys", msg.sync_id, msg.instance_id,
                     msg.worker_id, msg.location, msg.actual_total_keys)
        else:
            metrics.REJECTED.labels("lmcache", "wrong_channel").inc()
            log.warning("%s is a request; it belongs on the reply socket", tag)

    def _queue(self, instance_id: str, worker_id: int, location: str, ops: list) -> None:
        if self._pending and self._pending[-1][:3] == (instance_id, worker_id, location):
            self._pending[-1][3].extend(ops)
        else:
            self._pending.append((instance_id, worker_id, location, list(ops)))

    def flush(self) -> None:
        """Write every pending op in one round trip.

        On a Redis error the ops stay pending and the error propagates; the service loop
        backs off and calls flush again before reading more frames. Connection errors are
        retried until Redis is back; other errors (BUSY, OOM, READONLY...) up to
        ``MAX_REDIS_FAILURES`` times, then the ops are dropped and counted.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            self._write(pending)
            self._redis_failures = 0
        except (redis.ConnectionError, redis.TimeoutError):
            self._pending = pending + self._pending  # nothing lost: the loop retries
            raise
        except redis.RedisError as exc:
            self._redis_failures += 1
            if self._redis_failures < MAX_REDIS_FAILURES:
                self._pending = pending + self._pending
                raise
            self._redis_failures = 0
            for batch in pending:
                metrics.count_ops(batch[3], "redis_error")
            log.error("dropped %d batches after %d Redis errors: %s", len(pending), MAX_REDIS_FAILURES, exc)

    def _write(self, pending: list[Batch]) -> None:
        for inst, wid, _loc, _ops in pending:
            if not self._seen(inst, wid) and not self.store.is_registered(inst, wid):
                log.info("records for unregistered worker %s/%s: registering it", inst, wid)
                self.store.register_worker(inst, wid)
            self._see(inst, wid)
        try:
            self.store.apply(pending)
        except NotRegistered:
            # a worker deregistered between the check and the write: apply the others
            for batch in pending:
                self._apply_one(batch)
            return
        for batch in pending:
            metrics.count_ops(batch[3], "applied")

    def _apply_one(self, batch: Batch) -> None:
        inst, wid = batch[0], batch[1]
        try:
            self.store.apply([batch])
        except NotRegistered:
            # deregistered or reaped elsewhere while this process thought it known (0.3.x
            # workers register once): register again, as for any unknown worker, and retry
            log.info("worker %s/%s vanished from the registry: registering it again", inst, wid)
            self._unsee(inst, wid)
            self.store.register_worker(inst, wid)
            self._see(inst, wid)
            self.store.apply([batch])
        metrics.count_ops(batch[3], "applied")

    # -- workers this process has seen -----------------------------------------------------

    def _seen(self, instance_id: str, worker_id: int) -> bool:
        return worker_id in self._workers.get(instance_id, ())

    def _see(self, instance_id: str, worker_id: int) -> None:
        self._workers.setdefault(instance_id, set()).add(worker_id)
        self.instances.add(instance_id)

    def _unsee(self, instance_id: str, worker_id: int) -> None:
        """Forget a worker; an instance with no worker left here is no longer refreshed."""
        workers = self._workers.get(instance_id)
        if workers is not None:
            workers.discard(worker_id)
            if not workers:
                del self._workers[instance_id]
                if instance_id not in self.pinned:
                    self.instances.discard(instance_id)

    def pin(self, *instance_ids: str) -> None:
        """Instances whose liveness this sidecar refreshes even before (or without) a worker."""
        self.pinned.update(instance_ids)
        self.instances.update(instance_ids)

    def _reset_seq(self, instance_id: str, worker_id: int) -> None:
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
            log.warning("seq gap from %s: expected %d, got %d", source, expected, first)
        self._next_seq[source] = msg.operations[-1].seq_num + 1

    # -- registry --------------------------------------------------------------------------

    def _register(self, msg: proto.Register) -> int:
        url = msg.peer_init_url if msg.peer_init_url is not None else msg.distributed_url
        epoch = self.store.register_worker(msg.instance_id, msg.worker_id, msg.ip, msg.port, url)
        self._see(msg.instance_id, msg.worker_id)
        self._reset_seq(msg.instance_id, msg.worker_id)
        log.info("registered %s worker %d (%s:%d), epoch %d", msg.instance_id, msg.worker_id,
                 msg.ip, msg.port, epoch)
        return epoch

    def _deregister(self, instance_id: str, worker_id: int) -> None:
        known = self.store.deregister_worker(instance_id, worker_id)
        self._unsee(instance_id, worker_id)
        log.info("deregistered %s worker %d%s", instance_id, worker_id, "" if known else " (was unknown)")

    def forget(self, instance_id: str, worker_id: int | str) -> None:
        """Drop what this process knows of a worker the reaper deregistered, so its next
        heartbeat or record re-registers it (and, for 0.5.x, asks for a full sync)."""
        wid = int(worker_id) if isinstance(worker_id, str) and worker_id.isdigit() else worker_id
        self._unsee(instance_id, wid)
        self._reset_seq(instance_id, wid)

    # -- request channel (ROUTER) ----------------------------------------------------------

    def handle_request(self, payload: bytes) -> bytes:
        """Answer one worker request (0.3.12+ DEALER, or a 0.3.x REQ); returns the reply frame."""
        try:
            tag, msg = proto.decode_frame(payload)
        except proto.FrameError as exc:
            metrics.REJECTED.labels("lmcache", exc.reason).inc()
            log.warning("rejected request (%d bytes): %s", len(payload), exc)
            return proto.encode(proto.ErrorMsg(error=str(exc)))
        if refused := self.policy.refuse(tag, msg):
            return proto.encode(proto.ErrorMsg(error=refused))
        metrics.MESSAGES.labels(tag).inc()
        self.flush()
        try:
            return proto.encode(self._on_request(tag, msg))
        except Exception as exc:
            metrics.REJECTED.labels("lmcache", "handler_error").inc()
            log.exception("failed to answer %s", tag)
            return proto.encode(proto.ErrorMsg(error=f"controller error: {exc}"))

    def _on_request(self, tag: str, msg: Any) -> Any:
        if tag == "RegisterMsg":
            self._register(msg)
            extra = {"heartbeat_url": self.heartbeat_url} if self.heartbeat_url else {}
            return proto.RegisterRetMsg(extra_config=extra)
        if tag == "HeartbeatMsg":
            return self._heartbeat(msg)
        if tag == "FullSyncStartMsg":
            self.store.retire_location(msg.instance_id, msg.worker_id, msg.location)
            self._next_seq.pop((msg.instance_id, msg.worker_id, msg.location), None)
            log.info("full sync %s of %s/%s/%s: %d keys in %d batches", msg.sync_id, msg.instance_id,
                     msg.worker_id, msg.location, msg.total_keys, msg.batch_count)
            return proto.FullSyncStartRetMsg(sync_id=msg.sync_id, accepted=True)
        if tag == "FullSyncStatusMsg":
            return proto.FullSyncStatusRetMsg(sync_id=msg.sync_id, is_complete=True, global_progress=1.0,
                                              can_exit_freeze=True)
        if tag == "BatchedP2PLookupMsg":
            return proto.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")])
        # a push message sent on the request channel: apply it, acknowledge with an error
        self._on_push(tag, msg)
        self.flush()
        return proto.ErrorMsg(error=f"{tag} is not a request")

    def _heartbeat(self, msg: proto.Register) -> proto.HeartbeatRetMsg:
        """Refresh a worker; one this process has not seen is asked for a full sync."""
        key = (msg.instance_id, msg.worker_id)
        known = self.store.heartbeat_worker(msg.instance_id, msg.worker_id)
        if known and self._seen(*key):
            return proto.HeartbeatRetMsg()
        reason = "controller_restart" if known else "worker_re_registered"
        if known:
            self._see(*key)
        else:
            self._register(msg)
        metrics.RESYNCS.labels("lmcache", reason).inc()
        log.info("asking %s worker %d for a full sync (%s)", msg.instance_id, msg.worker_id, reason)
        return proto.HeartbeatRetMsg(commands=[proto.FullSyncCommand(reason=reason)])
