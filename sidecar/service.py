"""The sidecar process: LMCache sockets in one loop, vLLM streams in another, leases in Redis.

The LMCache loop owns the PULL and ROUTER sockets. Each turn it serves worker requests
(registration, heartbeats, full-sync control: small, answered at once), reads PUSH traffic
into a queue while the queue is below its bound, and writes one bounded slice of the queue,
so one huge message or a flood never holds the loop: leases are renewed and heartbeats answered
between slices. Once a second it renews the leases of every instance this sidecar owns (kept in
Redis, so a restarted sidecar resumes them), publishes its status, asks about workers that went
quiet (sidecar.liveness), and reaps workers there is evidence against; idle turns purge retired
records. vLLM streams run in their own thread (sidecar.vllm_zmq.VllmLoop).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis
import zmq

from kvlookup import metrics
from kvlookup.index import staleness
from kvlookup.index.fleet import reap
from kvlookup.index.store import Refused, Store
from kvlookup.netpolicy import LOOPBACK_NETWORKS, Networks
from kvlookup.proc.lifetime import release_memory
from kvlookup.sidecar.admission import InstancePolicy, OwnershipGate, PeerGate
from kvlookup.sidecar.liveness import Liveness
from kvlookup.sidecar.lmcache_ingest import LMCacheIngest
from kvlookup.sidecar.sockets import Limits, SocketSet, source_fd
from kvlookup.sidecar.turns import run_turns
from kvlookup.sidecar.vllm_zmq import VllmLoop, VllmSource
from kvlookup.wire import lmcache as proto
from kvlookup.wire.zmqaddr import endpoint

log = logging.getLogger(__name__)

#: Records purged per idle turn (one holder's buckets at a time; a few ms of Redis each).
PURGE_BUDGET = 20_000
#: Records purged per turn while ops are queued (ingest first).
BUSY_PURGE_BUDGET = 2_000
#: Requests and PUSH messages read per turn (then the turn writes a slice and comes back).
MAX_REQUESTS_PER_TURN = 200
MAX_PUSHES_PER_TURN = 50
#: Seconds between purge passes while the last one found nothing to purge (a pass that removed
#: records is followed by another on the next turn). An idle sidecar asks Redis about retired
#: holders once per this long, not once per turn.
PURGE_IDLE_EVERY_S = 1.0
#: Seconds between reaper passes of this sidecar.
REAP_EVERY_S = 5.0
#: After this many ops written, the sidecar gives memory back to the OS when its queue is empty.
RELEASE_AFTER_OPS = 200_000
#: How long a sidecar's own lease lasts (its status in /health goes "down" after this).
SIDECAR_LEASE_S = 5.0
#: A stopping sidecar (SIGTERM) reads what its sockets hold and writes every queued op, for at
#: most DRAIN_S; it stops reading once the PULL socket stayed quiet for DRAIN_QUIET_S, or after
#: DRAIN_READ_S however busy its senders are (what they send later waits in their queues, or
#: goes to the next sidecar process).
DRAIN_S = 10.0
DRAIN_QUIET_S = 0.1
DRAIN_READ_S = 1.0


def default_sidecar_id(*urls: str | None) -> str:
    """``<hostname>/<first bound address>``: stable across restarts of the same sidecar."""
    first = next((u for u in urls if u), "")
    return f"{socket.gethostname()}/{first}"


class Sidecar:
    """Receives LMCache worker traffic and vLLM KV event streams.

    store: the index. pull_url: LMCache ``controller_pull_url`` to bind (PULL). reply_url:
    ``controller_reply_url`` to bind (ROUTER; 0.3.12+ registration, heartbeats, full sync), or
    None. sidecar_id: this sidecar's name in the registry (default :func:`default_sidecar_id`);
    a restarted sidecar with the same id resumes renewing the leases of the instances it owned.
    instance_ids: instances this sidecar vouches for from the start. heartbeat_s: seconds
    between lease renewals (default a third of ``instance_ttl_s``, at most 1). advertise_reply:
    the address workers should use for heartbeats ("" = the reply URL's host:port). vllm: vLLM
    instances whose KV event streams to ingest (sidecar.vllm_zmq). limits: bounds on frames, messages and queued ops.
    grace_s, probe_timeout_s, probe_retries, address_allowed: liveness evidence (sidecar.liveness).
    peers: addresses that may connect to the bound sockets (``allowed_peers``, loopback by
    default); allowed_instance_ids: instances whose LMCache messages are accepted (() = any).
    See sidecar.admission. overlap_writes: leave each LMCache slice's write in flight while the
    next turn reads and decodes (``lmcache_overlap_writes``; sidecar.lmcache_ingest).
    """

    def __init__(self, store: Store, pull_url: str | None, reply_url: str | None = None, *,
                 sidecar_id: str | None = None, instance_ids: tuple[str, ...] = (), heartbeat_s: float | None = None,
                 advertise_reply: str = "", vllm: tuple[VllmSource, ...] = (), limits: Limits | None = None,
                 grace_s: float = 5.0, probe_timeout_s: float = 2.0, probe_retries: int = 1,
                 address_allowed: Callable[[str], bool] = lambda _ip: True,
                 peers: Networks = LOOPBACK_NETWORKS, allowed_instance_ids: tuple[str, ...] = (),
                 overlap_writes: bool = True):
        self.store = store
        self.sidecar_id = sidecar_id or default_sidecar_id(pull_url, reply_url, *(v.endpoint for v in vllm))
        self.limits = limits or Limits()
        self.ctx = zmq.Context()
        self.gate = PeerGate(self.ctx, peers)  # one ZAP handler per context: every bound socket asks it
        self.gate.start()
        self.sockets = SocketSet(self.ctx, self.limits, guard=self.gate.guard)
        self.pinned = tuple(dict.fromkeys((*instance_ids, *(v.instance_id for v in vllm))))
        ttl_s = store.instance_ttl_ms / 1000
        self.heartbeat_s = heartbeat_s or (min(1.0, max(0.1, ttl_s / 3)) if ttl_s > 0 else 1.0)
        self.liveness = Liveness(store, self.sidecar_id, grace_s=grace_s, timeout_s=probe_timeout_s,
                                 retries=probe_retries, address_allowed=address_allowed)
        hb_url = advertise_reply or (_host_port(reply_url) if reply_url else "")
        self.ownership = OwnershipGate(store.other_writer, self.sidecar_id)  # issue 20 item 10: one writer per instance
        self.lmcache = LMCacheIngest(store, self.sidecar_id, heartbeat_url=hb_url, observer=self.liveness,
                                     policy=InstancePolicy(allowed_instance_ids, self.ownership),
                                     overlap=overlap_writes)
        self.claimed = tuple(allowed_instance_ids)
        self._stop = threading.Event()
        self.started_at = time.time()
        self.last_turn = time.monotonic()  # when the loop last turned (sidecar /health)
        self._written = 0  # ops written since memory was last released
        self._next_purge: float = 0.0  # no purge pass before this (monotonic s)
        self.status: dict = {}
        self.pull = self.router = None
        self.names: dict[zmq.Socket, str] = {}
        if pull_url:
            self.pull = self._bind(zmq.PULL, pull_url, self._on_pull, "pull")
        if reply_url:
            self.router = self._bind(zmq.ROUTER, reply_url, self._on_router, "reply")
        self.vllm = VllmLoop(store, vllm, sidecar_id=self.sidecar_id, sockets=SocketSet(
            self.ctx, self.limits, guard=self.gate.guard), grace_s=grace_s) if vllm else None

    def _bind(self, kind: int, url: str, handler, name: str) -> zmq.Socket:
        def on_event(event: int, fd: int, _endpoint: str) -> None:
            if event == zmq.EVENT_ACCEPTED:
                self.liveness.accepted((name, fd))
            elif event == zmq.EVENT_DISCONNECTED:
                self.liveness.disconnected((name, fd))

        sock = self.sockets.add(kind, handler, bind=endpoint(url), on_event=on_event)
        self.names[sock] = name  # connections are (socket name, descriptor)
        return sock

    # -- handlers ----------------------------------------------------------------------------

    def _read(self, sock: zmq.Socket) -> tuple[list[bytes], tuple[str, int] | None] | None:
        """One multipart message (frames, connection); None when it breaks the size limit."""
        frames = sock.recv_multipart(copy=False)
        size = sum(len(f) for f in frames)
        if size > self.limits.max_message_bytes:
            metrics.REJECTED.labels("lmcache", "message_too_large").inc()
            log.warning("dropped a %d-frame message of %d bytes (max_message_bytes %d)", len(frames), size,
                        self.limits.max_message_bytes)
            return None
        fd = source_fd(frames[-1])
        return [f.bytes for f in frames], (self.names[sock], fd) if fd is not None else None

    def _on_pull(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_PUSHES_PER_TURN):
            if self.lmcache.queued_ops >= self.limits.max_queued_ops:
                return  # back pressure: the rest waits in ZMQ (RCVHWM), then in the senders
            try:
                got = self._read_nowait(sock)
            except zmq.Again:
                return
            if got is not None:
                self.lmcache.handle_push(*got)

    def _read_nowait(self, sock: zmq.Socket):
        if not sock.poll(0):
            raise zmq.Again()
        return self._read(sock)

    def _on_router(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_REQUESTS_PER_TURN):
            try:
                got = self._read_nowait(sock)
            except zmq.Again:
                return
            if got is None:
                continue
            frames, conn = got
            if len(frames) < 2:
                log.warning("ROUTER message with %d frame(s) ignored", len(frames))
                continue
            identity, payload = frames[0], frames[-1]
            envelope = [identity, b""] if len(frames) >= 3 and frames[1] == b"" else [identity]
            reply = proto.encode(proto.ErrorMsg(error="controller error"))
            try:
                reply = self.lmcache.handle_request(payload, conn)
            finally:  # a REQ/DEALER worker waits for a reply: it always gets one
                sock.send_multipart([*envelope, reply])

    # -- periodic ----------------------------------------------------------------------------

    def _start(self) -> None:
        for instance_id, prev in self.store.claim(self.sidecar_id, self.claimed).items():
            log.warning("sidecar %s: instance %s was claimed by sidecar %s (allowed_instance_ids): it is this "
                        "sidecar's now", self.sidecar_id, instance_id, prev)
        for instance_id in self.pinned:
            try:
                self.store.own(self.sidecar_id, instance_id)
            except Refused as exc:  # another writer holds it: its lease is not renewed here, its traffic refused
                metrics.REJECTED.labels("sidecar", exc.reason).inc()
                log.warning("sidecar %s: not taking instance %s (--instance-id): %s", self.sidecar_id, instance_id,
                            exc)
        killed = staleness.unclean_stop(self.store.r, self.sidecar_id)
        self._let_go_unserved()
        owned = self.store.renew(self.sidecar_id, SIDECAR_LEASE_S)
        log.info("sidecar %s: resuming %d owned instance(s)", self.sidecar_id, owned)
        if killed is not None:
            self._mark_possibly_stale(killed)
        if self.vllm is not None:
            self.vllm.start()

    def _let_go_unserved(self) -> None:
        """A vLLM-only sidecar serves exactly its ``--instance-id``s: instances an earlier run under
        the same sidecar id owned and this one does not serve are let go (their leases lapse and
        they are reaped), not renewed for ever. A sidecar with LMCache sockets keeps them all: its
        workers register again."""
        if self.pull is not None or self.router is not None:
            return
        gone = self.store.owned(self.sidecar_id) - set(self.pinned)
        if gone and self.store.disown(self.sidecar_id, gone):
            log.warning("sidecar %s: no longer serving %s (owned by an earlier run with other --instance-id): "
                        "their leases are left to lapse", self.sidecar_id, ", ".join(sorted(gone)[:10]))

    def _mark_possibly_stale(self, last: dict) -> None:
        """The previous run was killed (it never signed off): ops it had received and not
        written are lost. Instances whose engine will not replay them are marked (issue 20 item 5)."""
        pid, when = last.get("pid", "?"), last.get("updated_at", "?")
        reason = (f"sidecar {self.sidecar_id} (pid {pid}) stopped without draining (killed?) after its last "
                  f"status at {when}: ops it had received but not written are lost; a re-registration or full "
                  "sync of a worker clears this")
        marked = staleness.mark_unhealed(self.store.r, self.store.owned(self.sidecar_id), self.store.clock.now_ms(),
                                         reason)
        log.warning("sidecar %s: the previous run did not sign off; %d instance(s) marked possibly stale: %s",
                    self.sidecar_id, len(marked), ", ".join(marked[:10]))

    def _tick(self) -> None:
        self.store.renew(self.sidecar_id, SIDECAR_LEASE_S)
        self.liveness.tick()
        self._publish_status()

    def _reap(self) -> None:
        for instance_id, worker_id in reap(self.store):
            metrics.REAPED.inc()
            self.lmcache.forget(instance_id, worker_id)
            self.liveness.forget(instance_id, worker_id)

    def _purge(self, budget: int) -> None:
        """Purge up to ``budget`` retired records; after a pass that found none, wait
        ``PURGE_IDLE_EVERY_S`` before the next, or less when a retired holder's purge grace
        ends sooner (a cluster's 5 s after a failover's heal retired a cold restart's holder:
        purged when it ends, not up to a second later)."""
        now = time.monotonic()
        if now < self._next_purge:
            return
        removed = self.store.purge(budget)
        if removed:
            log.debug("purged %d retired records", removed)
            return
        due = self.store.next_purge_s() if self.store.purge_grace_ms else None
        self._next_purge = now + (PURGE_IDLE_EVERY_S if due is None else min(PURGE_IDLE_EVERY_S, max(0.05, due + 0.01)))

    def _after_burst(self) -> None:
        """Once a burst of ingest is over (nothing queued, much written since the last time),
        return the memory it used to the OS."""
        if self._written >= RELEASE_AFTER_OPS and not self.lmcache.queued_ops:
            self._written = 0
            release_memory()

    def _publish_status(self) -> None:
        self.status = {"sidecar_id": self.sidecar_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "started_at": round(self.started_at, 3), "queued_ops": self.lmcache.queued_ops,
                       "lag_ms": round(self.lmcache.lag_s() * 1000, 1), "updated_at": round(time.time(), 3)}
        self.store.publish_status(self.sidecar_id, self.status)

    # -- loop --------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`. Redis outages pause the loop; nothing queued is lost."""
        self._next_tick = self._next_reap = self._next_purge = 0.0
        self._started = False
        run_turns(self._turn, self._stop, "sidecar")
        self._drain()
        self._sign_off()
        self.close()

    def _turn(self) -> None:
        if not self._started:
            self._start()
            self._started = True
        if self.lmcache.down:  # Redis failing: answer the workers before the next try may block
            for sock in self.sockets.poll(0) if self.sockets.handlers else ():
                self.sockets.handlers[sock](sock)
        now = time.monotonic()
        down: redis.RedisError | None = None
        try:
            if now >= self._next_tick or now >= self._next_reap:
                self.lmcache.settle()  # probes and reaps retire workers: after the write in flight
            if now >= self._next_tick:
                self._tick()
                self._next_tick = now + self.heartbeat_s
            if now >= self._next_reap:
                self._reap()
                self._next_reap = now + REAP_EVERY_S
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            down = exc  # Redis cannot answer: still serve the workers (registrations queue), then back off
            self.lmcache.redis_down()
        was_down = self.lmcache.down
        busy = self.lmcache.queued_ops > 0
        wait_ms = 0 if busy or down else int(max(0.0, min(self._next_tick - time.monotonic(), 0.2)) * 1000)
        if self.sockets.handlers:
            for sock in self.sockets.poll(wait_ms):
                self.sockets.handlers[sock](sock)
        else:  # vLLM only: no socket here to wait on (zmq's poll of none returns at once)
            self._stop.wait(wait_ms / 1000)
        if down is not None:
            raise down
        if self.lmcache.down and not was_down:  # a handler found Redis not answering: serve the sockets again
            raise redis.ConnectionError("Redis stopped answering while serving workers")  # before the next try
        self._written += self.lmcache.flush(self.limits.slice_ops)
        self._purge(BUSY_PURGE_BUDGET if self.lmcache.queued_ops else PURGE_BUDGET)
        self._after_burst()
        self.last_turn = time.monotonic()

    def _drain(self) -> None:
        """Stopping on purpose loses no acknowledged op (issue 20 item 5): what the LMCache sockets
        already received is read and answered, and every queued op written, until the PULL
        socket is quiet and the queue empty, or DRAIN_S passed (Redis failing throughout)."""
        if not self._started:
            return
        start = time.monotonic()
        end = start + DRAIN_S
        quiet_since = start
        while time.monotonic() < end:
            try:
                reading = time.monotonic() - start < DRAIN_READ_S
                for sock in self.sockets.poll(0) if reading else ():
                    self.sockets.handlers[sock](sock)
                    if sock in (self.pull, self.router):
                        quiet_since = time.monotonic()
                if not reading:
                    quiet_since = float("-inf")
                self.lmcache.flush(self.limits.slice_ops)
            except redis.RedisError as exc:
                log.warning("sidecar %s: draining: redis error (%s); retrying", self.sidecar_id, exc)
                time.sleep(0.1)
                continue
            if not self.lmcache.queued_ops and time.monotonic() - quiet_since >= DRAIN_QUIET_S:
                return
            if not self.lmcache.queued_ops:
                time.sleep(0.005)
        self.lmcache.settle_quietly()
        log.warning("sidecar %s: stopped with %d op(s) unwritten after %.0f s of draining", self.sidecar_id,
                    self.lmcache.queued_ops, DRAIN_S)

    def _sign_off(self) -> None:
        if not self._started:
            return
        try:
            self.store.sign_off(self.sidecar_id)
        except redis.RedisError as exc:  # Redis gone too: the lease lapses on its own
            log.warning("sidecar %s: could not sign off: %s", self.sidecar_id, exc)

    def stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the vLLM loop, close every socket and the context."""
        if self.vllm is not None:
            self.vllm.stop()
            self.vllm.join(5)
        self.liveness.close()
        self.sockets.close()
        self.gate.stop()
        self.ctx.term()


def _host_port(url: str) -> str:
    return endpoint(url).split("://", 1)[1]
