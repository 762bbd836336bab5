"""redis+sentinel:// URLs: parsing, and every kvlookup process on a real Sentinel-managed master
(one replica, three Sentinels) through a kill -9 of the master during ingest."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import redis
import requests

from kvlookup.client import Client
from kvlookup.devtools.local_sentinel import LocalSentinel
from kvlookup.proc.redis_server import connect
from kvlookup.proc.redis_urls import BlockingSentinelConnectionPool, SentinelURL, parse_sentinel
from tests.support.ha_fleet import Fleet, close_sentinel_fleet
from tests.support.lookups import HttpClient, Lookups
from tests.support.procs import ROOT, ControllerProc


def test_sentinel_urls_parse():
    assert parse_sentinel("redis+sentinel://10.0.0.1:26379,[::1]:26380/idx/2?sentinel_password=s%20p") == SentinelURL(
        (("10.0.0.1", 26379), ("::1", 26380)), "idx", 2, None, None, "s p", False)
    assert parse_sentinel("rediss+sentinel://u:p%40ss@h:1/m") == SentinelURL((("h", 1),), "m", 0, "u", "p@ss", None,
                                                                              True)
    assert parse_sentinel("redis+sentinel://:pw@h:1/m?ssl=true").password == "pw"
    for bad in ("redis://h:1/m", "redis+sentinel://h/m", "redis+sentinel://h:1", "redis+sentinel://h:1/m/x",
                "redis+sentinel://h:1,:2/m"):
        with pytest.raises(ValueError):
            parse_sentinel(bad)


@pytest.fixture()
def sentinel(tmp_path):
    s = LocalSentinel(tmp_path / "sentinel", replicas=1, sentinels=3, down_after_ms=1000)
    s.start()
    yield s
    s.stop()


def test_bounded_pool_waits_for_a_free_connection(sentinel):
    r = connect(sentinel.url, max_connections=1, socket_timeout=5)
    assert isinstance(r.connection_pool, BlockingSentinelConnectionPool)
    assert r.ping() and r.connection_pool.master_address == ("127.0.0.1", sentinel.master().port)
    held = r.connection_pool.get_connection()
    threading.Timer(0.3, r.connection_pool.release, (held,)).start()
    t0 = time.monotonic()
    assert r.set("k", "v")  # waits for the one connection instead of failing at once
    assert time.monotonic() - t0 >= 0.25


def test_master_kill9_during_ingest_fails_over_and_converges_exactly(sentinel, tmp_path):
    registry = connect(sentinel.url, socket_timeout=5)
    controller = ControllerProc("--redis-url", sentinel.url, "--workers", "1").wait_ready()
    f = Fleet(["--redis-url", sentinel.url], Client(sentinel.url), registry,
              lambda: [sentinel.master().client()], tmp_path, seed=21)
    http = Lookups(HttpClient(controller), f.prompts, seed=8, pace_s=0.02)
    try:
        victim = sentinel.master()
        (replica,) = [n for n in sentinel.data if n is not victim]
        f.fail_over("sentinel failover", sentinel, victim, replica, lambda: sentinel.master() is replica, http)
        reap = subprocess.run([sys.executable, "-m", "kvlookup", "reap", "--redis-url", sentinel.url],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert reap.returncode == 0, reap.stderr
        assert json.loads(reap.stdout.splitlines()[-1]) == {"reaped": [], "purged": 0}
    finally:
        close_sentinel_fleet(http, f, controller, registry)  # the fixture stops the Sentinel deployment


@pytest.mark.parametrize("reader", ["uncached", "cached", "controller"])
def test_frozen_master_failed_over_copies_do_not_answer(sentinel, reader):
    """The Sentinel-managed master frozen (SIGSTOP: sockets open, no EOF) and failed over to its
    replica; a writer evicts a chunk on the new master. A reader (in process with the
    controller's socket_timeout 5, cache off or on; or the controller itself over HTTP) must see
    the eviction, not answer from copies of the frozen master, and soon."""
    from kvlookup.index.store import ADMIT, EVICT, Store
    from tests.support.engines import CPU
    from tests.support.figures import report
    from tests.support.ha_fleet import PROFILE, make_prompts

    writer = Store(connect(sentinel.url, socket_timeout=5), purge_grace_s=0)
    prompt = make_prompts(seed=7, n=1)[0]
    chain = PROFILE.chunk_hashes(prompt)
    writer.register_worker("a", 0)
    writer.touch_instance("a")
    writer.apply([("a", 0, CPU, [(ADMIT, h) for h in chain])])
    controller = ControllerProc("--redis-url", sentinel.url, "--workers", "1").wait_ready() \
        if reader == "controller" else None
    unavailable = []
    if controller is not None:
        def answer():  # as a router does, it asks again after a 503 (the lookup that met the hung master)
            for _ in range(3):
                try:
                    return sorted((inst, loc, n) for inst, (loc, n) in controller.layout(prompt).items())
                except requests.HTTPError as exc:
                    assert exc.response.status_code == 503, exc
                    unavailable.append(exc.response.json()["error"])
            raise AssertionError(f"three 503s in a row: {unavailable}")
    else:
        store = Store(connect(sentinel.url, socket_timeout=5), purge_grace_s=0, cache_reads=reader == "cached")
        client = Client(store=store)

        def answer():
            return [(m.instance_id, m.location, m.matched_prefix_length) for m in client.matches(prompt)]

    try:
        assert answer() == answer() == [("a", CPU, len(prompt))]
        victim = sentinel.master()
        sentinel.freeze(victim)
        try:
            deadline = time.monotonic() + 30
            while sentinel.master() is victim:
                assert time.monotonic() < deadline, "the Sentinels did not fail over"
                time.sleep(0.2)
            while True:  # as a sidecar does: its first write may wait out the frozen master's socket
                try:
                    writer.apply([("a", 0, CPU, [(EVICT, chain[1])])])
                    break
                except redis.RedisError:
                    assert time.monotonic() < deadline, "the writer never reached the new master"
            writer.touch_instance("a")
            t0 = time.monotonic()
            got = [answer() for _ in range(3)]
            answered_s = time.monotonic() - t0
        finally:
            sentinel.thaw(victim)
    finally:
        if controller is not None:
            controller.stop()
    report("sentinel frozen master", reader=reader, three_answers_s=answered_s, unavailable=len(unavailable))
    assert got == [[("a", CPU, PROFILE.chunk_size)]] * 3
    # over HTTP the lookup that met the hung master waits out its socket timeout and is a 503
    # ("index unavailable"); measured 1 such answer, 10.1 s for the three
    assert len(unavailable) <= 1
