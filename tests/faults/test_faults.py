"""Fault injection on the LMCache drop-in deployment, under steady ingest and lookups.

One deployment for the whole module, as shipped by default: ``kvlookup controller
--monitor-ports`` (embedded Redis in its own data dir, embedded sidecar, 2 gunicorn workers,
``--instance-ttl 5``) and one standalone ``kvlookup sidecar`` sharing that embedded Redis. Engines
(simulated LMCache workers speaking the real protocol): 0.5-era engines heartbeating every 0.5 s
and obeying full syncs, spread over both sidecars, with steady random stores and evicts; quiet
0.3-era engines registered with chunks and then silent. Lookups POST /lookup every 20 ms.

Each scenario kills (SIGKILL) or restarts (SIGTERM) a real process, or sends a maximal frame or
a flood, asserts how long recovery took, then pauses the traffic and asserts EXACT convergence:
the chunk sorted sets hold what the engines hold (tests.support.helpers.index_view), every known prompt's
lookup is what the engines' truth implies, and the quiet instances kept every record. Lookups
that answered are checked too: they never reported a quiet instance wrongly.

Run with ``-s`` for the figures (``[faults] ...`` lines, and a table at the end);
docs/operations.md, "Fault injection: measured", has them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import zmq

from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.embedded import served_by
from kvlookup.proc.redis_server import connect, free_port, ping, port_free
from kvlookup.sidecar.sockets import Limits
from kvlookup.wire import lmcache as proto
from kvlookup.wire.zmqaddr import endpoint
from tests.support.helpers import index_view
from tests.support.procs import ROOT, SidecarProc
from tests.support.procs_embedded import alive, servers_of, until

pytestmark = pytest.mark.slow

CPU = "LocalCPUBackend"
PROFILE = HashProfile(chunk_size=1)  # the controller runs --chunk-size 1: one token, one chunk
TTL_S = 5
HEARTBEAT_S = 0.5
LOOKUP_EVERY_S = 0.02
DEALER_TIMEOUT_MS = 3000
FIGURES: dict[str, dict] = {}


def record(scenario: str, **figures) -> None:
    """Keep and print one scenario's measured figures."""
    FIGURES.setdefault(scenario, {}).update(figures)
    print(f"\n[faults] {scenario}: " + ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()), flush=True)


# -- processes ---------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return sorted(out)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """``VmRSS`` or ``VmHWM`` (peak) of a process, MB; 0.0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Controller:
    """``kvlookup controller`` in LMCache drop-in mode; output in ``log``."""

    def __init__(self, data_dir: Path, pull: int, reply: int, log: Path):
        self.port = free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        self.ports = (self.port, pull, reply)
        self.cmd = [sys.executable, "-m", "kvlookup", "controller", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "WARNING", "--monitor-ports", json.dumps({"pull": pull, "reply": reply}),
                    "--workers", "2", "--data-dir", str(data_dir), "--instance-ttl", str(TTL_S), "--chunk-size", "1"]
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.session = requests.Session()

    def start(self, timeout: float = 30.0) -> float:
        """Start it; returns the seconds until ``GET /health`` answered 200."""
        t0 = time.monotonic()
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=out, cwd=ROOT, start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}; see {self.log}")
            if self.health()[0] == 200:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError("controller did not answer /health")

    def health(self) -> tuple[int, dict]:
        try:
            resp = self.session.get(self.http + "/health", timeout=3)
            return resp.status_code, resp.json()
        except (requests.RequestException, ValueError):
            return 0, {}

    def layout(self, tokens: list[int]) -> dict | None:
        try:
            resp = self.session.post(self.http + "/lookup", json={"tokens": tokens}, timeout=5)
        except requests.RequestException:
            return None
        if resp.status_code != 200:
            return None
        return {k: v for k, v in resp.json().items() if k != "event_id"}

    def workers(self) -> list[int]:
        """The gunicorn workers: children of the master running the master's command line."""
        me = cmdline(self.proc.pid)
        return [c for c in children(self.proc.pid) if cmdline(c) == me and alive(c)]

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> float:
        """SIGTERM to the master (``kill PID``, as docker and Kubernetes send it); returns the
        seconds until it exited. (The whole process group would stop the embedded sidecar
        first, not last: see docs/operations.md, "Fault injection: measured".)"""
        t0 = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.cleanup()
        return time.monotonic() - t0

    def cleanup(self) -> None:
        """Whatever is left of its process group."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


class Sidecar(SidecarProc):
    """The standalone ``kvlookup sidecar``, sharing the controller's embedded Redis (same data
    dir); output in ``log``; the same arguments every start, so a restart is the same sidecar."""

    def __init__(self, data_dir: Path, log: Path):
        super().__init__("--data-dir", str(data_dir), "--instance-ttl", str(TTL_S),
                         pull_url=f"127.0.0.1:{free_port()}", reply_url=f"127.0.0.1:{free_port()}")
        self.log = log

    def start(self, timeout: float = 30.0) -> float:  # type: ignore[override]
        """Start it; returns the seconds until its ``/health`` answered 200."""
        t0 = time.monotonic()
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=out, stderr=out,
                                         start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}; see {self.log}")
            try:
                if requests.get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.02)
        raise TimeoutError("sidecar did not answer /health")

    @property
    def pid(self) -> int:
        return self.proc.pid


def log_lines(path: Path, text: str) -> list[str]:
    try:
        return [line for line in path.read_text(errors="replace").splitlines() if text in line]
    except OSError:
        return []


# -- engines, traffic, lookups -----------------------------------------------------------------


class Engine:
    """A :class:`SimEngine` (its true state, a control port answering health calls) with one
    worker. Sends are serialized by ``lock``; a 0.5-era engine heartbeats every HEARTBEAT_S in
    its own thread and runs every full sync it is asked for, retrying a start that is not
    accepted, as LMCache's FullSyncSender does. A request with no reply within
    DEALER_TIMEOUT_MS (its sidecar died with it) gets a fresh DEALER, so a late reply can never
    be read as the answer to a later request."""

    def __init__(self, name: str, era: str, pull_url: str, reply_url: str, ctx: zmq.Context):
        self.name, self.era, self.reply_url = name, era, reply_url
        self.sim = SimEngine(name, era=era, pull_url=pull_url, reply_url=reply_url if era == "0.5" else None, ctx=ctx)
        self.worker = self.sim.workers[0]
        if self.worker.dealer is not None:
            self.worker.dealer.setsockopt(zmq.RCVTIMEO, DEALER_TIMEOUT_MS)
        self.lock = threading.Lock()
        self.beats: list[tuple[float, float, str]] = []  # (sent at, seconds to the reply, outcome)
        self.syncs: list[tuple[float, str]] = []  # (accepted at, reason)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> set[int]:
        return self.sim.held.get(CPU, set())

    def register(self) -> None:
        with self.lock:
            self.worker.register()

    def store(self, hashes: list[int]) -> None:
        with self.lock:
            self.sim.store(hashes)

    def evict(self, hashes: list[int]) -> None:
        with self.lock:
            self.sim.evict(hashes)

    def holder(self, r) -> str | None:
        return r.hget(keys.worker_key(self.name, 0), keys.location_field(CPU))

    def _fresh_dealer(self) -> None:
        self.worker.dealer.close(0)
        dealer = self.sim.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, DEALER_TIMEOUT_MS)
        dealer.connect(endpoint(self.reply_url))
        self.worker.dealer = dealer

    def start_heartbeats(self) -> None:
        self._thread = threading.Thread(target=self._beat_loop, name=f"hb-{self.name}", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except Exception as exc:  # recorded; the tests assert there are none
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def beat(self) -> None:
        t0 = time.monotonic()
        try:
            reply = self.worker.heartbeat() or {}
        except zmq.Again:
            self.beats.append((t0, time.monotonic() - t0, "timeout"))
            self._fresh_dealer()
            return
        took = time.monotonic() - t0
        syncs = [c.get("reason") for c in reply.get("commands") or [] if c.get("command_type") == "full_sync"]
        self.beats.append((t0, took, "error" if "error" in reply else "sync" if syncs else "ok"))
        if syncs:
            self.full_sync(syncs[0])

    def full_sync(self, reason: str, attempts: int = 30) -> None:
        """Send every chunk held (LocalCPUBackend), atomically with the engine's other sends."""
        for _ in range(attempts):
            with self.lock:
                try:
                    start, _status = self.worker.full_sync(sorted(self.held))
                except zmq.Again:
                    self._fresh_dealer()
                    start = {}
            if start.get("accepted"):
                self.syncs.append((time.monotonic(), reason))
                return
            if self._stop.wait(0.5):
                return
        self.errors.append(f"full sync of {self.name} never accepted ({reason})")

    def synced_since(self, t: float) -> bool:
        return any(at > t for at, _reason in self.syncs)

    def max_beat_s(self, since: float, until: float | None = None) -> float:
        return max((took for at, took, _o in self.beats if at >= since and (until is None or at <= until)),
                   default=0.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self.lock:
            self.sim.close()


class Traffic(threading.Thread):
    """Steady random stores (a prefix of a known prompt) and evicts (1-12 held chunks) on the
    0.5-era engines, until stopped; :meth:`pause` waits for the step in progress."""

    def __init__(self, engines: list[Engine], chains: list[list[int]], seed: int = 3, pace_s: float = 0.004):
        super().__init__(daemon=True, name="traffic")
        self.engines, self.chains = engines, chains
        self.rng = random.Random(seed)
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
                    e = self.rng.choice(self.engines)
                    held = sorted(e.held)
                    if self.rng.random() < 0.5 or not held:
                        chain = self.rng.choice(self.chains)
                        chunk = chain[:self.rng.randint(1, len(chain))]
                        e.store(chunk)
                    else:
                        chunk = self.rng.sample(held, min(len(held), self.rng.randint(1, 12)))
                        e.evict(chunk)
                    self.ops += len(chunk)
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


@dataclass
class Answer:
    started: float
    ended: float
    prompt: int
    status: int  # 0: no HTTP answer (connection refused or reset, timeout)
    layout: dict | None


class Lookups(threading.Thread):
    """POST /lookup of a random known prompt every LOOKUP_EVERY_S; every answer recorded."""

    def __init__(self, url: str, prompts: list[list[int]], seed: int = 5):
        super().__init__(daemon=True, name="lookups")
        self.url, self.prompts = url, prompts
        self.rng = random.Random(seed)
        self.answers: list[Answer] = []
        self.session = requests.Session()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(LOOKUP_EVERY_S):
            i = self.rng.randrange(len(self.prompts))
            t0 = time.monotonic()
            try:
                resp = self.session.post(self.url, json={"tokens": self.prompts[i]}, timeout=3)
                status = resp.status_code
                layout = {k: v for k, v in resp.json().items() if k != "event_id"} if status == 200 else None
            except (requests.RequestException, ValueError):
                status, layout = 0, None
            self.answers.append(Answer(t0, time.monotonic(), i, status, layout))

    def window(self, since: float, until: float | None = None) -> list[Answer]:
        return [a for a in self.answers if a.ended >= since and (until is None or a.started <= until)]

    def outage(self, since: float, until: float | None = None) -> dict:
        """What lookups saw from ``since``: failed (not 200) answers, their statuses, when the
        first 200 after the last failure ended (seconds after ``since``; 0.0 with no failure),
        and the longest time without a 200."""
        window = self.window(since, until)
        failed = [a for a in window if a.status != 200]
        last_fail = max((a.ended for a in failed), default=None)
        ok = sorted(a.ended for a in window if a.status == 200)
        recovered = next((t - since for t in ok if last_fail is None or t > last_fail), None) if failed else 0.0
        ends = [since, *ok]
        return {"lookups": len(window), "failed": len(failed), "statuses": sorted({a.status for a in failed}),
                "answered_again_s": recovered,
                "longest_without_answer_s": max((b - a for a, b in zip(ends, ends[1:], strict=False)), default=None)}

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


def matched(chain: list[int], held: set[int]) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


class Deployment:
    """The controller, the standalone sidecar, the engines, traffic and lookups."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data = tmp / "data"
        rng = random.Random(17)
        system = [rng.randrange(1, 100_000) for _ in range(6)]  # a shared system prompt
        self.prompts = [(system if i % 2 else []) + [rng.randrange(1, 100_000) for _ in range(rng.randint(14, 26))]
                        for i in range(10)]
        self.chains = [PROFILE.chunk_hashes(p) for p in self.prompts]
        self.universe = sorted({h for c in self.chains for h in c})
        self.ctx = zmq.Context()
        self.controller = Controller(self.data, free_port(), free_port(), tmp / "controller.log")
        self.sidecar = Sidecar(self.data, tmp / "sidecar.log")
        self.engines: list[Engine] = []
        self.quiet: list[Engine] = []
        self.r = None

    # -- start and stop ------------------------------------------------------------------------

    def start(self) -> None:
        self.controller.start()
        self.sidecar.start()
        self.r = connect((self.data / "redis.url").read_text().strip())
        emb = (f"127.0.0.1:{self.controller.ports[1]}", f"127.0.0.1:{self.controller.ports[2]}")
        std = (self.sidecar.pull_url, self.sidecar.reply_url)
        self.active = [self.engine(f"e5-emb-{i}", "0.5", emb) for i in range(2)]
        self.active += [self.engine(f"e5-std-{i}", "0.5", std) for i in range(2)]
        holds = [(emb, [self.chains[0], self.chains[1][:10]]), (emb, [self.chains[2]]),
                 (std, [self.chains[3], self.chains[4][:5]])]
        for i, (urls, chains) in enumerate(holds):
            q = self.engine(f"q3-{'emb' if urls is emb else 'std'}-{i}", "0.3", urls)
            q.store([h for c in chains for h in c])
            self.quiet.append(q)
        self.canary = self.engine("canary", "0.3", std)  # registered; stores right before Redis is killed
        for e in self.active:
            e.start_heartbeats()
        self.traffic = Traffic(self.active, self.chains)
        self.lookups = Lookups(self.controller.http + "/lookup", self.prompts)
        self.traffic.start()
        self.lookups.start()
        self.converge("start")
        self.quiet_before = self.quiet_records()
        assert all(n == sum(len(c) for c in chains) for (_h, n), (_u, chains) in
                   zip(self.quiet_before.values(), holds, strict=True)), self.quiet_before

    def engine(self, name: str, era: str, urls: tuple[str, str]) -> Engine:
        e = Engine(name, era, urls[0], urls[1], self.ctx)
        e.register()
        self.engines.append(e)
        return e

    def close(self) -> None:
        for t in (getattr(self, "lookups", None), getattr(self, "traffic", None)):
            if t is not None:
                t.stop()
        for e in self.engines:
            e.close()
        self.controller.stop()
        self.controller.cleanup()
        self.sidecar.stop()
        try:  # the keeper stops the server once no user is left
            until(lambda: not servers_of(self.data), 10)
        finally:
            for pid in servers_of(self.data):
                os.kill(pid, signal.SIGKILL)
            if self.r is not None:
                self.r.close()
            self.ctx.term()

    def ensure_running(self) -> None:
        """After a failed scenario: the processes the next one needs."""
        if self.controller.proc.poll() is not None:
            self.controller.cleanup()
            until(lambda: all(port_free(p) for p in self.controller.ports), 15)
            self.controller.start()
        if self.sidecar.proc.poll() is not None:
            self.sidecar.start()
        self.traffic.resume()

    # -- what the engines hold, and what the index says ------------------------------------------

    def truth(self) -> dict[tuple[str, str], set[int]]:
        """What the engines hold among the universe's chunks (what index_view reads)."""
        universe = set(self.universe)
        out = {(e.name, CPU): e.held & universe for e in self.engines}
        return {k: v for k, v in out.items() if v}

    def expected(self, i: int) -> dict:
        out = {}
        for e in self.engines:
            n = matched(self.chains[i], e.held)
            if n:
                out[e.name] = [CPU, n]
        return out

    def wrong_lookups(self) -> list[int]:
        return [i for i, p in enumerate(self.prompts) if self.controller.layout(p) != self.expected(i)]

    def quiet_records(self) -> dict[str, tuple[str | None, int]]:
        """Quiet instance -> (holder id, records counted for it)."""
        out = {}
        for q in self.quiet:
            hid = q.holder(self.r)
            out[q.name] = (hid, int(self.r.hget(keys.records_key(), hid) or 0) if hid else 0)
        return out

    def quiet_wrong(self, answers: list[Answer]) -> list[Answer]:
        """Answers (200) that reported a quiet instance other than as its chunks imply."""
        bad = []
        for a in answers:
            if a.status != 200:
                continue
            for q in self.quiet:
                n = matched(self.chains[a.prompt], q.held)
                if a.layout.get(q.name) != ([CPU, n] if n else None):
                    bad.append(a)
                    break
        return bad

    def strays(self) -> int:
        """Members of the universe's chunk sets that belong to no engine's current holder, plus
        retired holders not purged yet: 0 once everything retired is gone."""
        current = {e.holder(self.r) for e in self.engines} - {None}
        pipe = self.r.pipeline(transaction=False)
        for h in self.universe:
            pipe.zrange(keys.chunk_key(h), 0, -1)
        members = pipe.execute()
        return sum(m not in current for ms in members for m in ms) + self.r.zcard(keys.dead_holders_key())

    def converge(self, scenario: str, timeout: float = 30.0) -> float:
        """Pause the traffic and wait until the index is exactly the engines' truth: the chunk
        sorted sets hold the engines' records and nothing else (retired holders purged), every
        known prompt's lookup is what the truth implies, and the quiet instances kept their
        records. Returns the seconds it took (recorded as ``converged_s``); fails with the
        difference otherwise."""
        self.traffic.pause()
        try:
            t0 = time.monotonic()
            want = self.truth()
            while True:
                view = index_view(self.r, self.universe)
                if view == want and not self.strays() and not self.wrong_lookups():
                    took = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > timeout:
                    diff = {k: (sorted(want.get(k, set()) - view.get(k, set()))[:3],
                                sorted(view.get(k, set()) - want.get(k, set()))[:3])
                            for k in set(want) | set(view) if want.get(k) != view.get(k)}
                    raise AssertionError(f"{scenario}: no exact convergence within {timeout} s: (only held, only "
                                         f"indexed) {diff}; {self.strays()} stray members and retired holders; "
                                         f"prompts answered wrong {self.wrong_lookups()}")
                time.sleep(0.1)
            quiet = self.quiet_records()
            before = getattr(self, "quiet_before", quiet)
            lost = sum(max(0, before[q][1] - quiet[q][1]) for q in quiet)
            record(scenario, converged_s=took, records_lost=lost + sum(len(v - view[k]) for k, v in want.items()),
                   records_checked=sum(len(v) for v in want.values()))
            assert quiet == before, f"quiet instances lost records: {before} -> {quiet}"
            for e in self.engines:
                assert not e.errors, (e.name, e.errors)
            assert not self.traffic.errors, self.traffic.errors
            return took
        finally:
            self.traffic.resume()

    def steady(self, seconds: float) -> float:
        """Let traffic and lookups run; returns the time it ended (monotonic)."""
        time.sleep(seconds)
        return time.monotonic()


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("faults"))
    t0 = time.monotonic()
    try:
        d.start()
        record("setup", start_s=time.monotonic() - t0, universe=len(d.universe))
        yield d
    finally:
        ops, answers = (d.traffic.ops, d.lookups.answers) if hasattr(d, "lookups") else (0, [])
        d.close()
        took = sorted(a.ended - a.started for a in answers if a.status == 200) or [0.0]
        record("total", seconds=time.monotonic() - t0, chunk_ops=ops, lookups=len(answers),
               lookup_p50_ms=1000 * took[len(took) // 2], lookup_p99_ms=1000 * took[len(took) * 99 // 100])
        print_table()


@pytest.fixture()
def fresh(dep):
    """The deployment, running, with steady traffic for a moment before the fault."""
    dep.ensure_running()
    dep.steady(1.0)
    return dep


def wait(fn: Callable[[], bool], timeout: float, what: str) -> float:
    try:
        return until(fn, timeout, step=0.02)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout} s") from None


def print_table() -> None:
    if not FIGURES:
        return
    print("\n| scenario | measured |\n|---|---|")
    for name, figs in FIGURES.items():
        cells = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figs.items())
        print(f"| {name} | {cells} |")


class Sampler(threading.Thread):
    """Calls ``fn()`` every ``every_s`` seconds until stopped; keeps (time, value)."""

    def __init__(self, fn: Callable[[], float], every_s: float):
        super().__init__(daemon=True, name="sampler")
        self.fn, self.every_s = fn, every_s
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.fn()))
            if self.stop_event.wait(self.every_s):
                return

    def stop(self) -> list[float]:
        self.stop_event.set()
        self.join(5)
        return [v for _t, v in self.samples]


def lowest_and_renewed(samples: list[tuple[float, float]], since: float) -> tuple[float, float | None]:
    """From lease margins sampled from ``since``: the lowest, and when the lease was renewed
    after it (seconds after ``since``)."""
    after = [(t, v) for t, v in samples if t >= since]
    i = min(range(len(after)), key=lambda k: after[k][1])
    return after[i][1], (after[i + 1][0] - since) if i + 1 < len(after) else None


def lease_margin_s(r, names: list[str]) -> float:
    """The shortest time left on the liveness lease of any of ``names`` (negative: lapsed)."""
    now_ms = time.time() * 1000
    scores = dict(r.zrange(keys.alive_key(), 0, -1, withscores=True))
    return min(scores.get(n, float("-inf")) - now_ms for n in names) / 1000


def purge_time(r, holder: str, timeout: float = 60.0) -> float:
    """Seconds until a retired holder's records are purged and the holder forgotten."""
    return wait(lambda: r.hget(keys.records_key(), holder) is None and r.zscore(keys.dead_holders_key(), holder)
                is None, timeout, f"holder {holder} purged")


def max_sync_keys(limit: int, name: str) -> int:
    """How many 64-bit keys fit in one FullSyncBatchMsg frame of at most ``limit`` bytes."""
    def size(n: int) -> int:
        return len(proto.encode(proto.FullSyncBatchMsg(name, 0, CPU, f"{name}_0_00000000", 0, [2**62] * n)))
    n = (limit - size(70_000)) // 9 + 70_000
    while size(n) > limit:
        n -= 1
    while size(n + 1) <= limit:
        n += 1
    return n


# -- the scenarios -----------------------------------------------------------------------------


def health_summary(c: Controller) -> tuple[int, int | None, int | None, str | None]:
    """(status, embedded Redis server pid, embedded sidecar pid, its state) of GET /health."""
    status, body = c.health()
    comps = body.get("components", {})
    sc = comps.get("embedded_sidecar", {})
    return status, comps.get("redis", {}).get("server_pid"), sc.get("pid"), sc.get("state")


def outage_of_health(samples: list[tuple[float, tuple]], since: float, healthy: Callable[[tuple], bool]) -> dict:
    """From /health samples taken from ``since``: when it first answered 503, when it was first
    healthy again after that, and every status seen in between (the 503 must hold until then)."""
    after = [(t - since, v) for t, v in samples if t >= since]
    first_503 = next((t for t, v in after if v[0] == 503), None)
    back = next((t for t, v in after if first_503 is not None and t > first_503 and healthy(v)), None)
    between = {v[0] for t, v in after if first_503 is not None and first_503 <= t < (back or float("inf"))}
    return {"first_503_s": first_503, "healthy_s": back, "between": sorted(between)}


def test_1_kill9_of_the_embedded_redis_heals_exactly(fresh):
    d = fresh
    old = served_by(d.data)["server_pid"]
    assert servers_of(d.data) == [old]
    url = (d.data / "redis.url").read_text().strip()
    canary_chain = PROFILE.chunk_hashes([7, 7, 7] + list(range(200)))  # not in any prompt
    d.universe = sorted(set(d.universe) | set(canary_chain))
    d.canary.store(canary_chain)
    wait(lambda: d.canary.holder(d.r) is not None, 5, "canary holder")
    hid = d.canary.holder(d.r)
    wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == len(canary_chain), 5, "canary written")
    journaled = [len(log_lines(p, "failover: wrote the ops")) for p in (d.sidecar.log, d.controller.log)]
    health = Sampler(lambda: health_summary(d.controller), 0.02)
    killed = time.monotonic()  # well within a second of the canary's acknowledged writes
    os.kill(old, signal.SIGKILL)
    back = wait(lambda: ping(url) and (served_by(d.data) or {}).get("server_pid") not in (None, old), 10,
                "valkey-server restarted")
    pipe = d.r.pipeline(transaction=False)  # before the sidecars heal (their master watch looks once a second)
    for h in canary_chain:
        pipe.zscore(keys.chunk_key(h), hid)
    canary_lost = sum(s is None for s in pipe.execute())
    wait(lambda: any(t > killed and v[0] == 200 and v[1] not in (None, old) for t, v in health.samples), 10,
         "/health 200 naming the new server")
    health.stop()
    h = outage_of_health(health.samples, killed, lambda v: v[0] == 200)
    wait(lambda: all(e.synced_since(killed) for e in d.active), 10, "full syncs of every 0.5 engine")
    synced_s = time.monotonic() - killed
    wait(lambda: [len(log_lines(p, "failover: wrote the ops")) for p in (d.sidecar.log, d.controller.log)] ==
         [n + 1 for n in journaled], 5, "both sidecars rewrote their journal once")
    rewritten = [log_lines(p, "failover: wrote the ops")[-1].rsplit("(", 1)[1].split(")")[0]
                 for p in (d.sidecar.log, d.controller.log)]
    end = d.steady(1.0)
    out = d.lookups.outage(killed, end)
    record("1 kill -9 valkey-server", server_back_s=back, health_503_after_s=h["first_503_s"],
           health_200_s=h["healthy_s"], first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"],
           statuses=out["statuses"], acked_records_missing_at_restart=canary_lost,
           journal_ops_rewritten="+".join(rewritten), full_syncs_done_s=synced_s)
    assert back < 2.0 and h["healthy_s"] is not None and h["healthy_s"] < 5.0 and h["between"] == [503]
    assert out["answered_again_s"] is not None and out["answered_again_s"] < 5.0 and out["statuses"] == [503]
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("1 kill -9 valkey-server")  # the canary included: its records are all there
    assert all(d.r.zscore(keys.chunk_key(h), hid) is not None for h in canary_chain)


def test_2_kill9_of_the_standalone_sidecar_then_a_start_converges_exactly(fresh):
    d = fresh
    std = [e for e in d.active if "-std-" in e.name]
    killed = time.monotonic()
    d.sidecar.kill(signal.SIGKILL)
    restart_s = d.sidecar.start()
    wait(lambda: all(e.synced_since(killed) for e in std), 10, "full syncs of the standalone sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    out = d.lookups.outage(killed, end)
    record("2 kill -9 standalone sidecar", back_s=restart_s, full_syncs_done_s=synced_s,
           failed_lookups=out["failed"], longest_without_answer_s=out["longest_without_answer_s"])
    assert restart_s < 5.0 and synced_s < 8.0
    assert out["failed"] == 0  # the controller and its Redis never noticed
    assert {reason for e in std for at, reason in e.syncs if at > killed} == {"controller_restart"}
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("2 kill -9 standalone sidecar")


def test_3_kill9_of_the_embedded_sidecar_is_restarted_by_the_supervisor(fresh):
    d = fresh
    emb = [e for e in d.active if "-emb-" in e.name]
    old = d.controller.health()[1]["components"]["embedded_sidecar"]["pid"]
    assert old in children(d.controller.proc.pid)
    health = Sampler(lambda: health_summary(d.controller), 0.02)
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait(lambda: any(t > killed and v[0] == 200 and v[2] not in (None, old) for t, v in health.samples), 10,
         "/health 200 with a new embedded sidecar")
    health.stop()
    h = outage_of_health(health.samples, killed, lambda v: v[0] == 200 and v[2] not in (None, old) and v[3] == "up")
    new = d.controller.health()[1]["components"]["embedded_sidecar"]
    wait(lambda: all(e.synced_since(killed) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    out = d.lookups.outage(killed, end)
    record("3 kill -9 embedded sidecar", health_503_after_s=h["first_503_s"], back_s=h["healthy_s"],
           restarts=new["restarts"], full_syncs_done_s=synced_s, failed_lookups=out["failed"])
    assert h["first_503_s"] < 1.0 and h["healthy_s"] < 5.0 and h["between"] == [503]  # 503 until it is back
    assert new["pid"] in children(d.controller.proc.pid) and new["state"] == "up"
    assert out["failed"] == 0
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("3 kill -9 embedded sidecar")


def test_4_kill9_of_a_gunicorn_worker_leaves_the_other_answering(fresh):
    d = fresh
    workers = d.controller.workers()
    assert len(workers) == 2, workers
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    replaced = wait(lambda: len(set(d.controller.workers()) - {workers[0]}) == 2, 10, "worker replaced")
    end = d.steady(2.0)
    out = d.lookups.outage(killed, end)
    record("4 kill -9 gunicorn worker", replaced_s=replaced, failed_lookups=out["failed"], statuses=out["statuses"],
           longest_without_answer_s=out["longest_without_answer_s"], lookups=out["lookups"])
    assert replaced < 5.0
    assert out["failed"] <= 2 and out["longest_without_answer_s"] < 1.0
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("4 kill -9 gunicorn worker")


def test_5_kill9_of_the_controller_master_frees_its_ports_and_a_restart_converges(fresh):
    d = fresh
    c = d.controller
    emb = [e for e in d.active if "-emb-" in e.name]
    keeper = served_by(d.data)["pid"]
    kids = [k for k in children(c.proc.pid) if k != keeper]  # 2 workers and the sidecar
    assert len(kids) == 3, kids
    leases = Sampler(lambda: lease_margin_s(d.r, [q.name for q in d.quiet]), 0.1)
    killed = time.monotonic()
    c.kill9()
    freed = wait(lambda: all(port_free(p) for p in c.ports), 10, "HTTP and monitor ports free")
    start_s = c.start()  # as soon as it can: the quiet instances' leases run out TTL_S after their last renewal
    back_s = time.monotonic() - killed
    gone = wait(lambda: not any(alive(k) for k in kids), 5, "workers and sidecar gone") + back_s
    wait(lambda: all(e.synced_since(killed) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    leases.stop()
    margin, renewed = lowest_and_renewed(leases.samples, killed)
    out = d.lookups.outage(killed, end)
    record("5 kill -9 controller master", ports_free_s=freed, start_s=start_s, health_200_s=back_s,
           first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"], full_syncs_done_s=synced_s,
           quiet_leases_renewed_s=renewed, shortest_quiet_lease_left_s=margin)
    assert margin > 0  # the quiet instances never dropped out (a reaper would have purged them)
    assert freed < 3.0 and gone < 10.0 and back_s < 10.0 and out["answered_again_s"] < 10.0
    assert alive(keeper) and servers_of(d.data)  # the standalone sidecar still uses the embedded Redis
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("5 kill -9 controller master")


def test_6_sigterm_restarts_of_controller_and_sidecar_lose_nothing(fresh):
    d = fresh
    emb = [e for e in d.active if "-emb-" in e.name]
    leases = Sampler(lambda: lease_margin_s(d.r, [q.name for q in d.quiet]), 0.1)
    t0 = time.monotonic()
    stop_s = d.controller.stop()
    start_s = d.controller.start()
    wait(lambda: all(e.synced_since(t0) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    end = d.steady(1.0)
    leases.stop()
    margin, renewed = lowest_and_renewed(leases.samples, t0)
    out = d.lookups.outage(t0, end)
    record("6a SIGTERM controller restart", stop_s=stop_s, start_s=start_s,
           first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"], statuses=out["statuses"],
           longest_without_answer_s=out["longest_without_answer_s"], quiet_leases_renewed_s=renewed,
           shortest_quiet_lease_left_s=margin)
    assert margin > 0  # the embedded sidecar stopped last: its quiet instances never lapsed
    assert stop_s < 8.0 and start_s < 10.0
    assert not d.quiet_wrong(d.lookups.window(t0))
    d.converge("6a SIGTERM controller restart")

    t1 = time.monotonic()
    d.sidecar.kill(signal.SIGTERM)
    stop_s = time.monotonic() - t1
    start_s = d.sidecar.start()
    std = [e for e in d.active if "-std-" in e.name]
    wait(lambda: all(e.synced_since(t1) for e in std), 10, "full syncs of the standalone sidecar's engines")
    end = d.steady(1.0)
    out = d.lookups.outage(t1, end)
    record("6b SIGTERM sidecar restart", stop_s=stop_s, start_s=start_s, failed_lookups=out["failed"])
    assert stop_s < 5.0 and start_s < 3.0 and out["failed"] == 0
    assert not d.quiet_wrong(d.lookups.window(t1))
    d.converge("6b SIGTERM sidecar restart")

def test_7_a_maximal_frame_in_a_full_sync_lets_no_lease_lapse(fresh):
    d = fresh
    sc = d.sidecar
    std = [e for e in d.active if "-std-" in e.name]
    limit = Limits().max_frame_bytes
    big = d.engine("big-0.5", "0.5", (sc.pull_url, sc.reply_url))
    n = max_sync_keys(limit, big.name)
    rng = random.Random(23)
    chunks = list(dict.fromkeys(d.chains[5] + [2**62 + rng.getrandbits(62) for _ in range(n + 100)]))[:n]
    frame = len(proto.encode(proto.FullSyncBatchMsg(big.name, 0, CPU, f"{big.name}_0_00000000", 0, chunks)))
    assert limit - 16 < frame <= limit
    names = [e.name for e in d.engines]
    leases = Sampler(lambda: lease_margin_s(d.r, names), 0.05)
    rss = Sampler(lambda: memory_mb(sc.pid), 0.1)
    t0 = time.monotonic()
    with big.lock:
        big.sim.held[CPU] = set(chunks)
        start, status = big.worker.full_sync(chunks, batch_size=len(chunks))
    assert start.get("accepted") and status.get("is_complete"), (start, status)
    wait(lambda: big.holder(d.r) is not None, 10, "holder of the big sync")
    hid = big.holder(d.r)
    ingest_s = wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == n, 60, "maximal frame written")
    end = d.steady(1.0)
    margins, peak = leases.stop(), max(rss.stop())
    hwm = memory_mb(sc.pid, "VmHWM")
    beat_s = max(e.max_beat_s(t0, end) for e in std)
    outcomes = {o for e in std for at, _took, o in e.beats if t0 <= at <= end}
    out = d.lookups.outage(t0, end)
    record("7 maximal frame", keys=n, frame_bytes=frame, written_s=ingest_s, ops_per_s=int(n / ingest_s),
           longest_heartbeat_reply_s=beat_s, shortest_lease_left_s=min(margins), peak_rss_mb=peak,
           vm_hwm_mb=hwm, failed_lookups=out["failed"])
    assert min(margins) > 0  # no live instance ever dropped out
    assert beat_s < 2.0 and outcomes == {"ok"}
    assert out["failed"] == 0 and not d.quiet_wrong(d.lookups.window(t0))
    d.converge("7 maximal frame")
    assert int(d.r.hget(keys.records_key(), hid)) == n  # all of it, not only the chunks of prompt 5

    # purge: the engine restarts cold, so its old holder (the n records) is retired
    t1 = time.monotonic()
    with big.lock:
        big.worker.register()
        big.sim.held.clear()
    took = purge_time(d.r, hid)
    record("purge (re-registration)", records=n, purged_s=took, records_per_s=int(n / took),
           started_after_s=time.monotonic() - t1 - took)
    d.engines.remove(big)
    big.close()


FLOOD = r"""
import json, sys, time, zmq
from kvlookup.wire import lmcache as proto
pull, inst, seconds, n, base = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 10000)
    s.connect("tcp://" + pull)
    socks.append(s)
socks[0].send(proto.encode(proto.RegisterMsgV3(inst, 0, "127.0.0.1", 0, "flood:1")))
print("registered", flush=True)
sys.stdin.readline()
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLOUT)
sent = waits = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    progress = False
    for s in socks:
        try:
            s.send(proto.encode(proto.KVAdmitMsg(inst, 0, base + sent, "LocalCPUBackend")), zmq.NOBLOCK)
            sent += 1
            progress = True
        except zmq.Again:
            pass
    if not progress:  # every socket at its high-water mark: wait until one can send
        waits += 1
        poller.poll(10)
print(json.dumps({"sent": sent, "waits": waits}), flush=True)
sys.stdin.readline()
socks[0].send(proto.encode(proto.DeRegisterMsg(inst, 0, "127.0.0.1", 0)))
for s in socks:
    s.close()
ctx.term()
"""
FLOOD_S = 10.0
RSS_LIMIT_MB = 300.0


def test_8_a_flood_of_small_admits_stays_bounded_and_loses_nothing(fresh):
    d = fresh
    sc = d.sidecar
    std = [e for e in d.active if "-std-" in e.name]
    inst = "flood-0.3"
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, sc.pull_url, inst, str(FLOOD_S), "4", str(2**62)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert flood.stdout.readline().strip() == "registered"
        wait(lambda: d.r.exists(keys.worker_key(inst, 0)) == 1, 10, "flood instance registered")
        names = [e.name for e in d.engines] + [inst]
        leases = Sampler(lambda: lease_margin_s(d.r, names), 0.1)
        rss = Sampler(lambda: memory_mb(sc.pid), 0.1)
        before = memory_mb(sc.pid)
        t0 = time.monotonic()
        flood.stdin.write("go\n")
        flood.stdin.flush()
        sent = json.loads(flood.stdout.readline())["sent"]
        t_end = time.monotonic()
        hid = d.r.hget(keys.worker_key(inst, 0), keys.location_field(CPU))
        drained = wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == sent, 60, "flood written")
        time.sleep(max(0.0, t_end + 10.0 - time.monotonic()))
        after = memory_mb(sc.pid)
        samples, margins = rss.stop(), leases.stop()
        out = d.lookups.outage(t0, t_end)
        beat_s = max(e.max_beat_s(t0, t_end) for e in std)
        outcomes = {o for e in std for at, _took, o in e.beats if t0 <= at <= t_end}
        record("8 flood", seconds=t_end - t0, admits_sent=sent, sent_per_s=int(sent / (t_end - t0)),
               written_after_flood_s=drained, admits_lost=sent - int(d.r.hget(keys.records_key(), hid)),
               rss_before_mb=before, peak_rss_mb=max(samples), rss_10s_after_mb=after,
               longest_heartbeat_reply_s=beat_s, failed_lookups=out["failed"],
               longest_without_answer_s=out["longest_without_answer_s"], shortest_lease_left_s=min(margins))
        assert max(samples) <= RSS_LIMIT_MB
        assert int(d.r.hget(keys.records_key(), hid)) == sent  # back pressure, never a drop
        assert out["failed"] == 0 and out["longest_without_answer_s"] < 2.0
        assert beat_s < 2.0 and outcomes == {"ok"} and min(margins) > 0
        assert not d.quiet_wrong(d.lookups.window(t0))

        flood.stdin.write("deregister\n")
        flood.stdin.flush()
        took = purge_time(d.r, hid)  # from the DeRegisterMsg sent, through the PUSH queue behind the flood
        record("purge (deregistration)", records=sent, purged_s=took, records_per_s=int(sent / took))
        assert flood.wait(15) == 0
    finally:
        flood.kill()
    d.converge("8 flood")
