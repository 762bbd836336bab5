"""The LMCache drop-in deployment that tests/faults/test_faults.py injects faults into.

As shipped by default: ``kvlookup controller --monitor-ports`` (embedded Redis in its own data
dir, embedded sidecar, 2 gunicorn workers, ``--instance-ttl 5``) and one standalone ``kvlookup
sidecar`` sharing that embedded Redis. Engines (tests.support.engines.Engine, the real protocol):
0.5-era engines heartbeating every 0.5 s and obeying full syncs, spread over both sidecars, with
steady random stores and evicts (:class:`Traffic`); quiet 0.3-era engines registered with chunks
and then silent. Lookups POST /lookup every 20 ms. :meth:`Deployment.converge` asserts EXACT
convergence: the chunk sorted sets hold what the engines hold, every known prompt's lookup is
what the engines' truth implies, and the quiet instances kept every record.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import requests
import zmq

from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.redis_server import connect, free_port, port_free
from kvlookup.wire import lmcache as proto
from tests.support.engines import CPU, Engine, RandomOps, Traffic, matched
from tests.support.figures import Figures
from tests.support.helpers import index_view, until
from tests.support.lookups import Answer, Lookups
from tests.support.procs import ControllerProc, SidecarProc
from tests.support.procs_embedded import servers_of

PROFILE = HashProfile(chunk_size=1)  # the controller runs --chunk-size 1: one token, one chunk
TTL_S = 5
HEARTBEAT_S = 0.5
LOOKUP_EVERY_S = 0.02
DEALER_TIMEOUT_MS = 3000
BACKLOG_OPS = 5_000  # a sidecar write slice (sockets.Limits.slice_ops): steady traffic stays below
FIGURES = Figures("faults")
record = FIGURES.record


def dropin_controller(data_dir: Path, pull: int, reply: int, log: Path) -> ControllerProc:
    """``kvlookup controller`` in LMCache drop-in mode (not started); output in ``log``; its
    ``ports``: HTTP, PULL, ROUTER. Its stop is SIGTERM to the master (``kill PID``): the whole
    process group would stop the embedded sidecar first, not last (docs/operations.md, "Fault
    injection: measured")."""
    c = ControllerProc("--monitor-ports", json.dumps({"pull": pull, "reply": reply}), "--workers", "2",
                       "--data-dir", str(data_dir), "--instance-ttl", str(TTL_S), "--chunk-size", "1",
                       log=log, start=False, sigterm_master=True)
    c.ports = (c.port, pull, reply)
    return c


def standalone_sidecar(data_dir: Path, log: Path) -> SidecarProc:
    """The standalone ``kvlookup sidecar`` (not started), sharing the controller's embedded Redis
    (same data dir); output in ``log``."""
    return SidecarProc("--data-dir", str(data_dir), "--instance-ttl", str(TTL_S),
                       pull_url=f"127.0.0.1:{free_port()}", reply_url=f"127.0.0.1:{free_port()}", log=log)


def health_summary(c: ControllerProc) -> tuple[int, int | None, int | None, str | None]:
    """(status, embedded Redis server pid, embedded sidecar pid, its state) of GET /health."""
    status, body = c.health()
    comps = body.get("components", {})
    sc = comps.get("embedded_sidecar", {})
    return status, comps.get("redis", {}).get("server_pid"), sc.get("pid"), sc.get("state")


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


class Deployment:
    """The controller, the standalone sidecar, the engines, traffic and lookups, under ``tmp``."""

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
        self.controller = dropin_controller(self.data, free_port(), free_port(), tmp / "controller.log")
        self.sidecar = standalone_sidecar(self.data, tmp / "sidecar.log")
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
            e.start()
        self.traffic = Traffic(self.active, RandomOps(self.chains, seed=3, admit_p=0.5, max_evict=12))
        self.lookups = Lookups(self.controller.http + "/lookup", self.prompts, seed=5, pace_s=LOOKUP_EVERY_S)
        self.traffic.start()
        self.lookups.start()
        self.converge("start")
        self.quiet_before = self.quiet_records()
        assert all(n == sum(len(c) for c in chains) for (_h, n), (_u, chains) in
                   zip(self.quiet_before.values(), holds, strict=True)), self.quiet_before

    def engine(self, name: str, era: str, urls: tuple[str, str]) -> Engine:
        e = Engine(name, era, urls[0], urls[1], profile=PROFILE, ctx=self.ctx, heartbeat_s=HEARTBEAT_S,
                   pace_s=HEARTBEAT_S, dealer_timeout_ms=DEALER_TIMEOUT_MS)
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
        # what a failed scenario left queued is written first (test 7's maximal frame: 466k ops,
        # tens of seconds on a loaded box), so the next scenario does not time out behind it
        until(lambda: self._sidecar_backlog() < BACKLOG_OPS, 180, step=0.2)

    def _sidecar_backlog(self) -> int:
        """Ops the standalone sidecar has queued and not written (its /health); a large number
        while it does not answer."""
        try:
            return int(self.sidecar.health()["components"]["loop"]["queued_ops"])
        except (requests.RequestException, ValueError, KeyError):
            return 1 << 62

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
        return [i for i, p in enumerate(self.prompts) if self.controller.layout_or_none(p) != self.expected(i)]

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
                if a.got.get(q.name) != ([CPU, n] if n else None):
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
        return (sum(m not in current for ms in members for m in keys.holders_of(ms))
                + self.r.zcard(keys.dead_holders_key()))

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
