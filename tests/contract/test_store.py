"""Index semantics on a real Redis: instances, TP ranks, tiers, evictions, epochs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlookup.client import Client, pick_location
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, NotRegistered, Store
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import chunk_holders

CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"
S600 = SEED_TOKENS + list(range(1000, 1588))
H600 = HashProfile().chunk_hashes(S600)
S1000 = S600[:512] + list(range(3000, 3488))
H1000 = HashProfile().chunk_hashes(S1000)


def admit(store, inst, hashes, loc=CPU, wid=0):
    store.apply([(inst, wid, loc, [(ADMIT, h) for h in hashes])])


def evict(store, inst, hashes, loc=CPU, wid=0):
    store.apply([(inst, wid, loc, [(EVICT, h) for h in hashes])])


@pytest.fixture()
def client(store):
    return Client(store=store)


def layout(client, tokens):
    return client.lookup(tokens)[1]


def test_seed_lookup(store, client):
    store.register_worker("lmcache_default_instance", 0, "127.0.0.1", 8001)
    admit(store, "lmcache_default_instance", [SEED_HASH])
    event_id, info = client.lookup(SEED_TOKENS)
    assert event_id.startswith("Lookup") and len(event_id) == len("Lookup") + 36
    assert info == {"lmcache_default_instance": (CPU, 12)}
    assert layout(client, SEED_TOKENS + [1]) == {}
    assert layout(client, SEED_TOKENS[:11]) == {}


def test_every_instance_reported_longest_first(store, client):
    store.register_worker("inst-x", 0, "127.0.0.1", 8002)
    store.register_worker("inst-y", 0, "127.0.0.1", 8003)
    admit(store, "inst-x", H600[:2])
    admit(store, "inst-y", H1000)
    assert list(layout(client, S1000).items()) == [("inst-y", (CPU, 1000)), ("inst-x", (CPU, 512))]
    # both hold s600's first two chunks; LMCache 0.5.6 would name only the first registered
    assert list(layout(client, S600).items()) == [("inst-x", (CPU, 512)), ("inst-y", (CPU, 512))]
    evict(store, "inst-x", H600[:1])
    assert layout(client, S1000) == {"inst-y": (CPU, 1000)}  # suffix-only holder is not credited


def test_walk_stops_at_first_gap(store, client):
    store.register_worker("a", 0)
    admit(store, "a", [H600[0], H600[2]])
    assert layout(client, S600) == {"a": (CPU, 256)}


def test_tp_ranks_all_must_hold(store, client):
    store.register_worker("tp", 0, "127.0.0.1", 8004)
    store.register_worker("tp", 1, "127.0.0.1", 8005)
    admit(store, "tp", H600, wid=0)
    assert layout(client, S600) == {}
    admit(store, "tp", H600[:2], wid=1)
    assert layout(client, S600) == {"tp": (CPU, 512)}
    admit(store, "tp", H600[2:], wid=1)
    assert layout(client, S600) == {"tp": (CPU, 600)}
    evict(store, "tp", H600[1:2], wid=1)
    assert layout(client, S600) == {"tp": (CPU, 256)}


def test_location_holding_most_of_the_prefix(store, client):
    store.register_worker("a", 0)
    admit(store, "a", H600[:1], loc=DISK)
    admit(store, "a", H600[1:], loc=CPU)
    assert layout(client, S600) == {"a": (CPU, 600)}  # 344 tokens in CPU vs 256 on disk
    match = client.matches(S600)[0]
    assert match.locations == {CPU: 344, DISK: 256}
    evict(store, "a", H600[2:], loc=CPU)
    admit(store, "a", H600[2:], loc=DISK)
    assert layout(client, S600) == {"a": (DISK, 600)}


def test_location_ties_prefer_faster_tier():
    assert pick_location({DISK: 256, CPU: 256}) == CPU
    assert pick_location({"GPU": 10, CPU: 10, DISK: 10}) == "GPU"
    assert pick_location({"Zeta": 5, "Alpha": 5}) == "Alpha"
    assert pick_location({"Remote": 300, CPU: 12}) == "Remote"


def test_chunk_in_two_tiers_counts_for_both(store, client):
    store.register_worker("a", 0)
    admit(store, "a", [SEED_HASH], loc=CPU)
    admit(store, "a", [SEED_HASH], loc=DISK)
    match = client.matches(SEED_TOKENS)[0]
    assert (match.location, match.matched_prefix_length, match.locations) == (CPU, 12, {CPU: 12, DISK: 12})
    evict(store, "a", [SEED_HASH], loc=CPU)
    assert layout(client, SEED_TOKENS) == {"a": (DISK, 12)}


def test_reregistration_starts_cold_epoch(store, client, r):
    assert store.register_worker("a", 0, "127.0.0.1", 8001) == 1
    admit(store, "a", H600)
    assert store.register_worker("a", 0, "127.0.0.1", 8001) == 2
    assert layout(client, S600) == {}
    admit(store, "a", H600[:1])
    assert layout(client, S600) == {"a": (CPU, 256)}
    assert store.purge() == 3
    assert r.zrange(keys.chunk_key(H600[0]), 0, -1) == ["2"]
    assert r.exists(keys.chunk_key(H600[1])) == 0
    assert r.zrange(keys.dead_holders_key(), 0, -1) == []
    assert r.hgetall(keys.holders_key()) == {"2": "a\t0\tLocalCPUBackend\t"}


def test_deregister_touches_no_other_instance(store, client, r):
    store.register_worker("a", 0, "10.0.0.1", 8001)
    store.register_worker("b", 0, "10.0.0.1", 8002)
    admit(store, "a", H600)
    admit(store, "b", H600)
    assert store.deregister_worker("a", 0) is True
    assert store.deregister_worker("a", 0) is False
    assert layout(client, S600) == {"b": (CPU, 600)}
    store.purge()
    assert r.smembers(keys.instances_key()) == {"b"}
    assert r.smembers(keys.ip_index_key("10.0.0.1")) == {"8002:b"}
    assert all(r.zrange(keys.chunk_key(h), 0, -1) == ["2"] for h in H600)


def test_records_for_unknown_worker_are_refused(store):
    with pytest.raises(NotRegistered):
        admit(store, "ghost", [SEED_HASH])


def test_silent_instance_is_excluded(r, client):
    store = Store(r, instance_ttl_s=30)
    store.register_worker("a", 0)
    admit(store, "a", [SEED_HASH])
    r.zrem(keys.alive_key(), "a")  # its sidecar stopped renewing the lease
    assert Client(store=store).lookup(SEED_TOKENS)[1] == {}
    store.touch_instance("a")
    assert Client(store=store).lookup(SEED_TOKENS)[1] == {"a": (CPU, 12)}


def test_detail_and_redis_layout(store, client, r):
    store.register_worker("a", 0, "127.0.0.1", 8001, "localhost:8200", now=1700000000.5)
    admit(store, "a", [SEED_HASH])
    assert r.hgetall(keys.worker_key("a", 0)) == {
        "epoch": "1", "ip": "127.0.0.1", "port": "8001", "peer_init_url": "localhost:8200",
        "registered_at": "1700000000.5", "last_heartbeat": "1700000000.5", "heartbeats": "0",
        "loc:LocalCPUBackend": "1"}
    assert r.hgetall(keys.holders_key()) == {"1": "a\t0\tLocalCPUBackend\t"}
    assert r.smembers(keys.holder_chunks_key(1, keys.chunk_bucket(SEED_HASH))) == {str(SEED_HASH)}
    assert r.hgetall(keys.records_key()) == {"1": "1"}
    assert r.hgetall(keys.instance_key("a")) == {"kind": "lmcache", "worker_rule": "all"}
    assert r.hgetall(keys.rules_key()) == {"a": "all\t1"}
    assert r.zrange(keys.chunk_key(SEED_HASH), 0, -1, withscores=True) == [("1", pytest.approx(r.zscore(
        keys.chunk_key(SEED_HASH), "1")))]
    assert client.matches(SEED_TOKENS)[0].detail() == {
        "location": CPU, "matched_prefix_length": 12, "locations": {CPU: 12}}


def test_instance_ids_cannot_reach_another_instances_keys(store, client, r):
    """``a:workers`` and ``a:0`` are instance ids of their own, not facets of instance ``a``."""
    for inst in ("a", "a:workers", "a:0", "a%3A0"):
        store.register_worker(inst, 0, "127.0.0.1", 8001)
    store.register_worker("a", 1, "127.0.0.1", 8002)
    admit(store, "a:workers", [SEED_HASH])
    admit(store, "a:0", [SEED_HASH])
    admit(store, "a%3A0", [SEED_HASH])
    admit(store, "a", [SEED_HASH], wid=0)
    assert r.smembers(keys.instance_workers_key("a")) == {"0", "1"}
    assert r.smembers(keys.instance_workers_key("a:workers")) == {"0"}
    assert layout(client, SEED_TOKENS) == {"a%3A0": (CPU, 12), "a:0": (CPU, 12), "a:workers": (CPU, 12)}
    store.deregister_worker("a:0", 0)
    assert r.hgetall(keys.worker_key("a", 0))["port"] == "8001"
    assert layout(client, SEED_TOKENS) == {"a%3A0": (CPU, 12), "a:workers": (CPU, 12)}


@pytest.mark.parametrize("chunk_hash", [SEED_HASH, -3970904962213640042, 0, 7, -12, 123,
                                        "61c2b0ee121bc0763dbbeea739151226a766c47730c3a57bb614a91f1734493d"])
def test_reverse_index_bucket_agrees_with_lua(store, r, chunk_hash):
    store.register_worker("a", 0)
    admit(store, "a", [chunk_hash])
    bucket = keys.chunk_bucket(chunk_hash)
    assert r.smembers(keys.holder_chunks_key(1, bucket)) == {str(chunk_hash)}
    evict(store, "a", [chunk_hash])
    assert r.exists(keys.holder_chunks_key(1, bucket)) == 0
    assert r.hget(keys.records_key(), "1") == "0"


def test_reverse_index_buckets_are_intsets_and_purge_in_steps(store, r):
    store.register_worker("a", 0)
    hashes = HashProfile(chunk_size=1).chunk_hashes(list(range(5000)))
    admit(store, "a", hashes)
    assert r.hget(keys.records_key(), "1") == "5000"
    counts = [r.scard(keys.holder_chunks_key(1, b)) for b in range(keys.HOLDER_CHUNK_BUCKETS)]
    assert sum(counts) == 5000 and max(counts) < 20  # spread over the buckets
    assert r.object("encoding", keys.holder_chunks_key(1, keys.chunk_bucket(hashes[0]))) == "intset"
    store.register_worker("a", 0)
    assert [store.purge(2000), store.purge(2000), store.purge(2000)] == [2000, 2000, 1000]
    assert r.hget(keys.holders_key(), "1") is None
    assert r.exists(keys.chunk_key(hashes[0])) == 0 and r.exists(keys.chunk_key(hashes[-1])) == 0
    assert r.zrange(keys.dead_holders_key(), 0, -1) == []


def test_batches_of_one_holder_keep_their_order(store, r):
    """A holder's ops in several batches of one call apply in order (a cluster backend writes in
    rounds, so the store joins a holder's batches before folding)."""
    store.register_worker("a", 0)
    store.apply([("a", 0, CPU, [(ADMIT, 1), (ADMIT, 2)]), ("a", 0, DISK, [(ADMIT, 1)]),
                 ("a", 0, CPU, [(EVICT, 1), (EVICT, 2), (ADMIT, 2)]), ("a", 0, DISK, [(EVICT, 1)])])
    assert [r.zrange(keys.chunk_key(h), 0, -1) for h in (1, 2)] == [[], ["1"]]
    assert r.hgetall(keys.records_key()) == {"1": "1"}  # the disk holder netted to nothing


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.lists(st.tuples(st.sampled_from([("a", 0, CPU), ("a", 0, DISK), ("b", 0, CPU)]),
                                         st.lists(st.tuples(st.sampled_from([ADMIT, EVICT]), st.integers(1, 6)),
                                                  min_size=1, max_size=6)),
                               min_size=1, max_size=4), min_size=1, max_size=4))
def test_any_sequence_of_ops_leaves_exactly_the_last_state(r, calls):
    """Random admits/evicts over several holders, batches and calls: every chunk's sorted set,
    every reverse-index bucket and every record count equal the plain model's final state."""
    for node in r.get_primaries() if hasattr(r, "get_primaries") else [None]:
        (node.redis_connection if node else r).flushdb()
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    store.register_worker("a", 0)
    store.register_worker("b", 0)
    held: dict[tuple, set[int]] = {}
    for call in calls:
        store.apply([(inst, wid, loc, ops) for (inst, wid, loc), ops in call])
        for holder, ops in call:
            for op, h in ops:
                (held.setdefault(holder, set()).add if op == ADMIT else held.setdefault(holder, set()).discard)(h)
    hid = {holder: store.holder_id(*holder) for holder in held}
    for h in range(1, 7):
        assert chunk_holders(r, keys.chunk_key(h)) == {hid[k] for k, s in held.items() if h in s}
    for holder, chunks in held.items():
        members = set()
        for b in {keys.chunk_bucket(h) for h in range(1, 7)}:
            members |= r.smembers(keys.holder_chunks_key(hid[holder], b))
        assert members == {str(h) for h in chunks}
        assert int(r.hget(keys.records_key(), hid[holder]) or 0) == len(chunks)


def test_a_chunk_key_has_one_identity_whatever_its_wire_type(store, r, client):
    """0.3.0-0.3.2 keys are hex text, later ones ints: an int admit and a str evict with the same
    digits in one batch are one chunk, applied in order (they used to alias: the admit was lost
    or the evict ignored)."""
    store.register_worker("a", 0)
    store.apply([("a", 0, CPU, [(ADMIT, 123), (EVICT, "123"), (ADMIT, SEED_HASH)])])
    assert r.zrange(keys.chunk_key(123), 0, -1) == []
    store.apply([("a", 0, CPU, [(EVICT, str(SEED_HASH)), (ADMIT, SEED_HASH)])])
    assert layout(client, SEED_TOKENS) == {"a": (CPU, 12)}
    assert r.hgetall(keys.records_key()) == {"1": "1"}


def test_a_flushed_index_reuses_holder_ids_and_no_kept_answer_survives(store, client, r, cluster):
    """FLUSHALL restarts holder ids at 1; the registry version must not restart with them, or a
    controller's kept RESOLVE answers (cluster) and cached reads would name the old holder."""
    store.register_worker("before", 0)
    admit(store, "before", [SEED_HASH])
    assert layout(client, SEED_TOKENS) == {"before": (CPU, 12)}
    version = r.get(keys.registry_version_key())
    for node in (r.get_primaries() if cluster else [None]):
        (node.redis_connection if node else r).flushall()
    store._holders.clear()  # the writer's own holder-id cache (a sidecar restarts with the flush)
    store.register_worker("after", 0)
    admit(store, "after", [SEED_HASH])
    assert r.hget(keys.holders_key(), "1") is not None  # the same holder id again
    assert r.get(keys.registry_version_key()) != version
    assert layout(client, SEED_TOKENS) == {"after": (CPU, 12)}


def test_next_purge_is_when_the_earliest_retired_holders_grace_ends(r):
    """Store.next_purge_s: None with nothing retired; the grace left after a retirement (on
    Redis's clock); 0 once it has passed. The sidecar schedules its next purge pass by it."""
    for node in r.get_primaries() if hasattr(r, "get_primaries") else [None]:
        (node.redis_connection if node else r).flushdb()
    store = Store(r, instance_ttl_s=0, purge_grace_s=5)
    store.register_worker("a", 0)
    store.apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
    assert store.next_purge_s() is None
    store.retire_location("a", 0, CPU)
    now_ms = store.clock.now_ms()
    left = store.next_purge_s(now_ms)
    assert left is not None and 4.0 < left <= 5.0
    assert store.next_purge_s(now_ms + 5_000) == 0.0
    assert store.purge(now_ms=now_ms) == 0 and store.purge(now_ms=now_ms + 5_001) == 1
    assert store.next_purge_s() is None
