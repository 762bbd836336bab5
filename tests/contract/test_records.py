"""The Records contract: what every backend of kvlookup.index.records.Records must do.

Runs against every backend the fixtures provide (one Redis, plain and with cached reads; a real
3-master Redis Cluster). A third backend starts here: make ``store`` build it and these, with
the rest of tests/contract, must pass unchanged. Holders are made through the registry
(``Store.holder_id``), which is the same on every deployment.
"""

from __future__ import annotations

from kvlookup.index import keys
from kvlookup.index.records import Chain, HolderWrite

CHUNK = 4


def _holder(store, instance: str, worker: int = 0, location: str = "LocalCPUBackend") -> str:
    store.register_worker(instance, worker, "127.0.0.1", 8000 + worker)
    return store.holder_id(instance, worker, location)


def _chain(hashes) -> Chain:
    return Chain(keys.chunk_prefix(), [str(h) for h in hashes], CHUNK, CHUNK * len(hashes))


def test_apply_then_holders_is_a_point_lookup(store):
    a, b = _holder(store, "pod-a"), _holder(store, "pod-b")
    rec = store.records
    assert rec.apply([HolderWrite(a, "", ["11", "12"], []), HolderWrite(b, "", ["12"], [])], 1000) == [True, True]
    got = rec.holders([keys.chunk_prefix() + h for h in ("11", "12", "13")])
    assert [sorted(g) for g in got] == [[a], sorted([a, b]), []]


def test_evicts_leave_the_point_lookup(store):
    a = _holder(store, "pod-a")
    rec = store.records
    rec.apply([HolderWrite(a, "", ["11", "12"], [])], 1000)
    rec.apply([HolderWrite(a, "", [], ["11"])], 1001)
    assert rec.holders([keys.chunk_prefix() + "11", keys.chunk_prefix() + "12"]) == [[], [a]]


def test_lookup_returns_matches_with_lengths_and_locations(store):
    a, b = _holder(store, "pod-a"), _holder(store, "pod-b")
    rec = store.records
    rec.apply([HolderWrite(a, "", ["1", "2", "3"], []), HolderWrite(b, "", ["1"], [])], 1000)
    found = rec.lookup([_chain([1, 2, 3])], store.liveness())
    assert type(found).__name__ == "Matches"
    assert sorted((m.instance_id, m.matched_prefix_length, m.locations) for m in found) == [
        ("pod-a", 12, {"LocalCPUBackend": 12}), ("pod-b", 4, {"LocalCPUBackend": 4})]


def test_a_retired_holder_is_refused_and_purged(store, cluster):
    a = _holder(store, "pod-a")
    rec = store.records
    rec.apply([HolderWrite(a, "", ["1", "2"], [])], 1000)
    store.register_worker("pod-a", 0, "127.0.0.1", 8000)  # a new epoch retires the holder
    assert rec.apply([HolderWrite(a, "", ["3"], [])], 1001) == [False]
    removed, bucket = 0, 0
    while bucket < keys.HOLDER_CHUNK_BUCKETS:
        n, bucket = rec.purge_step(a, "", bucket, 1000)
        removed += n
    # a cluster's write is not atomic: the refused write's record is there until the purge
    assert removed == (3 if cluster else 2)
    assert rec.holders([keys.chunk_prefix() + h for h in ("1", "2", "3")]) == [[], [], []]


def test_io_runs_single_key_commands_and_scripts(store):
    io = store.records.io
    key = keys.chunk_prefix() + "99"
    sha = io.register("return redis.call('ZCARD', KEYS[1]) + 7")
    added, card, score = io.execute([("ZADD", key, 5, "h1"), ("EVALSHA", sha, 1, key), ("ZSCORE", key, "h1")])
    assert (added, card, float(score)) == (1, 8, 5.0)  # a score comes as text or a number: parse it


def test_reads_locally_says_whether_lookups_skip_redis(store, cluster):
    cached = store.records.reads_locally()
    assert cached is False if cluster or not getattr(store.records, "cached", None) else isinstance(cached, bool)
