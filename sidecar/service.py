"""The sidecar process: ZMQ sockets, one poll loop, periodic liveness and purge.

One thread owns every socket. Each readable socket's handler runs to completion before the
next poll, so writes keep their arrival order. Periodic work (liveness keys, purge of retired
records) runs between polls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
import zmq

from kvlookup import lmcache_protocol as proto
from kvlookup import metrics
from kvlookup.fleet import reap
from kvlookup.netpolicy import LOOPBACK_NETWORKS, Networks
from kvlookup.store import Store
from kvlookup.zmqaddr import endpoint
from sidecar.admission import InstancePolicy, PeerGate
from sidecar.lmcache_ingest import LMCacheIngest
from sidecar.vllm_ingest import VllmIngest
from sidecar.vllm_zmq import VllmSource, attach

log = logging.getLogger(__name__)

#: Records purged per periodic step (bounded so ingest is never starved).
PURGE_BUDGET = 20_000
MAX_FRAMES_PER_MESSAGE = 10_000
#: Largest frame a peer may send (ZMQ_MAXMSGSIZE); a peer sending more is disconnected.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Sidecar:
    """Receives LMCache worker traffic (and, via :meth:`add_socket`, other sources).

    store: the index. pull_url: LMCache ``controller_pull_url`` to bind (PULL).
    reply_url: ``controller_reply_url`` to bind (ROUTER; 0.3.12+ registration, heartbeats,
    full sync), or None. instance_ids: instances whose liveness this sidecar vouches for from
    the start (instances seen in traffic are added). advertise_reply: the address workers
    should use for heartbeats ("" = the reply URL's host:port). vllm: vLLM instances whose KV
    event streams to ingest (see sidecar.vllm_zmq); their ids are vouched for too.
    peers: addresses that may connect to the bound sockets (``allowed_peers``, loopback by
    default); allowed_instance_ids: instances whose LMCache messages are accepted (() = any).
    See sidecar.admission.
    """

    def __init__(self, store: Store, pull_url: str | None, reply_url: str | None = None, *,
                 instance_ids: tuple[str, ...] = (), heartbeat_s: float | None = None,
                 advertise_reply: str = "", vllm: tuple[VllmSource, ...] = (),
                 peers: Networks = LOOPBACK_NETWORKS, allowed_instance_ids: tuple[str, ...] = ()):
        self.store = store
        self.ctx = zmq.Context()
        self.gate = PeerGate(self.ctx, peers)
        self.gate.start()
        self.poller = zmq.Poller()
        self.handlers: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        hb_url = advertise_reply or (_host_port(reply_url) if reply_url else "")
        self.lmcache = LMCacheIngest(store, heartbeat_url=hb_url, policy=InstancePolicy(allowed_instance_ids))
        self.lmcache.pin(*instance_ids)
        self.heartbeat_s = heartbeat_s or max(0.5, store.instance_ttl_ms / 3000)
        self.tasks: list[Callable[[], None]] = [self._touch_instances, self._reap, self._purge]
        self._stop = threading.Event()
        self.closers: list[Callable[[], None]] = []
        self.pull = self.router = None
        self.vllm: dict[str, VllmIngest] = {}
        for source in vllm:
            self.vllm[source.instance_id] = attach(self, source)
            self.lmcache.pin(source.instance_id)
        if pull_url:
            self.pull = self.add_socket(zmq.PULL, endpoint(pull_url), self._on_pull)
        if reply_url:
            self.router = self.add_socket(zmq.ROUTER, endpoint(reply_url), self._on_router)

    def add_socket(self, kind: int, bind: str | None, handler: Callable[[zmq.Socket], None],
                   connect: str | None = None) -> zmq.Socket:
        """Create, bind (or connect) and poll a socket; ``handler(sock)`` runs when readable."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind in (zmq.PULL, zmq.SUB, zmq.ROUTER):
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if bind:
            self.gate.guard(sock, bind)
            sock.bind(bind)
        if connect:
            sock.connect(connect)
        self.poller.register(sock, zmq.POLLIN)
        self.handlers[sock] = handler
        return sock

    def remove_socket(self, sock: zmq.Socket) -> None:
        """Stop polling and close a socket."""
        self.poller.unregister(sock)
        self.handlers.pop(sock, None)
        sock.close(0)

    # -- handlers ----------------------------------------------------------------------------

    def _on_pull(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=True)
        if len(frames) > MAX_FRAMES_PER_MESSAGE:
            metrics.REJECTED.labels("lmcache", "too_many_frames").inc(len(frames) - MAX_FRAMES_PER_MESSAGE)
            log.warning("multipart of %d frames: only the first %d applied", len(frames), MAX_FRAMES_PER_MESSAGE)
        self.lmcache.handle_push(frames[:MAX_FRAMES_PER_MESSAGE])

    def _on_router(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=True)
        if len(frames) < 2:
            log.warning("ROUTER message with %d frame(s) ignored", len(frames))
            return
        identity, payload = frames[0], frames[-1]
        envelope = [identity, b""] if len(frames) >= 3 and frames[1] == b"" else [identity]
        reply = proto.encode(proto.ErrorMsg(error="controller error"))
        try:
            reply = self.lmcache.handle_request(payload)
        finally:  # a REQ worker waits for a reply: it always gets one
            sock.send_multipart([*envelope, reply])

    # -- periodic tasks ----------------------------------------------------------------------

    def _touch_instances(self) -> None:
        self.store.touch_instances(self.lmcache.instances)

    def _reap(self) -> None:
        for instance_id, worker_id in reap(self.store):
            metrics.REAPED.inc()
            self.lmcache.forget(instance_id, worker_id)

    def _purge(self) -> None:
        removed = self.store.purge(PURGE_BUDGET)
        if removed:
            log.info("purged %d retired records", removed)

    # -- loop --------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`. Redis outages pause the loop; nothing queued is lost."""
        next_tick = 0.0
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self.lmcache.flush()
                now = time.monotonic()
                if now >= next_tick:
                    for task in self.tasks:
                        task()
                    next_tick = now + self.heartbeat_s
                for sock, _ev in self.poller.poll(timeout=int(min(self.heartbeat_s, 0.2) * 1000)):
                    self.handlers[sock](sock)
                backoff = 0.1
            except redis.RedisError as exc:  # unreachable, BUSY, OOM, READONLY...: back off
                log.warning("redis error (%s); retrying in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # the loop never dies; the failure is counted and logged
                metrics.REJECTED.labels("sidecar", "loop_error").inc()
                log.exception("sidecar loop error")
                self._stop.wait(0.1)
        self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Close every socket and the context."""
        for closer in self.closers:
            closer()
        for sock in list(self.handlers):
            self.remove_socket(sock)
        self.gate.stop()
        self.ctx.term()


def _host_port(url: str) -> str:
    return endpoint(url).split("://", 1)[1]
