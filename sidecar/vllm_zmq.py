"""ZMQ plumbing for vLLM event streams: the replay DEALER and the SUB sockets of every DP rank.

vLLM's publisher (``ZmqEventPublisher``) has a PUB socket at ``endpoint`` and an optional
ROUTER at ``replay_endpoint``; data-parallel rank r uses both ports + r. A real vLLM given
``tcp://*:5557`` binds, so the sidecar connects its SUB (the default); given a concrete
address vLLM connects, so the sidecar binds (``bind=True``). The replay ROUTER is always
bound by vLLM, so the DEALER always connects.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from kvlookup import metrics
from kvlookup.index.store import Store
from kvlookup.sidecar.sockets import Limits, SocketSet
from kvlookup.sidecar.turns import run_turns
from kvlookup.sidecar.vllm_ingest import VllmIngest
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import REPLAY_END, parse_replay
from kvlookup.wire.zmqaddr import endpoint, with_port_offset

log = logging.getLogger(__name__)


#: A replay longer than this many batches is not vLLM's (it buffers ``buffer_steps`` = 10,000).
MAX_REPLAY_BATCHES = 10_000
#: A whole replay may take this many per-reply timeouts.
TOTAL_TIMEOUTS = 5


class ReplayClient:
    """Asks vLLM's replay ROUTER for buffered batches, synchronously.

    ctx: the zmq context. url: ``tcp://host:port`` of rank 0 (rank r adds r). timeout_s: the
    longest wait for each reply; vLLM answers between queue polls (<= ~0.1 s).
    """

    def __init__(self, ctx: zmq.Context, url: str, timeout_s: float = 2.0):
        self.ctx = ctx
        self.url = endpoint(url)
        self.timeout_ms = int(timeout_s * 1000)
        self.socks: dict[int, zmq.Socket] = {}

    def __call__(self, rank: int, start: int) -> list[tuple[int, bytes]] | None:
        """Batches with seq >= start as a contiguous run (seq, payload).

        None when the replay fails: a reply takes longer than ``timeout_s``, the whole replay
        longer than ``TOTAL_TIMEOUTS`` times that, or it sends more than
        ``MAX_REPLAY_BATCHES`` batches (vLLM keeps ``buffer_steps`` = 10,000) without its end
        marker. The caller then resyncs the rank; the loop is never held longer than that.
        """
        sock = self._socket(rank)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        run: list[tuple[int, bytes]] = []
        broken = False
        deadline = time.monotonic() + self.timeout_ms * TOTAL_TIMEOUTS / 1000
        for _ in range(MAX_REPLAY_BATCHES + 1):
            left_ms = min(self.timeout_ms, int((deadline - time.monotonic()) * 1000))
            if left_ms <= 0 or not sock.poll(left_ms):
                break
            try:
                seq, payload = parse_replay(sock.recv_multipart())
            except WireError as exc:
                metrics.REJECTED.labels("vllm", exc.reason).inc()
                continue
            if seq == REPLAY_END:
                return run
            if run and seq != run[-1][0] + 1:
                broken = True
            if not broken:
                run.append((seq, payload))
        log.warning("replay from %s (rank %d, seq %d) gave up after %d batch(es)", self.url, rank, start, len(run))
        self._drop(rank)  # late replies must not reach the next request
        return None

    def _socket(self, rank: int) -> zmq.Socket:
        sock = self.socks.get(rank)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(with_port_offset(self.url, rank))
            self.socks[rank] = sock
        return sock

    def _drop(self, rank: int) -> None:
        sock = self.socks.pop(rank, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for rank in list(self.socks):
            self._drop(rank)


@dataclass
class VllmSource:
    """One vLLM instance's event endpoints, as given on the command line or in settings."""

    instance_id: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_size: int = 1
    bind: bool = False
    topic: str = ""
    replay_timeout_s: float = 2.0


class VllmLoop:
    """The vLLM event streams of one sidecar, in a thread of their own: a replay waits for
    vLLM's answer (seconds when it is slow), and the LMCache loop, its heartbeat replies and the
    liveness leases never wait behind it.

    store: the index (this loop keeps its own holder cache). sources: the vLLM instances.
    sidecar_id: the owner of their instances. sockets: where to create the SUB sockets (the
    sidecar's context, limits and peer guard). grace_s: a rank whose SUB connection dropped and
    did not come back within this long is recorded as gone (``Store.suspect``; its engine
    stopped), unless it is not registered.
    """

    def __init__(self, store: Store, sources: tuple[VllmSource, ...], *, sidecar_id: str = "",
                 sockets: SocketSet | None = None, grace_s: float = 5.0):
        self.store = Store(store.r, instance_ttl_s=store.instance_ttl_ms / 1000,
                           worker_ttl_s=store.worker_ttl_ms / 1000, purge_grace_s=store.purge_grace_ms / 1000,
                           records=store.records)
        self.sockets = sockets or SocketSet(zmq.Context.instance(), Limits())
        self.grace_s = grace_s
        self.ingests: dict[str, VllmIngest] = {}
        self.replays: list[ReplayClient] = []
        self.down: dict[tuple[str, int], float] = {}  # (instance, rank) -> when to record it gone
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvlookup-vllm", daemon=True)
        for source in sources:
            self.ingests[source.instance_id] = self._attach(source, sidecar_id)

    def _attach(self, source: VllmSource, sidecar_id: str) -> VllmIngest:
        replay = ReplayClient(self.sockets.ctx, source.replay_endpoint, source.replay_timeout_s) \
            if source.replay_endpoint else None
        if replay is not None:
            self.replays.append(replay)
        ingest = VllmIngest(self.store, source.instance_id, replay, owner=sidecar_id)
        for rank in range(source.dp_size):
            url = with_port_offset(source.endpoint, rank)
            key = (source.instance_id, rank)

            def handler(sock: zmq.Socket, rank: int = rank, key=key) -> None:
                self.down.pop(key, None)
                ingest.handle_live(rank, sock.recv_multipart(copy=True))

            def on_event(event: int, _fd: int, _endpoint: str, key=key) -> None:
                if event == zmq.EVENT_DISCONNECTED:
                    self.down.setdefault(key, time.monotonic() + self.grace_s)
                elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                    self.down.pop(key, None)

            self.sockets.add(zmq.SUB, handler, bind=url if source.bind else None,
                             connect=None if source.bind else url, on_event=on_event,
                             setup=lambda sock: sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode()))
        log.info("vLLM instance %s: %s %s (ranks %d), replay %s", source.instance_id,
                 "bind" if source.bind else "connect", source.endpoint, source.dp_size, source.replay_endpoint)
        return ingest

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        """Serve until :meth:`stop`. Redis outages pause the loop; a lost message is a seq gap."""
        run_turns(self._turn, self._stop, "vllm")
        for replay in self.replays:
            replay.close()
        self.sockets.close()

    def _turn(self) -> None:
        for sock in self.sockets.poll(200):
            self.sockets.handlers[sock](sock)
        self._record_gone()

    def _record_gone(self) -> None:
        now = time.monotonic()
        for key in [k for k, at in self.down.items() if at <= now]:
            del self.down[key]
            if self.store.is_registered(*key):
                log.warning("vLLM %s rank %d: its event stream stayed disconnected %.0fs; recording it gone",
                            key[0], key[1], self.grace_s)
                self.store.suspect(*key, self.store.clock.now_ms())

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)
