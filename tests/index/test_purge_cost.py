"""Issue 20 item 9: purging a retired holder costs what it holds.

Purge used to read all 2048 reverse-index buckets of every holder (8,000 one-record holders took
~2 min); now it reads the buckets its bucket set (keys.holder_buckets_key) names, and sweeps all
of them only when the record count says records remain outside those (written by an older
kvlookup). Commands are counted on the real Redis with ``INFO commandstats`` deltas (commands
scripts run count too), on every master of a cluster.
"""

from __future__ import annotations

from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, Store

CPU = "LocalCPUBackend"
HASHES = HashProfile(chunk_size=1).chunk_hashes(list(range(300)))


def _commands(r) -> int:
    """Commands every master ran so far (INFO itself included)."""
    nodes = r.get_primaries() if hasattr(r, "get_primaries") else [None]
    total = 0
    for node in nodes:
        info = r.info("commandstats", **({"target_nodes": node} if node else {}))
        if node is not None and len(info) == 1 and isinstance(only := next(iter(info.values())), dict):
            info = only  # a cluster answers {node name: info}
        total += sum(int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_"))
    return total


def _retired_holder(r, store: Store, hashes: list[int]) -> str:
    store.register_worker("inst", 0)
    store.apply([("inst", 0, CPU, [(ADMIT, h) for h in hashes])])
    hid = r.hget(keys.worker_key("inst", 0), f"loc:{CPU}")
    store.register_worker("inst", 0)  # a new epoch: the old holder is retired
    return hid


def _purge_cost(r, store: Store) -> tuple[int, int]:
    before = _commands(r)
    removed = store.purge()
    return removed, _commands(r) - before - _info_calls(r)


def _info_calls(r) -> int:
    return len(r.get_primaries()) if hasattr(r, "get_primaries") else 1


def test_one_record_holder_costs_a_few_commands(r):
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    hid = _retired_holder(r, store, HASHES[:1])
    assert r.smembers(keys.holder_buckets_key(hid)) == {str(keys.chunk_bucket(HASHES[0]))}
    removed, cost = _purge_cost(r, store)
    assert removed == 1
    print(f"purge of a one-record holder: {cost} commands")
    assert cost <= 32, cost  # 2048 bucket reads (32 pipelines of 64) and more before
    assert r.exists(keys.chunk_key(HASHES[0]), keys.holder_buckets_key(hid)) == 0
    assert r.hget(keys.holders_key(), hid) is None and r.zcard(keys.dead_holders_key()) == 0
    assert _purge_cost(r, store) == (0, 1)  # nothing left: one ZRANGEBYSCORE finds no retired holder


def test_cost_grows_with_the_buckets_held(r):
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    _retired_holder(r, store, HASHES)
    buckets = len({keys.chunk_bucket(h) for h in HASHES})
    removed, cost = _purge_cost(r, store)
    assert removed == len(HASHES)
    # a read and a removal a bucket; a record: CHUNK_OP (EVALSHA, its ZREM, the ZCARD that keeps the digest)
    assert cost <= 2 * buckets + 3 * len(HASHES) + 20, (cost, buckets)
    assert all(r.exists(keys.chunk_key(h)) == 0 for h in HASHES)


def test_records_outside_the_bucket_set_are_swept(r):
    """Records an older kvlookup wrote (no bucket set): the record count sends purge through
    every bucket, and nothing leaks."""
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    hid = _retired_holder(r, store, HASHES[:40])
    r.delete(keys.holder_buckets_key(hid))
    assert store.purge() == 40
    assert all(r.exists(keys.chunk_key(h)) == 0 for h in HASHES[:40])
    assert r.hget(keys.holders_key(), hid) is None and r.hget(keys.records_key(), hid) is None
