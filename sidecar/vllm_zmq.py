"""ZMQ plumbing for vLLM event streams: the replay DEALER and the SUB sockets of every DP rank.

vLLM's publisher (``ZmqEventPublisher``) has a PUB socket at ``endpoint`` and an optional
ROUTER at ``replay_endpoint``; data-parallel rank r uses both ports + r. A real vLLM given
``tcp://*:5557`` binds, so the sidecar connects its SUB (the default); given a concrete
address vLLM connects, so the sidecar binds (``bind=True``). The replay ROUTER is always
bound by vLLM, so the DEALER always connects.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from kvlookup import metrics
from kvlookup.vllm_events import REPLAY_END, DecodeError, parse_replay
from kvlookup.zmqaddr import endpoint, with_port_offset
from sidecar.vllm_ingest import VllmIngest

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
            except DecodeError as exc:
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


def attach(sidecar, source: VllmSource) -> VllmIngest:
    """Add SUB sockets for every rank of ``source`` to a running-to-be Sidecar; returns the ingest."""
    replay = ReplayClient(sidecar.ctx, source.replay_endpoint, source.replay_timeout_s) \
        if source.replay_endpoint else None
    ingest = VllmIngest(sidecar.store, source.instance_id, replay)
    for rank in range(source.dp_size):
        url = with_port_offset(source.endpoint, rank)

        def handler(sock: zmq.Socket, rank: int = rank) -> None:
            ingest.handle_live(rank, sock.recv_multipart(copy=True))

        sock = sidecar.add_socket(zmq.SUB, url if source.bind else None, handler,
                                  connect=None if source.bind else url)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
    if replay is not None:
        sidecar.closers.append(replay.close)
    log.info("vLLM instance %s: %s %s (ranks %d), replay %s", source.instance_id,
             "bind" if source.bind else "connect", source.endpoint, source.dp_size, source.replay_endpoint)
    return ingest
