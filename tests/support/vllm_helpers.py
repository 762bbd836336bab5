"""Test side of vLLM event streams: payload builders, a loopback PUB+ROUTER publisher that
speaks vLLM's wire protocol, and vLLM's REAL publisher (tests/compat/vllm_publisher.py).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvlookup.hashing.namespace import Namespace
from kvlookup.proc.redis_server import free_port

if TYPE_CHECKING:
    from kvlookup.sidecar.vllm_ingest import VllmIngest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"  # written by tests/compat/vllm_publisher.py golden
PUBLISHER = ROOT / "tests" / "compat" / "vllm_publisher.py"
END = (-1).to_bytes(8, "big", signed=True)

STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                "lora_name", "extra_keys", "group_idx")


def stored(hashes, tokens=(), bs=16, parent=None, medium="GPU", **extra) -> dict:
    """A BlockStored event as a map (vLLM 0.25+ field names)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": bs, "lora_id": None, "medium": medium,
            "lora_name": None, **extra}


def removed(hashes, medium="GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def as_array(event: dict) -> list:
    """The positional (vLLM <= 0.25) form of a map event, trailing Nones left off."""
    order = {"BlockStored": STORED_ORDER, "BlockRemoved": ("block_hashes", "medium", "group_idx")}.get(
        event["type"], ())
    values = [event.get(k) for k in order]
    while values and values[-1] is None and order[len(values) - 1] not in ("parent_block_hash", "medium"):
        values.pop()
    return [event["type"], *values]


def payload(*events: dict, ts: float = 1700000000.5, rank: int = 0, form: str = "map") -> bytes:
    """msgpack batch ``[ts, events, rank]``; form "array" encodes events positionally."""
    evs = [as_array(e) for e in events] if form == "array" else list(events)
    return msgspec.msgpack.encode([ts, evs, rank])


class Stream:
    """One rank's publisher: seqs, a replay buffer, delivery straight into an ingest."""

    def __init__(self, rank: int = 0, buffer: int = 10_000):
        self.rank, self.seq, self.buffer, self.size = rank, 0, [], buffer
        self.replays: list[int] = []

    def send(self, ingest: VllmIngest | None, *events, deliver: bool = True, form: str = "map") -> int:
        seq, data = self.seq, payload(*events, rank=self.rank, form=form)
        self.seq += 1
        self.buffer = (self.buffer + [(seq, data)])[-self.size:]
        if deliver and ingest is not None:
            ingest.handle_live(self.rank, [b"kv@pod-a", seq.to_bytes(8, "big"), data])
        return seq

    def replay(self, rank: int, start: int):
        assert rank == self.rank
        self.replays.append(start)
        return [(s, p) for s, p in self.buffer if s >= start]

    def restart(self) -> None:
        self.seq, self.buffer = 0, []


def layout(client, tokens, *fields: str, model_name: str | None = None, **namespace) -> dict:
    """Instance -> (location, matched prefix length, then each of ``fields`` of the match:
    ``locations``, ``ranks`` ...) of ``client.matches(tokens)``; ``namespace``: its lora_name,
    cache_salt."""
    found = client.matches(tokens, namespace=Namespace(**namespace), model_name=model_name)
    return {m.instance_id: (m.location, m.matched_prefix_length, *(getattr(m, f) for f in fields)) for m in found}


def detail(client, tokens) -> dict:
    """Instance -> ``Match.detail()`` of a lookup of ``tokens`` with the reusable lengths added."""
    matches = client.matches(tokens)
    matches = client.add_reusable(tokens, matches)
    return {m.instance_id: m.detail() for m in matches}


class LoopbackPublisher:
    """vLLM's publisher protocol on loopback: PUB (bound) + replay ROUTER (bound, a thread).

    replay_topic: True answers in the 0.26+ form ``[b"", topic, seq, payload]``. Every
    published seq is buffered (``buffer`` most recent); :meth:`publish` with ``send=False``
    buffers without sending (a gap for live subscribers).
    """

    def __init__(self, topic: bytes = b"kv@test", replay: bool = True, replay_topic: bool = True,
                 buffer: int = 10_000, port: int | None = None, replay_port: int | None = None):
        self.ctx = zmq.Context()
        self.port = port or free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.topic, self.replay_topic, self.buffer_size = topic, replay_topic, buffer
        self.seq, self.buffer = 0, []
        self.lock = threading.Lock()
        self.replay_port = (replay_port or free_port()) if replay else None
        self._stop = threading.Event()
        self.router = self.ctx.socket(zmq.ROUTER) if replay else None
        try:  # both binds here, so a taken port raises ZMQError from the constructor
            self.pub.bind(f"tcp://127.0.0.1:{self.port}")
            if self.router is not None:
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        except zmq.ZMQError:
            self.ctx.destroy(0)
            raise
        if self.router is not None:  # the thread owns the router from here on
            self.thread = threading.Thread(target=self._serve, args=(self.router,), daemon=True)
            self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def publish(self, data: bytes, send: bool = True) -> int:
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer = (self.buffer + [(seq, data)])[-self.buffer_size:]
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        """Engine restart: seq back to 0, empty buffer."""
        with self.lock:
            self.seq, self.buffer = 0, []

    def _serve(self, router: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            ident, _empty, start = router.recv_multipart()
            start = int.from_bytes(start, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            head = [ident, b""] + ([self.topic] if self.replay_topic else [])
            for s, p in items:
                router.send_multipart([*head, s.to_bytes(8, "big"), p])
            router.send_multipart([ident, b""] + ([b""] if self.replay_topic else []) + [END, b""])
        router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self.replay_port:
            self.thread.join(5)
        self.pub.close(0)
        self.ctx.term()


def dp_publishers(ranks: int = 2, **kw) -> list[LoopbackPublisher]:
    """Publishers of DP ranks 0..ranks-1 on ports P+r (replay R+r), as vLLM binds them.

    free_port only vouches for P and R, so the whole set is picked again when a P+r or R+r is
    taken; ``kw`` goes to every :class:`LoopbackPublisher` (``replay=False``: no replay ports).
    Raises RuntimeError after 20 tries.
    """
    for _ in range(20):
        base = free_port()
        rbase = free_port() if kw.get("replay", True) else None
        pubs: list[LoopbackPublisher] = []
        try:
            for r in range(ranks):
                pubs.append(LoopbackPublisher(port=base + r, replay_port=rbase and rbase + r, **kw))
            return pubs
        except zmq.ZMQError:
            for pub in pubs:
                pub.close()
    raise RuntimeError(f"no {ranks} consecutive free ports for the DP ranks")


# -- the real vLLM publisher ----------------------------------------------------------------

def real_vllm() -> tuple[str, str] | None:
    """(python, sources root) from KVLOOKUP_VLLM_PYTHON / KVLOOKUP_VLLM_SRC, or None."""
    py, src = os.environ.get("KVLOOKUP_VLLM_PYTHON"), os.environ.get("KVLOOKUP_VLLM_SRC")
    if not py or not src or not Path(py).exists():
        return None
    return py, src


def _endpoint(port: int | str) -> str:
    return port if isinstance(port, str) else f"tcp://127.0.0.1:{port}"


class RealPublisher:
    """vLLM's own ZmqEventPublisher in a child process, one batch per :meth:`send` row.

    Rows use the publisher's JSON-lines format ({"stored": {...}}, {"removed": ...}, {"cleared": {}},
    {"batch": [...]}); :meth:`send` returns the published batch as the publisher reports it
    (hashes as ints, or "hex:..." strings for bytes hashes), as tests/compat/vllm_publisher.py says.
    """

    def __init__(self, version: str, port: int | str, replay_port: int | str | None, *, topic: str = "kv@pod-a",
                 int_hashes: bool = True, dp_rank: int = 0, buffer_steps: int = 10_000):
        """port / replay_port: a loopback port, or a whole endpoint (``"tcp://*:0"``: vLLM binds
        VLLM_HOST_IP, here 127.0.0.1, on a port of the OS's choosing). ``config``: the resolved
        KVEventsConfig vLLM reports (0.33+; what ``/kv_event_sources`` serves), else None."""
        py, src = real_vllm()
        argv = [py, str(PUBLISHER), "serve", "--vllm-src", f"{src}/x/vllm-{version}",
                "--endpoint", _endpoint(port), "--topic", topic, "--dp-rank", str(dp_rank),
                "--int-hashes", "1" if int_hashes else "0", "--buffer-steps", str(buffer_steps)]
        if replay_port:
            argv += ["--replay-endpoint", _endpoint(replay_port)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
        self.out: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        ready = self._next(20)
        assert ready.get("ready"), f"{ready} {''.join(self.err)}"
        self.config: dict | None = ready.get("config")

    def _read_out(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.out.put(json.loads(line))
        self.out.put({"eof": True})

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    def _next(self, timeout: float = 10) -> dict:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("publisher driver did not answer: " + "".join(self.err[-20:])) from None

    def send(self, row: dict) -> dict:
        self.proc.stdin.write(json.dumps(row) + "\n")
        self.proc.stdin.flush()
        reply = self._next()
        assert "published" in reply, f"{reply} {''.join(self.err[-20:])}"
        return reply

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)


class Relay:
    """Forwards a PUB stream verbatim to a new loopback PUB, dropping chosen seqs (a lossy
    network between vLLM and the sidecar)."""

    def __init__(self, upstream: str, drop: set[int]):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.port = free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.drop = drop
        self.forwarded: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                frames = self.sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                if seq not in self.drop:
                    self.pub.send_multipart(frames)
                    self.forwarded.append(seq)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()
