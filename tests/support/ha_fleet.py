"""A small LMCache fleet for the failover tests (Redis Cluster and Sentinel).

A real sidecar process (tests.support.procs.SidecarProc); simulated engines of both protocol
eras (tests.support.engines.Engine), each in its own thread, that keep their true state (the
chunks they hold) while they admit and evict, answer heartbeats and run the full syncs they are
asked for, in order, as one engine would; steady lookups that record every answer
(tests.support.lookups.Lookups); and exact comparisons of the index with the engines' truth,
through lookups and through the chunk sorted sets themselves.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port
from tests.support.engines import CPU, Engine, RandomOps, matched
from tests.support.figures import report
from tests.support.helpers import wait_until
from tests.support.lookups import Lookups
from tests.support.procs import SidecarProc

PROFILE = HashProfile()  # 256-token chunks


def make_prompts(seed: int, n: int = 24) -> list[list[int]]:
    """``n`` prompts of 3-8 chunks; each starts with one of three 2-chunk system prompts, as
    chat traffic does (their first chunks are the fleet's hottest keys)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 128_000) for _ in range(2 * PROFILE.chunk_size)] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(1, 128_000) for _ in range(rng.randint(1, 6) * PROFILE.chunk_size)]
            for _ in range(n)]


def fleet_engine(name: str, era: str, sidecar: SidecarProc, prompts: list[list[int]], seed: int, *,
                 static: bool = False, heartbeat_s: float | None = 0.3) -> Engine:
    """One engine of the fleet (one worker, LocalCPUBackend) with its true state.

    era "0.5" engines heartbeat every ``heartbeat_s`` (None: never, LMCache 0.5.6's default)
    and, on a ``full_sync`` command, send every chunk
    they hold (retrying a start that is not accepted, as LMCache does); "0.3" engines only admit
    and evict. ``static`` engines admit once and then only heartbeat. Random evictions take only
    chunks of ``prompts``, so chunks admitted by :meth:`Engine.do` stay as they were left. A
    request unanswered for 60 s is an error (a sidecar waiting out a failover answers late).
    """
    ops = None if static else RandomOps([PROFILE.chunk_hashes(p) for p in prompts], seed, admit_p=0.6, max_evict=3)
    return Engine(name, era, sidecar.pull_url, sidecar.reply_url, profile=PROFILE, ops=ops, heartbeat_s=heartbeat_s,
                  pace_s=0.02, dealer_timeout_ms=60_000, redial=False)


def expected_layout(engines: Sequence[Engine], tokens: list[int]) -> dict:
    """What a lookup of ``tokens`` must answer for ``engines``' true state (one worker each,
    LocalCPUBackend): instance -> (location, tokens of its longest run of chunks from 0)."""
    chain = PROFILE.chunk_hashes(tokens)
    out = {}
    for e in engines:
        n = matched(chain, e.held)
        if n:
            out[e.name] = (CPU, min(n * PROFILE.chunk_size, len(tokens)))
    return out


def true_records(engines: Sequence[Engine]) -> set[tuple[str, str, str]]:
    """(chunk hash, instance, location) for every chunk every engine holds."""
    return {(str(c), e.name, CPU) for e in engines for c in e.held}


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
            for hid in keys.holders_of(node.zrange(key, 0, -1)):
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
        self.sidecar = SidecarProc(*redis_args, "--instance-ttl", "30", "--log-level", "INFO",
                                   pull_url=f"127.0.0.1:{free_port()}", reply_url=f"127.0.0.1:{free_port()}",
                                   log=tmp_path / "sidecar.log").start()
        self.rc, self.client, self._masters = registry, client, masters
        self.engines = [fleet_engine(f"e5-{i}", "0.5", self.sidecar, self.prompts, seed + i, heartbeat_s=heartbeat_s)
                        for i in range(3)]
        self.engines += [fleet_engine(f"e3-{i}", "0.3", self.sidecar, self.prompts, seed + 10 + i) for i in range(2)]
        self.static = fleet_engine("static", "0.3", self.sidecar, self.prompts, seed + 20, static=True)
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
        return index_state(self.rc, self._masters, [e.name for e in self.all])

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
        late5 = fleet_engine("late5", "0.5", self.sidecar, self.prompts, 77, heartbeat_s=self.heartbeat_s).start_engine(
            PROFILE.chunk_hashes(self.late_prompt))
        late3 = fleet_engine("late3", "0.3", self.sidecar, self.prompts, 78)
        late3.register()
        self.all += [late5, late3]
        self.engines += [late5, late3]
        return late3

    def converge(self, timeout: float = 45.0) -> tuple[float, float | None]:
        """Stop the engines and wait for :meth:`converged`; returns (when stopped, seconds)."""
        self.stop_engines()
        stopped = time.monotonic()
        return stopped, wait_until(self.converged, timeout, every=0.2)

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
                assert e.synced_since(killed), f"{e.name} was not asked for a full sync"
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


def close_sentinel_fleet(lookups, fleet: Fleet, controller, registry: redis.Redis, sentinel=None) -> None:
    """Tear down a Sentinel fleet test: its lookups, engines and sidecars, the controller, the
    registry client (its master may be the killed one) and, when given, the Sentinel deployment."""
    lookups.stop_event.set()
    fleet.close()
    controller.stop()
    try:
        registry.close()
    except redis.RedisError:
        pass
    if sentinel is not None:
        sentinel.stop()
