"""A small LMCache fleet for the failover tests (Redis Cluster and Sentinel).

A real sidecar process; simulated engines of both protocol eras, each in its own thread,
that keep their true state (the chunks they hold) while they admit and evict, answer
heartbeats and run the full syncs they are asked for, in order, as one engine would; steady
lookups that record every answer; and exact comparisons of the index with the engines' truth,
through lookups and through the chunk sorted sets themselves.
"""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
import zmq

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port

CPU = "LocalCPUBackend"
PROFILE = HashProfile()  # 256-token chunks
ROOT = Path(__file__).resolve().parents[2]


def make_prompts(seed: int, n: int = 24) -> list[list[int]]:
    """``n`` prompts of 3-8 chunks; each starts with one of three 2-chunk system prompts, as
    chat traffic does (their first chunks are the fleet's hottest keys)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 128_000) for _ in range(2 * PROFILE.chunk_size)] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(1, 128_000) for _ in range(rng.randint(1, 6) * PROFILE.chunk_size)]
            for _ in range(n)]


class SidecarProc:
    """``python -m kvlookup sidecar`` with PULL and ROUTER on free ports; its log in ``log``."""

    def __init__(self, redis_args: Sequence[str], log: Path):
        self.pull_url, self.reply_url = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvlookup", "sidecar", *redis_args, "--pull-url", self.pull_url,
             "--reply-url", self.reply_url, "--instance-ttl", "30", "--log-level", "INFO"],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT)

    def lines(self, text: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if text in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()


class Engine(threading.Thread):
    """One simulated LMCache engine (one worker, LocalCPUBackend) with its true state.

    era "0.5" engines heartbeat every ``heartbeat_s`` and, on a ``full_sync`` command, send
    every chunk they hold (retrying a start that is not accepted, as LMCache does); "0.3"
    engines only admit and evict. ``static`` engines admit once and then only heartbeat.
    Random evictions take only chunks of ``prompts``, so chunks admitted by :meth:`do` stay
    as they were left.
    """

    def __init__(self, instance_id: str, era: str, sidecar: SidecarProc, prompts: list[list[int]], seed: int, *,
                 static: bool = False, heartbeat_s: float | None = 0.3, pace_s: float = 0.02):
        super().__init__(daemon=True, name=f"engine-{instance_id}")
        self.instance_id, self.era, self.static = instance_id, era, static
        self.sim = WorkerSim(instance_id, era=era, pull_url=sidecar.pull_url,
                             reply_url=sidecar.reply_url if era == "0.5" else None,
                             ctx=zmq.Context.instance())
        if self.sim.dealer is not None:
            self.sim.dealer.setsockopt(zmq.RCVTIMEO, 60_000)  # a sidecar waiting out a failover answers late
        self.chains = [PROFILE.chunk_hashes(p) for p in prompts]
        self.pool = {h for c in self.chains for h in c}
        self.todo: queue.Queue = queue.Queue()
        self.rng = random.Random(seed)
        self.heartbeat_s, self.pace_s = heartbeat_s, pace_s
        self.held: set[int] = set()
        self.lock = threading.Lock()  # held changes only with the message that reports it
        self.stop_event = threading.Event()
        self.syncs: list[float] = []  # when each full sync was accepted (monotonic)
        self.ops = 0
        self.errors: list[str] = []

    def start_engine(self, admit: Sequence[int] = ()) -> Engine:
        """Register (0.5: and wait for the reply), admit ``admit``, then run."""
        self.sim.register()
        if admit:
            self._send("admit", list(admit))
        self.start()
        return self

    def _send(self, op: str, chunks: list[int]) -> None:
        with self.lock:
            if op == "register":  # the engine restarted: a new epoch with a cold cache
                time.sleep(0.05)  # ZMQ orders per socket: let its last PUSH ops arrive before the DEALER request
                self.sim.register()
                self.held.clear()
                return
            (self.sim.admit if op == "admit" else self.sim.evict)(chunks)
            (self.held.update if op == "admit" else self.held.difference_update)(chunks)
            self.ops += len(chunks)

    def step(self) -> None:
        chain = self.rng.choice(self.chains)
        evictable = sorted(self.held & self.pool)
        if self.rng.random() < 0.6 or not evictable:
            self._send("admit", chain[:self.rng.randint(1, len(chain))])
        else:
            self._send("evict", self.rng.sample(evictable, min(len(evictable), self.rng.randint(1, 3))))

    def do(self, op: str, chunks: Sequence[int] = (), timeout: float = 10.0) -> None:
        """Admit or evict ``chunks``, or register again (``"register"``: the engine restarted
        cold), from the engine's own thread, in order with its traffic; returns once sent."""
        done = threading.Event()
        self.todo.put((op, list(chunks), done))
        if not done.wait(timeout):
            raise TimeoutError(f"{self.instance_id} did not send its {op}")

    def run(self) -> None:
        next_hb = 0.0
        while not self.stop_event.is_set():
            try:
                while not self.todo.empty():
                    op, chunks, done = self.todo.get()
                    self._send(op, chunks)
                    done.set()
                if not self.static:
                    self.step()
                if self.era == "0.5" and self.heartbeat_s is not None and time.monotonic() >= next_hb:
                    self._heartbeat()
                    next_hb = time.monotonic() + self.heartbeat_s
            except Exception as exc:  # recorded; the test asserts there are none
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stop_event.wait(self.pace_s)

    def _heartbeat(self) -> None:
        reply = self.sim.heartbeat()
        if any(c.get("command_type") == "full_sync" for c in reply.get("commands") or []):
            for _attempt in range(30):  # LMCache retries a start that is not accepted
                with self.lock:
                    start, _status = self.sim.full_sync(sorted(self.held))
                if start.get("accepted"):
                    self.syncs.append(time.monotonic())
                    return
                time.sleep(0.5)
            self.errors.append(f"full sync of {self.instance_id} never accepted: {start}")

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)

    def close(self) -> None:
        self.sim.close()


@dataclass
class Answer:
    started: float
    ended: float
    prompt: int
    got: dict | None  # instance -> (location, matched length); None: the lookup raised
    error: str = ""


class Lookups(threading.Thread):
    """Looks up random prompts back to back through ``client`` and records every answer."""

    def __init__(self, client: Client, prompts: list[list[int]], seed: int = 7, pace_s: float = 0.01):
        super().__init__(daemon=True, name="lookups")
        self.client, self.prompts = client, prompts
        self.rng = random.Random(seed)
        self.pace_s = pace_s
        self.answers: list[Answer] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            i = self.rng.randrange(len(self.prompts))
            t0 = time.monotonic()
            try:
                got = self.client.matches(self.prompts[i])
                layout = {m.instance_id: (m.location, m.matched_prefix_length) for m in got}
                self.answers.append(Answer(t0, time.monotonic(), i, layout))
            except Exception as exc:
                self.answers.append(Answer(t0, time.monotonic(), i, None, f"{type(exc).__name__}: {exc}"))
            self.stop_event.wait(self.pace_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)

    def outage(self, since: float) -> dict:
        """What lookups saw from ``since`` (monotonic; the kill): errors, the first failing and
        the first succeeding lookup after the first failure, the longest time without an
        answer, and how long after ``since`` the first lookup started after it was answered."""
        after = [a for a in self.answers if a.ended >= since]
        failed = [a for a in after if a.got is None]
        first_fail = failed[0].ended if failed else None
        ok_after = [a for a in after if a.got is not None and (first_fail is None or a.ended > first_fail)]
        ends = sorted([since] + [a.ended for a in after if a.got is not None])
        started_after = [a for a in after if a.started >= since and a.got is not None]
        return {
            "errors": len(failed),
            "error_kinds": sorted({a.error.split(":")[0] for a in failed}),
            "failing_to_succeeding_s": (ok_after[0].ended - first_fail) if failed and ok_after else None,
            "longest_without_answer_s": max(b - a for a, b in zip(ends, ends[1:], strict=False)) if len(ends) > 1
            else None,
            "first_answer_after_s": (started_after[0].ended - since) if started_after else None,
            "max_latency_s": max((a.ended - a.started for a in after), default=0.0),
        }


@dataclass
class HttpMatch:
    instance_id: str
    location: str
    matched_prefix_length: int


class HttpClient:
    """``matches()`` through a controller process's POST /lookup (tests.support.procs.ControllerProc),
    so :class:`Lookups` and :func:`layouts_match` can drive the HTTP path too."""

    def __init__(self, controller):
        self.controller = controller

    def matches(self, tokens: list[int]) -> list[HttpMatch]:
        return [HttpMatch(inst, loc, n) for inst, (loc, n) in self.controller.layout(tokens).items()]


def expected_layout(engines: Sequence[Engine], tokens: list[int]) -> dict:
    """What a lookup of ``tokens`` must answer for ``engines``' true state (one worker each,
    LocalCPUBackend): instance -> (location, tokens of its longest run of chunks from 0)."""
    chain = PROFILE.chunk_hashes(tokens)
    out = {}
    for e in engines:
        n = 0
        while n < len(chain) and chain[n] in e.held:
            n += 1
        if n:
            out[e.instance_id] = (CPU, min(n * PROFILE.chunk_size, len(tokens)))
    return out


def true_records(engines: Sequence[Engine]) -> set[tuple[str, str, str]]:
    """(chunk hash, instance, location) for every chunk every engine holds."""
    return {(str(c), e.instance_id, CPU) for e in engines for c in e.held}


@dataclass
class IndexState:
    """The chunk records as stored: records of current holders, and members that do not
    belong to one (retired holders not purged yet, or strays)."""

    records: set[tuple[str, str, str]] = field(default_factory=set)
    other_members: int = 0
    dead_holders: int = 0
    others: dict[str, int] = field(default_factory=dict)  # holder id -> members not of a current holder


def index_state(registry: redis.Redis, masters: Callable[[], list[redis.Redis]],
                instances: Sequence[str]) -> IndexState:
    """Read every chunk sorted set on every master (SCAN) and sort its members into records of
    the current holder of (instance, worker 0, LocalCPUBackend) and the rest.

    registry: a client for the registry keys (a RedisCluster or the Sentinel master client).
    masters: plain clients of each master now, to scan their keys.
    """
    current = {}
    for inst in instances:
        hid = registry.hget(keys.worker_key(inst, 0), keys.location_field(CPU))
        if hid is not None:
            current[hid] = inst
    dead = set(registry.zrange(keys.dead_holders_key(), 0, -1))
    live = {hid: inst for hid, inst in current.items() if hid not in dead}
    state = IndexState(dead_holders=len(dead))
    prefix = keys.chunk_prefix()
    for node in masters():
        for key in node.scan_iter(match=prefix + "*", count=1000):
            chunk = key[len(prefix):]
            for hid in node.zrange(key, 0, -1):
                if hid in live:
                    state.records.add((chunk, live[hid], CPU))
                else:
                    state.other_members += 1
                    state.others[hid] = state.others.get(hid, 0) + 1
    return state


def layouts_match(client: Client, engines: Sequence[Engine], prompts: list[list[int]]) -> list[int]:
    """Indices of the prompts whose lookup differs from the engines' truth."""
    return [i for i, p in enumerate(prompts) if
            {m.instance_id: (m.location, m.matched_prefix_length) for m in client.matches(p)}
            != expected_layout(engines, p)]


def wait_until(fn: Callable[[], bool], timeout: float, every: float = 0.2) -> float | None:
    """Seconds until ``fn()`` was true (None: not within ``timeout``); exceptions count as false."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if fn():
                return time.monotonic() - t0
        except (redis.RedisError, OSError, LookupError):  # a failover in progress
            pass
        time.sleep(every)
    return None


class Fleet:
    """A sidecar process, three 0.5-era and two 0.3-era engines, a static 0.3-era engine whose
    answers never change, and steady lookups (not started), on one deployment.

    redis_args: the sidecar's Redis flags. client: the lookup client. registry: a client for
    the registry keys. masters: plain clients of every master now (to scan chunk keys).
    """

    def __init__(self, redis_args: Sequence[str], client: Client, registry: redis.Redis,
                 masters: Callable[[], list[redis.Redis]], tmp_path: Path, seed: int,
                 heartbeat_s: float | None = 0.3):
        self.prompts = make_prompts(seed)
        self.heartbeat_s = heartbeat_s  # of the 0.5-era engines; None: they never heartbeat (0.5.6's default)
        self.sidecar = SidecarProc(redis_args, tmp_path / "sidecar.log")
        self.rc, self.client, self._masters = registry, client, masters
        self.engines = [Engine(f"e5-{i}", "0.5", self.sidecar, self.prompts, seed + i, heartbeat_s=heartbeat_s)
                        for i in range(3)]
        self.engines += [Engine(f"e3-{i}", "0.3", self.sidecar, self.prompts, seed + 10 + i) for i in range(2)]
        self.static = Engine("static", "0.3", self.sidecar, self.prompts, seed + 20, static=True)
        self.static_prompts = self.prompts[:4]
        for e in self.engines:
            e.start_engine()
        self.static.start_engine([h for p in self.static_prompts for h in PROFILE.chunk_hashes(p)])
        self.all = [*self.engines, self.static]
        self.lookups = Lookups(self.client, self.prompts)
        indexed = wait_until(lambda: all(self._static_ok(p) for p in self.static_prompts), 20)
        assert indexed is not None, "the static engine's chunks were not indexed"

    def _static_ok(self, tokens) -> bool:
        got = {m.instance_id: m.matched_prefix_length for m in self.client.matches(tokens)}
        return got.get("static") == expected_layout([self.static], tokens)["static"][1]

    def static_answer(self, prompt: int) -> tuple | None:
        """What every lookup of prompt ``prompt`` must answer for the static engine."""
        return expected_layout([self.static], self.prompts[prompt]).get("static")

    def static_wrong(self, lookups: Lookups | None = None) -> list:
        """Answers that were given and are wrong for the static engine (its chunks never change)."""
        answers = (lookups or self.lookups).answers
        return [a for a in answers if a.got is not None and tuple(a.got.get("static") or ()) !=
                tuple(self.static_answer(a.prompt) or ())]

    def state(self) -> IndexState:
        return index_state(self.rc, self._masters, [e.instance_id for e in self.all])

    def converged(self) -> bool:
        """The chunk sorted sets hold exactly the engines' records and nothing else (retired
        holders purged), and every prompt's lookup is the truth."""
        s = self.state()
        return (s.records == true_records(self.all) and s.other_members == 0 and s.dead_holders == 0
                and not layouts_match(self.client, self.all, self.prompts))

    def stop_engines(self) -> None:
        for e in self.all:
            e.stop()

    def close(self) -> None:
        self.lookups.stop_event.set()
        for e in self.all:
            e.stop_event.set()
        for e in self.all:
            e.join(10)
            e.close()
        self.sidecar.stop()



    # -- the lag window of a failover test --------------------------------------------------

    def hold_private(self) -> None:
        """Give every engine chunks no random op touches (``before``): what the lag window then
        does to them stays wrong unless the index is healed."""
        n = len(self.engines)
        private = make_prompts(seed=99, n=2 * n + 1)
        self.before, self.during, self.late_prompt = private[:n], private[n:2 * n], private[2 * n]
        self.prompts += private
        for e, p in zip(self.engines, self.before, strict=True):
            e.do("admit", PROFILE.chunk_hashes(p))

    def lag_window(self) -> Engine:
        """Traffic while the master's replica lags (all of it lost with the master): every engine
        evicts half its ``before`` and admits ``during``; one 0.5-era engine restarts cold (its
        new epoch is lost, the old one comes back with the old records until a full sync); a new
        0.5-era engine registers and admits (its holder id is lost, its records on other shards
        are not); a new 0.3-era engine registers. Returns that last one, to start once the new
        master serves (a 0.3-era engine has no resync: it speaks again only then)."""
        for e, b, d in zip(self.engines, self.before, self.during, strict=True):
            e.do("evict", PROFILE.chunk_hashes(b)[1::2])
            e.do("admit", PROFILE.chunk_hashes(d))
        restarted = self.engines[0]
        restarted.do("register")
        restarted.do("admit", PROFILE.chunk_hashes(self.during[0]))
        late5 = Engine("late5", "0.5", self.sidecar, self.prompts, 77, heartbeat_s=self.heartbeat_s).start_engine(
            PROFILE.chunk_hashes(self.late_prompt))
        late3 = Engine("late3", "0.3", self.sidecar, self.prompts, 78)
        late3.sim.register()
        self.all += [late5, late3]
        self.engines += [late5, late3]
        return late3

    def converge(self, timeout: float = 45.0) -> tuple[float, float | None]:
        """Stop the engines and wait for :meth:`converged`; returns (when stopped, seconds)."""
        self.stop_engines()
        stopped = time.monotonic()
        return stopped, wait_until(self.converged, timeout, every=0.5)

    def why_not(self) -> str:
        """What differs from the truth, for an assertion message."""
        s, truth = self.state(), true_records(self.all)
        return (f"only indexed {sorted(s.records - truth)[:5]}, only held {sorted(truth - s.records)[:5]}, "
                f"stray members {s.others}, {s.dead_holders} retired holders, "
                f"{len(layouts_match(self.client, self.all, self.prompts))} prompts answered wrong; "
                f"sidecar: {self.sidecar.lines('failover')}")

    def check_healed(self, killed: float, http: Lookups) -> None:
        """After a failover at ``killed``: the sidecar rewrote its journal, every 0.5-era engine
        full-synced after the kill, no engine saw an error, no answer was wrong."""
        assert self.sidecar.lines("failover: wrote the ops"), "the sidecar did not see the master replaced"
        for e in self.all:
            assert not e.errors, e.errors
            if e.era == "0.5" and e.heartbeat_s is not None:
                assert any(t > killed for t in e.syncs), f"{e.instance_id} was not asked for a full sync"
        assert not self.static_wrong() and not self.static_wrong(http)  # lookups failed or waited, never lied
        assert self.state().records == true_records(self.all)
        assert layouts_match(self.client, self.all, self.prompts) == []
        assert layouts_match(http.client, self.all, self.prompts) == []

    def fail_over(self, name: str, deployment, victim, replica, promoted: Callable[[], bool],
                  http: Lookups) -> dict:
        """The failover both tests run, with lookups in-process and through ``http``: the
        replica is stopped and its link cut, so what the master acknowledges next (the
        :meth:`lag_window` traffic) reaches only the master; then kill -9 of the master, the
        replica thawed, ``promoted()`` awaited, 4 s more ingest, and the index must converge
        exactly. Asserts the lookups were answered again within 10 s and :meth:`check_healed`;
        prints the measured numbers under ``name`` and returns them. deployment: LocalCluster or
        LocalSentinel."""
        self.hold_private()
        self.lookups.start()
        http.start()
        time.sleep(3)  # steady ingest and lookups
        deployment.freeze(replica)
        victim.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
        offset = victim.client().info("replication")["master_repl_offset"]
        late3 = self.lag_window()
        time.sleep(0.5)
        lost_bytes = victim.client().info("replication")["master_repl_offset"] - offset
        killed = time.monotonic()
        deployment.kill(victim)
        deployment.thaw(replica)
        took = wait_until(promoted, 20, every=0.05)
        assert took is not None, "the replica was not promoted"
        late3.start()
        time.sleep(4)  # ingest goes on after the failover
        stopped, converged = self.converge()
        self.lookups.stop()
        http.stop()
        out, out_http = self.lookups.outage(killed), http.outage(killed)
        assert converged is not None, f"index did not converge: {self.why_not()}"
        numbers = dict(lost_replication_bytes=lost_bytes, promoted_after_s=took, converged_after_stop_s=converged,
                       converged_after_kill_s=stopped + converged - killed, records=len(self.state().records),
                       ops=sum(e.ops for e in self.all), full_syncs=sum(len(e.syncs) for e in self.all))
        report(name, **numbers)
        report(f"{name}, Client", **out)
        report(f"{name}, controller HTTP", **out_http)
        assert lost_bytes > 0  # writes were acknowledged that the promoted replica never saw
        for o in (out, out_http):
            assert o["first_answer_after_s"] is not None and o["first_answer_after_s"] < 10
            assert o["failing_to_succeeding_s"] is None or o["failing_to_succeeding_s"] < 10
            assert o["longest_without_answer_s"] < 10
        self.check_healed(killed, http)
        return numbers

def report(name: str, **numbers) -> None:
    """Print measured numbers on one line (pytest -s shows them)."""
    print(f"\n[{name}] " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in numbers.items()))
