"""Simulated LMCache engines for the end-to-end fault tests, with their true state.

:class:`Engine` is one LMCache engine with one worker (a :class:`SimEngine`: the real wire
protocol, a control port answering the sidecar's health calls) and what it holds; its thread
heartbeats (era 0.5) and runs the full syncs it is asked for, and, given :class:`RandomOps`,
sends its own random admits and evicts. :class:`Traffic` drives random ops on many engines
from one thread instead. :func:`matched` is the truth a lookup must answer.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Sequence

import zmq

from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.wire.zmqaddr import endpoint

CPU = "LocalCPUBackend"


def matched(chain: Sequence[int], held: set[int]) -> int:
    """How many chunks of ``chain``, from the first, are in ``held``."""
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


class RandomOps:
    """Random admits and evicts: with probability ``admit_p`` (or when nothing can be evicted)
    a prefix of one of ``chains``, else 1..``max_evict`` held chunks of ``chains``. Chunks
    outside ``chains`` are never evicted, so what a test admitted itself stays as it left it."""

    def __init__(self, chains: list[list[int]], seed: int, *, admit_p: float, max_evict: int):
        self.chains = chains
        self.pool = {h for c in chains for h in c}
        self.rng = random.Random(seed)
        self.admit_p, self.max_evict = admit_p, max_evict

    def step(self, engine: Engine) -> int:
        """Send one random admit or evict on ``engine``; returns the chunks it carried."""
        chain = self.rng.choice(self.chains)
        evictable = sorted(engine.held & self.pool)
        if self.rng.random() < self.admit_p or not evictable:
            chunks = chain[:self.rng.randint(1, len(chain))]
            engine.store(chunks)
        else:
            chunks = self.rng.sample(evictable, min(len(evictable), self.rng.randint(1, self.max_evict)))
            engine.evict(chunks)
        return len(chunks)


class Engine(threading.Thread):
    """One simulated LMCache engine (one worker, LocalCPUBackend) and its true state, :attr:`held`.

    Sends are serialized by ``lock`` (a held change goes with the message that reports it). The
    thread (:meth:`start`) runs, every ``pace_s``: the ops queued by :meth:`do`, in order; one
    step of ``ops`` (None: no random traffic of its own); and, for era "0.5", a heartbeat every
    ``heartbeat_s`` whose full-sync command is obeyed (every chunk held, a start that is not
    accepted retried, as LMCache's FullSyncSender does). A request not answered within
    ``dealer_timeout_ms`` is recorded as a ``"timeout"`` beat and, with ``redial``, gets a fresh
    DEALER so a late reply is never read as the answer to a later request; without ``redial``
    the timeout is an error. Errors are kept in ``errors`` (the tests assert there are none).
    """

    def __init__(self, name: str, era: str, pull_url: str, reply_url: str | None, *,
                 profile: HashProfile, ctx: zmq.Context | None = None, ops: RandomOps | None = None,
                 heartbeat_s: float = 0.5, pace_s: float = 0.5, dealer_timeout_ms: int = 3000,
                 redial: bool = True):
        super().__init__(daemon=True, name=f"engine-{name}")
        self.name, self.era, self.reply_url = name, era, reply_url
        self.sim = SimEngine(name, era=era, pull_url=pull_url, reply_url=reply_url if era == "0.5" else None,
                             ctx=ctx, profile=profile)
        self.worker = self.sim.workers[0]
        self.dealer_timeout_ms, self.redial = dealer_timeout_ms, redial
        if self.worker.dealer is not None:
            self.worker.dealer.setsockopt(zmq.RCVTIMEO, dealer_timeout_ms)
        self.ops_source, self.heartbeat_s, self.pace_s = ops, heartbeat_s, pace_s
        self.lock = threading.Lock()
        self.todo: queue.Queue = queue.Queue()
        self.beats: list[tuple[float, float, str]] = []  # (sent at, seconds to the reply, outcome)
        self.syncs: list[tuple[float, str]] = []  # (accepted at, reason)
        self.ops = 0  # chunks admitted and evicted
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    @property
    def held(self) -> set[int]:
        return self.sim.held.get(CPU, set())

    # -- what it sends ---------------------------------------------------------------------

    def register(self) -> None:
        """Register (again: the engine restarted, a new epoch with a cold cache)."""
        with self.lock:
            self.worker.register()
            self.sim.held.clear()

    def store(self, hashes: Sequence[int]) -> None:
        with self.lock:
            self.sim.store(list(hashes))
            self.ops += len(hashes)

    def evict(self, hashes: Sequence[int]) -> None:
        with self.lock:
            self.sim.evict(list(hashes))
            self.ops += len(hashes)

    def start_engine(self, admit: Sequence[int] = ()) -> Engine:
        """Register, admit ``admit``, then start the thread."""
        self.register()
        if admit:
            self.store(admit)
        self.start()
        return self

    def do(self, op: str, chunks: Sequence[int] = (), timeout: float = 10.0) -> None:
        """``"admit"`` or ``"evict"`` ``chunks``, or ``"register"`` again (a cold restart), from
        the engine's own thread, in order with its traffic; returns once sent."""
        done = threading.Event()
        self.todo.put((op, list(chunks), done))
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name} did not send its {op}")

    # -- its thread ------------------------------------------------------------------------

    def run(self) -> None:
        next_hb = 0.0
        while not self.stop_event.is_set():
            try:
                while not self.todo.empty():
                    op, chunks, done = self.todo.get()
                    {"register": lambda _c: self.register(), "admit": self.store, "evict": self.evict}[op](chunks)
                    done.set()
                if self.ops_source is not None:
                    self.ops_source.step(self)
                if self.era == "0.5" and time.monotonic() >= next_hb:
                    try:
                        self.beat()
                    finally:
                        next_hb = time.monotonic() + self.heartbeat_s
            except Exception as exc:  # recorded; the tests assert there are none
                self.errors.append(f"{type(exc).__name__}: {exc}")
            due = next_hb - time.monotonic() if self.era == "0.5" else self.pace_s
            self.stop_event.wait(min(self.pace_s, max(0.0, due)))

    def _fresh_dealer(self) -> None:
        self.worker.dealer.close(0)
        dealer = self.sim.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, self.dealer_timeout_ms)
        dealer.connect(endpoint(self.reply_url))
        self.worker.dealer = dealer

    def beat(self) -> None:
        """One heartbeat; a full-sync command in the reply is run at once."""
        t0 = time.monotonic()
        try:
            reply = self.worker.heartbeat() or {}
        except zmq.Again:
            self.beats.append((t0, time.monotonic() - t0, "timeout"))
            if not self.redial:
                raise
            self._fresh_dealer()
            return
        took = time.monotonic() - t0
        syncs = [c.get("reason") for c in reply.get("commands") or [] if c.get("command_type") == "full_sync"]
        self.beats.append((t0, took, "error" if "error" in reply else "sync" if syncs else "ok"))
        if syncs:
            self.full_sync(syncs[0])

    def full_sync(self, reason: str, attempts: int = 30) -> None:
        """Send every chunk held (LocalCPUBackend), atomically with the engine's other sends."""
        start: dict = {}
        for _ in range(attempts):
            with self.lock:
                try:
                    start, _status = self.worker.full_sync(sorted(self.held))
                except zmq.Again:
                    if not self.redial:
                        raise
                    self._fresh_dealer()
                    start = {}
            if start.get("accepted"):
                self.syncs.append((time.monotonic(), reason))
                return
            if self.stop_event.wait(0.5):
                return
        self.errors.append(f"full sync of {self.name} never accepted ({reason}): {start}")

    # -- what it saw -----------------------------------------------------------------------

    def synced_since(self, t: float) -> bool:
        return any(at > t for at, _reason in self.syncs)

    def max_beat_s(self, since: float, until: float | None = None) -> float:
        return max((took for at, took, _o in self.beats if at >= since and (until is None or at <= until)),
                   default=0.0)

    def holder(self, r) -> str | None:
        """Its worker 0's LocalCPUBackend holder id, as the registry names it now."""
        return r.hget(keys.worker_key(self.name, 0), keys.location_field(CPU))

    def stop(self) -> None:
        """Stop the thread (once it has sent what it was sending)."""
        self.stop_event.set()
        if self.ident is not None:
            self.join(30)

    def close(self) -> None:
        """Stop, deregister and close its sockets."""
        self.stop()
        with self.lock:
            self.sim.close()


class Traffic(threading.Thread):
    """Steady :class:`RandomOps` on a random one of ``engines`` every ``pace_s``, until
    stopped; :meth:`pause` waits for the step in progress. ``ops``: the chunks it sent."""

    def __init__(self, engines: list[Engine], ops: RandomOps, pace_s: float = 0.004):
        super().__init__(daemon=True, name="traffic")
        self.engines, self.random_ops = engines, ops
        self.pace_s = pace_s
        self.ops = 0
        self.gate = threading.Lock()
        self.paused = threading.Event()
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.wait(self.pace_s):
            if self.paused.is_set():
                continue
            with self.gate:
                if self.paused.is_set():
                    continue
                try:
                    self.ops += self.random_ops.step(self.random_ops.rng.choice(self.engines))
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def pause(self) -> None:
        self.paused.set()
        with self.gate:
            pass

    def resume(self) -> None:
        self.paused.clear()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)
