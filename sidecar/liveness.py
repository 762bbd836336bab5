"""Evidence that a worker is gone, gathered where its traffic arrives (docs/operations.md).

A worker is dead only on evidence, never because this process has not heard from it since it
started. This module keeps, for the LMCache workers this sidecar serves, which connections
carried their messages (the ZMQ socket monitor's accepted/disconnected events, and each
frame's source descriptor), and:

- when the last connection of a worker closes, waits ``grace_s`` for it to speak again, then
  asks its control port for its health (LMCache ``HealthWorkerMsg``);
- after this sidecar (re)starts, asks every worker of its instances that has not spoken yet;
- when a connection that carried no identified message closes (a quiet worker may have died),
  asks every worker that has no live connection.

Any reply is proof of life, and is remembered in the registry (``probed_at`` in the worker
hash: its control port is known to work; a newly registered worker is asked once for this).
No reply within ``timeout_s x (retries + 1)`` is evidence when the worker's connections closed,
or when its control port answered before: the worker is recorded as gone (``Store.suspect``)
and the reapers deregister it. A control port that never answered proves nothing on its own (a
firewall, a wrong ``lmcache_worker_ports``). A worker with no usable control address, or one
outside ``worker_networks``, cannot be asked: its closed connection alone is the evidence,
after the grace period.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from kvlookup import metrics
from kvlookup.index.fleet import Fleet, WorkerInfo
from kvlookup.index.store import Store
from kvlookup.wire import lmcache_control as ctl

log = logging.getLogger(__name__)

#: A connection: (socket name, file descriptor of the TCP connection).
Conn = tuple[str, int]
#: A worker: (instance_id, worker_id as text).
Worker = tuple[str, str]


#: Health calls a sidecar makes at once (issue 20: one at a time, 30 silent ports kept a dead
#: worker counted for 121 s instead of 8 s).
PROBE_CONCURRENCY = 16
#: Owned instances whose workers one tick's sweep for quiet workers reads (issue 20 item 9: a
#: sweep over 50,000 at once stalled a sidecar's loop for seconds on a Redis Cluster).
SWEEP_SLICE = 1000


class Prober:
    """Health calls in threads of their own, at most ``concurrency`` at once (a dead worker
    costs seconds; the ingest loop never waits for it). :meth:`ask` queues a worker;
    :meth:`answers` yields verdicts."""

    def __init__(self, timeout_s: float, retries: int, concurrency: int = PROBE_CONCURRENCY):
        self.client = ctl.ControlClient(timeout_s, retries)  # its context is shared; sockets are per call
        self.requests: queue.Queue[WorkerInfo | None] = queue.Queue()
        self.results: queue.Queue[tuple[WorkerInfo, bool, str]] = queue.Queue()
        self.threads = [threading.Thread(target=self._run, name=f"kvlookup-prober-{i}", daemon=True)
                        for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def ask(self, w: WorkerInfo) -> None:
        self.requests.put(w)

    def answers(self) -> list[tuple[WorkerInfo, bool, str]]:
        """(worker, alive, why) of every probe finished since the last call."""
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while (w := self.requests.get()) is not None:
            msg = ctl.HealthWorkerMsg(worker_event_id=f"HealthWorker{w.worker_id}probe")
            try:
                res = self.client.call([ctl.Target(w.worker_id, w.ip, w.port, msg)])[0]
            except zmq.ContextTerminated:
                return  # closing
            alive = res.outcome not in (ctl.TIMEOUT, ctl.UNREACHABLE, ctl.REFUSED)  # any answer is life
            self.results.put((w, alive, res.error or res.outcome))

    def close(self) -> None:
        """Stop after the calls in progress (a dead worker's call ends within its timeout)."""
        for _ in self.threads:
            self.requests.put(None)
        deadline = time.monotonic() + self.client.timeout_ms * (self.client.retries + 1) / 1000 + 1
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self.threads):
            self.client.close()


class Liveness:
    """Connection evidence and health probes for the LMCache workers of one sidecar.

    store: the index (its ``suspect``/``clear_suspect``). sidecar_id: whose instances to
    watch. grace_s: how long a worker whose connections closed may stay silent before it is
    asked. timeout_s, retries: of each health call. address_allowed: whether a worker address
    may be called (``worker_networks``).
    """

    def __init__(self, store: Store, sidecar_id: str, *, grace_s: float = 5.0, timeout_s: float = 2.0,
                 retries: int = 1, address_allowed: Callable[[str], bool] = lambda _ip: True,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.fleet = Fleet(store)
        self.sidecar_id = sidecar_id
        self.grace_s = grace_s
        self.address_allowed = address_allowed
        self.clock = clock
        self.prober = Prober(timeout_s, retries)
        self.conns: dict[Conn, set[Worker]] = {}
        self.worker_conns: dict[Worker, set[Conn]] = {}
        self.timers: dict[Worker, float] = {}  # worker -> when to ask it (monotonic)
        self.asking: dict[Worker, bool] = {}  # being asked -> whether its connections closed
        self.suspected: set[Worker] = set()  # recorded gone by this process (cleared if it speaks)
        self.sweep_at: float | None = clock() + grace_s  # ask quiet workers once after start
        self.sweep_left: list[str] = []  # owned instances the sweep still has to look at

    # -- what the sockets tell ---------------------------------------------------------------

    def seen(self, conn: Conn | None, instance_id: str, worker_id: int | str) -> None:
        """A message of this worker arrived (on ``conn``, when known)."""
        w = (instance_id, str(worker_id))
        if conn is not None:
            self.conns.setdefault(conn, set()).add(w)
            self.worker_conns.setdefault(w, set()).add(conn)
        self.timers.pop(w, None)
        if w in self.suspected:
            self.suspected.discard(w)
            self.store.clear_suspect(*w)

    def registered(self, instance_id: str, worker_id: int | str) -> None:
        """A worker (re)registered: ask it once, so its control port is known to work."""
        self._ask({(instance_id, str(worker_id))}, set())

    def accepted(self, conn: Conn) -> None:
        """A peer connected (a reused descriptor starts with nobody on it)."""
        self._drop(conn)
        self.conns[conn] = set()

    def disconnected(self, conn: Conn) -> None:
        """A peer's connection closed."""
        workers = self._drop(conn)
        if not workers and self.sweep_at is None:
            self.sweep_at = self.clock() + self.grace_s  # somebody quiet left: ask the quiet ones
        for w in workers:
            if not self.worker_conns.get(w):
                self.timers.setdefault(w, self.clock() + self.grace_s)

    def forget(self, instance_id: str, worker_id: int | str) -> None:
        """The worker left the registry (deregistered or reaped)."""
        w = (instance_id, str(worker_id))
        for conn in self.worker_conns.pop(w, set()):
            self.conns.get(conn, set()).discard(w)
        self.timers.pop(w, None)
        self.suspected.discard(w)

    def _drop(self, conn: Conn) -> set[Worker]:
        workers = self.conns.pop(conn, set())
        for w in workers:
            self.worker_conns.get(w, set()).discard(conn)
        return workers

    # -- periodic ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Ask the workers whose time came; record the verdicts that arrived."""
        now = self.clock()
        closed = {w for w, at in self.timers.items() if at <= now}  # their connections closed
        for w in closed:
            del self.timers[w]
        quiet: set[Worker] = set()
        if self.sweep_at is not None and self.sweep_at <= now:
            self.sweep_at = None
            self.sweep_left = sorted(self.store.owned(self.sidecar_id))
        if self.sweep_left:  # SWEEP_SLICE instances a tick: 50k owned ones stalled the loop on a cluster
            part, self.sweep_left = self.sweep_left[:SWEEP_SLICE], self.sweep_left[SWEEP_SLICE:]
            quiet = {(w.instance_id, str(w.worker_id)) for w in self.fleet.workers(part)
                     if not self.worker_conns.get((w.instance_id, str(w.worker_id)))}
        if closed or quiet:
            self._ask(closed | quiet, closed)
        for info, alive, why in self.prober.answers():
            self._verdict(info, alive, why)

    def _ask(self, workers: set[Worker], closed: set[Worker]) -> None:
        infos = {(w.instance_id, str(w.worker_id)): w for w in self.fleet.workers(sorted({i for i, _ in workers}))}
        for w in sorted(workers):
            if w in self.asking:
                self.asking[w] = self.asking[w] or w in closed
                continue
            info = infos.get(w)
            if info is None or not self.fleet.instance_kind(w[0]).probed:
                continue  # gone from the registry meanwhile, or its evidence is elsewhere (a vLLM stream)
            if info.port > 0 and self.address_allowed(info.ip or "127.0.0.1"):
                self.asking[w] = w in closed
                self.prober.ask(info)
            elif w in closed:  # nothing to ask: the closed connection is the evidence
                self._gone(w, "its connection closed and it has no control address to ask")

    def _verdict(self, info: WorkerInfo, alive: bool, why: str) -> None:
        w = (info.instance_id, str(info.worker_id))
        closed = self.asking.pop(w, False)
        metrics.PROBES.labels("alive" if alive else "no_answer").inc()
        if alive:
            self.store.mark_probed(*w)
        elif self.worker_conns.get(w):
            pass  # it spoke again meanwhile
        elif closed or info.probed_at:
            self._gone(w, f"no answer from its control port {info.ip}:{info.port}: {why}")
        else:
            log.info("worker %s/%s: its control port %s:%s never answered (%s); not evidence on its own",
                     *w, info.ip, info.port, why)

    def _gone(self, w: Worker, why: str) -> None:
        log.warning("worker %s/%s is gone (%s): recording it for the reaper", *w, why)
        self.suspected.add(w)
        self.store.suspect(*w, self.store.clock.now_ms())

    def close(self) -> None:
        self.prober.close()
