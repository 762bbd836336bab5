"""Issue 18 item 1: a chunk set's digest member (keys.CHUNK_DIGEST_MEMBER) lets both walks — the
staged reads of one Redis (``lookup_cache: off``) and of a cluster — read a chunk's members
only where the holder set changes, so a prompt held by many instances costs O(chunks + holders),
not chunks x holders.

The digest is kept by every write of a chunk set (APPLY_OPS, CHUNK_OP: cluster writes, purge on
both backends); tests/contract/test_store.py checks it after random op sequences on every
backend (tests.support.helpers.chunk_holders). Here: the walks' answers across digest changes,
sets written before digests, purge, and what a 64-holder lookup reads.
"""

from __future__ import annotations

from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, Chain, Store
from tests.support.helpers import chunk_holders, command_calls

CPU = "LocalCPUBackend"
CHUNK = 4
HASHES = [str(h) for h in HashProfile(chunk_size=CHUNK).chunk_hashes(list(range(8 * CHUNK)))]


def _fresh(r) -> None:
    for node in r.get_primaries() if hasattr(r, "get_primaries") else [None]:
        (node.redis_connection if node else r).flushdb()


def _layout(store: Store, n_chunks: int = 8) -> dict[str, int]:
    chain = Chain(keys.chunk_prefix(), HASHES[:n_chunks], CHUNK, n_chunks * CHUNK)
    return {m.instance_id: m.matched_prefix_length for m in store.lookup([chain])}


def _hold(store: Store, inst: str, upto: int) -> None:
    store.register_worker(inst, 0)
    store.apply([(inst, 0, CPU, [(ADMIT, int(h)) for h in HASHES[:upto]])])


def test_walks_follow_every_change_of_the_holder_set(r, store):
    """20 instances: 12 hold 8 chunks, 8 hold 3; then some leave and come back. Each lookup (the
    second one walks with every digest known) is exact."""
    _fresh(r)
    for i in range(20):
        _hold(store, f"i{i}", 8 if i < 12 else 3)
    want = {f"i{i}": (32 if i < 12 else 12) for i in range(20)}
    assert _layout(store) == want
    assert _layout(store) == want
    store.apply([("i0", 0, CPU, [(EVICT, int(HASHES[5]))]), ("i13", 0, CPU, [(ADMIT, int(HASHES[3]))])])
    want |= {"i0": 20, "i13": 16}
    assert _layout(store) == want
    store.apply([("i0", 0, CPU, [(ADMIT, int(HASHES[5]))])])
    assert _layout(store) == want | {"i0": 32}
    assert all(len(chunk_holders(r, keys.chunk_key(h))) in (12, 13) for h in HASHES[3:])


def test_a_set_down_to_one_holder_drops_its_digest(r, store):
    _fresh(r)
    _hold(store, "a", 2)
    _hold(store, "b", 2)
    key = keys.chunk_key(HASHES[0])
    assert r.zrange(key, 0, 0) == [keys.CHUNK_DIGEST_MEMBER]
    store.apply([("b", 0, CPU, [(EVICT, int(HASHES[0]))])])
    assert chunk_holders(r, key) == {store.holder_id("a", 0, CPU)}
    assert r.zcard(key) == 1
    assert _layout(store, 2) == {"a": 8}


def test_purge_keeps_the_digest(r):
    _fresh(r)
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    for inst in ("a", "b", "c"):
        _hold(store, inst, 4)
    store.register_worker("b", 0)  # a new epoch retires b's holder
    assert store.purge() == 4
    live = {store.holder_id("a", 0, CPU), store.holder_id("c", 0, CPU)}
    assert all(chunk_holders(r, keys.chunk_key(h)) == live for h in HASHES[:4])
    assert _layout(store, 4) == {"a": 16, "c": 16}


def test_sets_written_before_digests_are_read_in_full_then_summed(r, store):
    """Records of an older kvlookup (plain ZADD, no digest): every walk reads them in full; the
    next write of the set sums it once."""
    _fresh(r)
    hids = []
    for inst in ("a", "b", "c"):
        store.register_worker(inst, 0)
        hids.append(store.holder_id(inst, 0, CPU))
    for h in HASHES[:4]:
        r.zadd(keys.chunk_key(h), dict.fromkeys(hids, 1000))
    assert _layout(store, 4) == {"a": 16, "b": 16, "c": 16}
    store.apply([("a", 0, CPU, [(ADMIT, int(HASHES[4]))]), ("b", 0, CPU, [(EVICT, int(HASHES[1]))])])
    assert chunk_holders(r, keys.chunk_key(HASHES[1])) == {hids[0], hids[2]}
    assert r.zrange(keys.chunk_key(HASHES[0]), 0, -1) == sorted(hids)  # untouched: still no digest
    assert _layout(store, 5) == {"a": 20, "b": 4, "c": 16}


def test_a_shared_prefix_costs_a_digest_a_chunk(r, store, cluster):
    """64 instances hold 8 chunks: once digests and holders are known, an uncached lookup (one
    Redis with ``lookup_cache: off``: CHUNK_HEADS; a cluster) reads each chunk's digest (``ZRANGE
    key 0 1 WITHSCORES``) and the registry version: no member list, no RESOLVE, not 8 x 64; a
    cached one (fenced) one PING per master."""
    _fresh(r)
    for i in range(64):
        _hold(store, f"i{i}", 8)
    assert len(_layout(store)) == 64  # warm: digests and holders known
    store.clock.refresh_s = float("inf")  # its offset kept: a measurement (SERVER_TIME: EVALSHA, TIME, HGET),
    before = command_calls(r)  # once a second, would land in a slow run's count
    assert len(_layout(store)) == 64
    got = command_calls(r)
    spent = {k: got[k] - before.get(k, 0) for k in got if got[k] != before.get(k, 0)}
    spent.pop("info", None)
    spent.pop("replconf", None)  # a replica's once-a-second ACK to its master, not the lookup's
    if store.records.cached is not None:  # fenced copies: one PING a master, on its invalidation connection
        assert spent == {"ping": len(r.get_primaries()) if cluster else 1}, spent
    elif cluster:
        assert spent == {"zrange": 8, "get": 1}, spent
    else:  # one CHUNK_HEADS call (its ZRANGEs count too)
        assert spent == {"evalsha": 1, "zscore": 8, "get": 1}, spent


DISK = "LocalDiskBackend"


def test_a_workers_tiers_in_one_call_keep_every_set_exact(r, store):
    """Both tiers of a worker written in one store.apply (one APPLY_OPS call on one Redis, ops
    grouped by chunk): new sets of two, a third holder joining, re-admits among the admits,
    evicts of both tiers at once, an evict beside an admit; each set's digest and holders exact,
    and the records counts and eviction logs as holder by holder."""
    _fresh(r)
    store.register_worker("w", 0)
    store.register_worker("x", 0)
    h = HASHES
    store.apply([("w", 0, CPU, [(ADMIT, int(c)) for c in h[:6]]), ("w", 0, DISK, [(ADMIT, int(c)) for c in h[:4]])],
                now_ms=1_000)
    cpu, disk = store.holder_id("w", 0, CPU), store.holder_id("w", 0, DISK)
    assert [chunk_holders(r, keys.chunk_key(c)) for c in h[:6]] == [{cpu, disk}] * 4 + [{cpu}] * 2
    store.apply([("x", 0, CPU, [(ADMIT, int(c)) for c in h[:3]])], now_ms=1_500)
    other = store.holder_id("x", 0, CPU)
    # re-admits (h0 by both), a new tier (h4 disk), evicts of both tiers (h1), one of one (h2 cpu), and h5 swapped
    store.apply([("w", 0, CPU, [(ADMIT, int(h[0])), (EVICT, int(h[1])), (EVICT, int(h[2])), (EVICT, int(h[5]))]),
                 ("w", 0, DISK, [(ADMIT, int(h[0])), (EVICT, int(h[1])), (ADMIT, int(h[4])), (ADMIT, int(h[5]))])],
                now_ms=2_000)
    assert [chunk_holders(r, keys.chunk_key(c)) for c in h[:6]] == [
        {cpu, disk, other}, {other}, {disk, other}, {cpu, disk}, {cpu, disk}, {disk}]
    store.apply([("w", 0, CPU, [(EVICT, int(h[3])), (EVICT, int(h[4]))]),
                 ("w", 0, DISK, [(EVICT, int(h[3])), (EVICT, int(h[4]))])], now_ms=3_000)
    assert not r.exists(keys.chunk_key(h[3])) and not r.exists(keys.chunk_key(h[4]))
    assert r.zscore(keys.chunk_key(h[0]), cpu) == 2000.0
    assert r.hmget(keys.records_key(), [cpu, disk, other]) == ["1", "3", "3"]
    assert sorted(r.zrange(keys.holder_evicted_key(cpu), 0, -1, withscores=True)) == sorted(
        [(h[1], 2000.0), (h[2], 2000.0), (h[5], 2000.0), (h[3], 3000.0), (h[4], 3000.0)])
    assert sorted(r.zrange(keys.holder_evicted_key(disk), 0, -1)) == sorted([h[1], h[3], h[4]])
