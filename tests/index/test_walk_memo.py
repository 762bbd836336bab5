"""Kept walk answers (kvlookup.index.staged memo) and the copies behind cached reads
(kvlookup.index.copies): a prefix held by many instances is walked once, and every change that
matters (a write to one of its chunks, a deregistration, a lapsed lease) reaches the next lookup
exactly as without them. Copies are bounded, scan-resistant, share equal chunk sets, and never
keep a chunk nobody holds."""

from __future__ import annotations

import time

import pytest

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.copies import MISS, Copies
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.proc.redis_server import connect

CPU = "LocalCPUBackend"
TOKENS = list(range(1000, 2024))  # 4 chunks of 256
HASHES = HashProfile().chunk_hashes(TOKENS)
FLEET = [f"fleet-{i}" for i in range(64)]
pytestmark = pytest.mark.single_node  # cached reads: one Redis


@pytest.fixture()
def writer(redis_url):
    store = Store(connect(redis_url), purge_grace_s=0, instance_ttl_s=30)
    for inst in FLEET:
        store.register_worker(inst, 0)
        store.own("sc-memo", inst)
        store.apply([(inst, 0, CPU, [(ADMIT, h) for h in HASHES])])
    return store


def answer(client: Client, tokens=TOKENS, now_ms: int | None = None):
    found = client.store.lookup(client.chains(tokens), now_ms=now_ms)
    return {m.instance_id: m.matched_prefix_length for m in found}, found


def test_a_prefix_held_by_the_fleet_is_walked_once(redis_url, writer):
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    first, _ = answer(client)
    assert first == {inst: 1024 for inst in FLEET}
    got, kept = answer(client)
    again, same = answer(client)
    assert got == again == first and kept.kept and same is kept  # the kept answer, not a new walk
    fresh = TOKENS[:768] + [7, 7, 7]  # a new last chunk: its own answer, the same length
    assert answer(client, fresh)[0] == {inst: 768 for inst in FLEET}
    assert [m.matched_prefix_length for m in client.matches(TOKENS)] == [1024] * 64


def test_a_write_to_one_chunk_reaches_the_next_lookup(redis_url, writer):
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    answer(client), answer(client)
    writer.apply([("fleet-5", 0, CPU, [(EVICT, HASHES[2])])])
    assert answer(client)[0] == {**{inst: 1024 for inst in FLEET}, "fleet-5": 512}
    writer.apply([("fleet-5", 0, CPU, [(ADMIT, HASHES[2])])])
    assert answer(client)[0] == {inst: 1024 for inst in FLEET}


def test_a_deregistration_reaches_the_next_lookup(redis_url, writer):
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    answer(client), answer(client)
    writer.deregister_worker("fleet-3", 0)
    assert answer(client)[0] == {inst: 1024 for inst in FLEET if inst != "fleet-3"}


def test_a_lapsed_lease_reaches_the_next_lookup(redis_url, writer):
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    now = int(time.time() * 1000)
    answer(client, now_ms=now), answer(client, now_ms=now)
    assert answer(client, now_ms=now + 31_000)[0] == {}  # nobody renewed the leases: all lapsed
    writer.renew("sc-memo")
    assert answer(client, now_ms=int(time.time() * 1000))[0] == {inst: 1024 for inst in FLEET}


def test_a_chunk_nobody_holds_is_not_kept(redis_url, writer):
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    fresh = TOKENS[:768] + list(range(5000, 5256))
    answer(client, fresh)
    copies = client.store.records.cached._copies
    last = keys.chunk_key(HashProfile().chunk_hashes(fresh)[-1])
    assert copies.get(("ZRANGE", last)) is MISS
    assert copies.get(("ZRANGE", keys.chunk_key(HASHES[0]))) is not MISS
    shared = {id(copies.get(("ZRANGE", keys.chunk_key(h)))) for h in HASHES[:3]}
    assert len(shared) == 1  # three chunks, the same 64 holders: one tuple


def test_copies_are_bounded_and_a_scan_does_not_flush_what_is_read_again():
    copies = Copies(100)
    for k in range(10):
        copies.put(("hot", k), (str(k),))
        assert copies.get(("hot", k)) == (str(k),)  # read twice: protected
    for k in range(10_000):  # a scan: each key read once
        copies.put(("scan", k), ("x",))
    assert len(copies) == 100
    assert all(copies.get(("hot", k)) == (str(k),) for k in range(10))
    assert copies.get(("scan", 0)) is MISS and copies.get(("scan", 9_999)) == ("x",)
    assert copies.share(["a", "b"]) is copies.share(["a", "b"]) == ("a", "b")
    with pytest.raises(ValueError, match="max_keys"):
        Copies(0)


@pytest.mark.parametrize("fmt", ["flat", "layout_info"])
def test_a_kept_answer_is_encoded_as_the_same_json(fmt):
    import json

    from kvlookup.app.errors import json_bytes
    from kvlookup.app.lookup import response_body
    from kvlookup.client import InstanceMatch, SharedAnswer

    plain = [InstanceMatch(f"fleet-{i}", CPU, 1024 - i, {CPU: 1024 - i}) for i in range(5)]
    plain.append(InstanceMatch("event_id", "GPU", 12, {"GPU": 12}))  # an instance named like the id field
    kept = SharedAnswer(plain)
    kept.shared = {}
    for _ in range(2):  # encoded, then from what was kept
        a = json.loads(json_bytes(response_body(plain, fmt, False)))
        b = json.loads(json_bytes(response_body(kept, fmt, False)))
        assert a.pop("event_id").startswith("Lookup") and b.pop("event_id").startswith("Lookup")
        assert a == b and list(a) == list(b)
    empty = SharedAnswer([])
    empty.shared = {}
    want = ["event_id", "layout_info"] if fmt == "layout_info" else ["event_id"]
    assert list(json.loads(json_bytes(response_body(empty, fmt, False)))) == want


LONG = list(range(10_000, 10_000 + 300 * 256))  # 300 chunks: read in stages (128, then 1,024)
LONG_HASHES = HashProfile().chunk_hashes(LONG)


@pytest.fixture()
def long_writer(redis_url):
    store = Store(connect(redis_url), purge_grace_s=0, instance_ttl_s=30)
    for inst in ("long-a", "long-b"):
        store.register_worker(inst, 0)
        store.own("sc-long", inst)
    store.apply([("long-a", 0, CPU, [(ADMIT, h) for h in LONG_HASHES])])
    store.apply([("long-b", 0, CPU, [(ADMIT, h) for h in LONG_HASHES[:200]])])  # chunks 200.. empty for b
    return store


def test_a_staged_lookup_is_kept_and_every_change_reaches_the_next(redis_url, long_writer):
    """kvlookup.index.kept: a lookup read in several rounds is kept whole (the same answer object
    again, no read), and a write deep in the chain, a filled chunk that was empty, a
    deregistration and a lapsed lease each reach the next lookup."""
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    full = {"long-a": 300 * 256, "long-b": 200 * 256}
    assert answer(client, LONG)[0] == full
    got, kept = answer(client, LONG)
    hits = client.store.records.cached.stats["hits"]
    again, same = answer(client, LONG)
    assert got == again == full and kept.kept and same is kept
    assert client.store.records.cached.stats["hits"] == hits  # answered without reading a copy
    long_writer.apply([("long-a", 0, CPU, [(EVICT, LONG_HASHES[250])])])  # past the first stage
    assert answer(client, LONG)[0] == {"long-a": 250 * 256, "long-b": 200 * 256}
    long_writer.apply([("long-b", 0, CPU, [(ADMIT, LONG_HASHES[200])])])  # an empty chunk filled
    answer(client, LONG)
    assert answer(client, LONG)[0] == {"long-a": 250 * 256, "long-b": 201 * 256}
    long_writer.deregister_worker("long-b", 0)
    assert answer(client, LONG)[0] == {"long-a": 250 * 256}
    now = int(time.time() * 1000)
    answer(client, LONG, now_ms=now), answer(client, LONG, now_ms=now)
    assert answer(client, LONG, now_ms=now + 31_000)[0] == {}  # nobody renewed the lease


def test_a_kept_staged_lookup_is_not_used_once_caching_went_off(redis_url, r, long_writer):
    """Reads sent untracked (the invalidation connection gone) never vouch for a kept answer."""
    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    answer(client, LONG), answer(client, LONG)
    r.client_kill_filter(_type="pubsub")  # the invalidation connection goes
    long_writer.apply([("long-a", 0, CPU, [(EVICT, LONG_HASHES[260])])])
    assert answer(client, LONG)[0] == {"long-a": 260 * 256, "long-b": 200 * 256}


def test_a_request_scratch_keeps_its_chains(redis_url, writer):
    """Client.matches(scratch=...): the chains hashed once per request (app.asgi retries a lookup
    that needed Redis in a thread with the same scratch, and it does not hash again)."""
    from kvlookup.client import CHAINS_KEY

    client = Client(redis_url, instance_ttl_s=30, cache_reads="fenced")
    scratch: dict = {}
    assert [m.matched_prefix_length for m in client.matches(TOKENS, scratch=scratch)] == [1024] * 64
    assert [c.hashes for c in scratch[CHAINS_KEY]] == [c.hashes for c in client.chains(TOKENS)]
    kept = {CHAINS_KEY: client.chains(TOKENS[:512])}  # what a first try kept is what is walked
    assert [m.matched_prefix_length for m in client.matches(TOKENS, scratch=kept)] == [512] * 64
