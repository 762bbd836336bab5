"""Liveness, reaping and epochs: exact lookups before and after, on a real Redis."""

from __future__ import annotations

import time

import pytest

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.index.fleet import reap
from kvlookup.index.store import Store
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import SidecarThread, chunk_holders, wait_for

CPU = "LocalCPUBackend"
HIT = (CPU, 12)


def _admit(store: Store, inst: str, wid: int = 0, h: int = SEED_HASH) -> None:
    store.apply([(inst, wid, CPU, [("a", h)])])


def test_silent_instance_is_excluded_at_once_then_reaped_and_purged(r):
    store = Store(r, instance_ttl_s=2, purge_grace_s=0)  # a's renewed lease outlives a slow turn
    client = Client(store=store)
    for inst in ("a", "b"):
        store.register_worker(inst, 0, "127.0.0.1", 8001 if inst == "a" else 8002)
        _admit(store, inst)
    assert client.lookup(SEED_TOKENS)[1] == {"a": HIT, "b": HIT}
    time.sleep(1.2)
    store.touch_instance("a")  # b's sidecar stopped renewing its lease
    time.sleep(1.0)
    assert client.lookup(SEED_TOKENS)[1] == {"a": HIT}  # excluded the moment its lease ran out
    assert reap(store) == [("b", 0)]
    assert wait_for(store.purge, 1, timeout=2) == 1  # retired on Redis's clock, judged on its estimate
    assert r.zrange(keys.chunk_key(SEED_HASH), 0, -1) == ["1"]
    assert r.smembers(keys.instances_key()) == {"a"}
    assert r.smembers(keys.ip_index_key("127.0.0.1")) == {"8001:a"}
    assert reap(store) == []
    assert client.lookup(SEED_TOKENS)[1] == {"a": HIT}


def test_stale_heartbeats_reap_the_worker_but_a_silent_non_heartbeating_one_stays(r):
    store = Store(r, instance_ttl_s=30, worker_ttl_s=1.0, purge_grace_s=0)
    client = Client(store=store)
    now = time.time()
    store.register_worker("hb", 0, now=now - 10)
    store.register_worker("quiet", 0, now=now - 10)  # never heartbeats (LMCache's default)
    _admit(store, "hb")
    _admit(store, "quiet")
    store.heartbeat_worker("hb", 0, now=now - 5)
    assert client.lookup(SEED_TOKENS)[1] == {"quiet": HIT}  # excluded at once
    assert reap(store, now=now) == [("hb", 0)]
    assert not store.is_registered("hb", 0) and store.is_registered("quiet", 0)
    assert wait_for(store.purge, 1, timeout=2) == 1  # retired on Redis's clock, judged on its estimate
    store.register_worker("hb", 0)  # it comes back: a new epoch, nothing old counts
    store.heartbeat_worker("hb", 0)
    assert reap(store) == []
    assert client.lookup(SEED_TOKENS)[1] == {"quiet": HIT}


def test_reregistration_starts_a_new_epoch(r):
    store = Store(r, purge_grace_s=0)
    client = Client(store=store)
    assert store.register_worker("i", 0) == 1
    store.register_worker("i", 1)
    _admit(store, "i", 0)
    _admit(store, "i", 1)
    assert client.lookup(SEED_TOKENS)[1] == {"i": HIT}
    assert store.register_worker("i", 0) == 2  # rank 0's engine restarted with a cold cache
    assert client.lookup(SEED_TOKENS)[1] == {}
    assert r.hget(keys.worker_key("i", 0), "epoch") == "2"
    assert wait_for(store.purge, 1, timeout=2) == 1  # retired on Redis's clock, judged on its estimate
    assert len(chunk_holders(r, keys.chunk_key(SEED_HASH))) == 1
    _admit(store, "i", 0)
    assert client.lookup(SEED_TOKENS)[1] == {"i": HIT}


def test_deregistering_one_instance_never_touches_another_on_the_same_host(r):
    store = Store(r, purge_grace_s=0)
    client = Client(store=store)
    for inst, port in (("llama-a", 8001), ("llama-b", 8002)):  # same model, same host
        store.register_worker(inst, 0, "10.0.0.1", port)
        store.register_worker(inst, 1, "10.0.0.1", port + 100)
        for wid in (0, 1):
            _admit(store, inst, wid)
    before_b = {w: r.hgetall(keys.worker_key("llama-b", w)) for w in (0, 1)}
    store.deregister_worker("llama-a", 0)  # the remaining registered rank still holds the chunk
    assert client.lookup(SEED_TOKENS)[1] == {"llama-a": HIT, "llama-b": HIT}
    store.deregister_worker("llama-a", 1)
    store.purge()
    assert client.lookup(SEED_TOKENS)[1] == {"llama-b": HIT}
    assert {w: r.hgetall(keys.worker_key("llama-b", w)) for w in (0, 1)} == before_b
    assert r.smembers(keys.ip_index_key("10.0.0.1")) == {"8002:llama-b", "8102:llama-b"}
    assert r.smembers(keys.instances_key()) == {"llama-b"}
    assert len(chunk_holders(r, keys.chunk_key(SEED_HASH))) == 2


@pytest.fixture()
def short_store(r):
    return Store(r, instance_ttl_s=0.6, worker_ttl_s=0.6, purge_grace_s=0)


def test_sidecar_reaps_an_instance_whose_sidecar_died(r, short_store):
    client = Client(store=short_store)
    orphan = Store(r, instance_ttl_s=0.6)  # stands for another sidecar that then dies
    orphan.register_worker("orphan", 0)
    _admit(orphan, "orphan")
    with SidecarThread(short_store) as sc:
        w = WorkerSim("kept", era="0.3", pull_url=sc.pull_url)
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: short_store.is_registered("orphan", 0), False) is False
        assert wait_for(lambda: r.hexists(keys.holders_key(), "1"), False) is False
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"kept": HIT}) == {"kept": HIT}
        time.sleep(1.0)  # longer than both TTLs: the live sidecar keeps its (never-heartbeating) worker
        assert client.lookup(SEED_TOKENS)[1] == {"kept": HIT}
        assert short_store.is_registered("kept", 0)
        w.close()


def test_worker_whose_heartbeats_stop_is_reaped_and_resyncs_on_return(r, short_store):
    client = Client(store=short_store)
    with SidecarThread(short_store) as sc:
        w = WorkerSim("i", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        w.register()
        assert w.heartbeat() == {"type": "HeartbeatRetMsg", "commands": []}
        w.admit([SEED_HASH])
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"i": HIT}) == {"i": HIT}
        assert wait_for(lambda: short_store.is_registered("i", 0), False) is False  # heartbeats stopped
        assert client.lookup(SEED_TOKENS)[1] == {}
        reply = w.heartbeat()
        assert reply["commands"] == [
            {"command_type": "full_sync", "reason": "worker_re_registered", "args": None}
        ]
        start, status = w.full_sync([SEED_HASH])
        assert start["accepted"] is True and status["can_exit_freeze"] is True
        assert w.heartbeat() == {"type": "HeartbeatRetMsg", "commands": []}
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"i": HIT}) == {"i": HIT}
        w.close()
