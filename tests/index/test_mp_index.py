"""The LMCache MP directory (kvlookup.index.mp) on real Redis: the gate, placements, counters,
hashing and memory; the expected values are the real coordinator's (research: §2-§4)."""

from __future__ import annotations

import pytest

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index.mp import ChunkSizeConflict, MPDirectory
from kvlookup.index.mp_values import chunk_b64
from kvlookup.wire import lmcache_mp as W

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
C0 = "d526d88f0c387e4049f866a4c572cbf658276fcae250b069051fd1fff3ad0579"
C1 = "8be5f115945ff3c4eb943172f8edfdcdf3432274c3d3dbd2436fed9a9fe494f5"
INC = 1796108700
WS1 = 16777472


def key(h=C0, rank=WS1, model=MODEL, salt="", group=0):
    return {"chunk_hash_hex": h, "model_name": model, "kv_rank": rank, "object_group_id": group, "cache_salt": salt}


def batch(seq, etype="store", tier="l1", backend="dram", entries=(), inst="mp-test-1", inc=INC, **kw):
    return {"instance_id": inst, "incarnation": inc, "seq": seq, "event_type": etype, "tier": tier,
            "backend": backend, "entries": list(entries), **kw}


def entry(h=C0, size=33554432, tokens=(), offset=-1, **kw):
    return {"key": key(h, **kw), "size_bytes": size, "token_ids": list(tokens), "token_offset": offset}


def post(d: MPDirectory, *batches) -> dict:
    import msgspec

    req = W.decode(msgspec.json.encode({"batches": list(batches)}), W.CacheEventsRequest)
    return d.apply(req.batches)


@pytest.fixture()
def d(r):
    return MPDirectory(r)


def test_worked_example_hashes():
    assert mphash.chunk_hashes_hex(list(range(1000, 1512))) == [C0, C1]
    assert mphash.chunk_hashes_hex(list(range(1000, 1600))) == [C0, C1]
    assert mphash.chunk_hashes_hex(list(range(1000, 1255))) == []
    assert mphash.NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
    assert [mphash.kv_rank(2, r) for r in (0, 1)] == [33554944, 33620481]
    assert [mphash.kv_rank(4, r) for r in range(4)] == [67109888, 67175425, 67240962, 67306499]


def test_store_lookup_duplicate_and_stats(d):
    toks = list(range(1000, 1256))
    assert post(d, batch(1, entries=[entry(tokens=toks, offset=0)])) == {"applied": 1, "duplicates": 0, "stale": 0}
    assert post(d, batch(1, entries=[entry(tokens=toks, offset=0)])) == {"applied": 0, "duplicates": 1, "stale": 0}
    assert post(d, batch(2, tier="l2", backend="fs", entries=[{"key": {"chunk_hash_hex": C0, "model_name": MODEL,
                                                                        "kv_rank": WS1}}]))["applied"] == 1
    chunks, keys = d.keys_for_tokens(list(range(1000, 1512)), MODEL)
    assert chunks == 2
    res = d.lookup_keys(keys)
    assert res[0] == {"key": key(), "placements": [
        {"instance_id": "mp-test-1", "incarnation": INC, "tier": "l1", "backend": "dram", "size_bytes": 33554432,
         "shared": False},
        {"instance_id": "mp-test-1", "incarnation": INC, "tier": "l2", "backend": "fs", "size_bytes": 0,
         "shared": False}], "token_ids": toks, "access_count": 0}
    assert res[1] == {"key": key(C1), "placements": [], "token_ids": [], "access_count": 0}
    assert d.stats() == {"num_keys": 1, "num_placements": 2, "l1_keys_by_instance": {"mp-test-1": 1},
                         "blend": {"num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0,
                                   "table_size": 0},
                         "l1_count": 1, "l1_size_bytes": 33554432, "l2_count": 1, "l2_size_bytes": 0}
    listed = d.list_keys(tier="l1", instance_id="mp-test-1", backend="dram")
    assert listed == {"total": 1, "keys": [{"key": key(), "placements": [res[0]["placements"][0]],
                                            "num_tokens": 256, "access_count": 0}]}


def test_access_gap_incarnation_and_stale(d):
    post(d, batch(1, entries=[entry()]), batch(2, tier="l2", backend="fs", entries=[entry(size=5)]))
    post(d, batch(3, etype="access", backend="", entries=[entry(size=0)]),
         batch(4, etype="access", tier="l2", backend="", entries=[entry(size=0)]))
    assert d.lookup_keys([W.EncodedObjectKey(**key())])[0]["access_count"] == 2
    assert post(d, batch(7, etype="access", backend="", entries=[entry(C1)]))["applied"] == 1  # gap admitted
    assert d.cursors()["mp-test-1"]["gap_detected"] is True
    assert post(d, batch(1, inc=INC - 1, tier="l2", backend="fs"))["stale"] == 1
    # a new incarnation: L1 gone, L2 kept, its cursor starts again
    assert post(d, batch(1, inc=INC + 1, etype="access", backend="", entries=[entry()]))["applied"] == 1
    res = d.lookup_keys([W.EncodedObjectKey(**key())])[0]
    assert [(p["tier"], p["backend"], p["incarnation"]) for p in res["placements"]] == [("l2", "fs", INC)]
    assert res["access_count"] == 3
    assert d.stats()["l1_keys_by_instance"] == {} and d.stats()["l1_count"] == 0
    assert d.cursors()["mp-test-1"]["gap_detected"] is False


def test_delete_removes_key_and_binding(d, r):
    post(d, batch(1, entries=[entry(tokens=range(1000, 1256), offset=0)]))
    post(d, batch(2, etype="delete", entries=[entry(size=0)]))
    assert d.stats()["num_keys"] == 0
    assert d.lookup_keys([W.EncodedObjectKey(**key())])[0]["placements"] == []
    assert r.hkeys(K.mp_chunks_key(K.mp_bucket(C0))) == []
    assert post(d, batch(3, etype="delete", entries=[entry(C1)]))["applied"] == 1  # absent: nothing


def test_shared_last_reporter_wins(d):
    post(d, batch(1, tier="l2", backend="s3", shared=True, entries=[entry(size=1)]))
    post(d, batch(1, inst="mp-b", inc=7, tier="l2", backend="s3", shared=True, entries=[entry(size=2)]))
    pl = d.lookup_keys([W.EncodedObjectKey(**key())])[0]["placements"]
    assert pl == [{"instance_id": "mp-b", "incarnation": 7, "tier": "l2", "backend": "s3", "size_bytes": 2,
                   "shared": True}]
    assert d.stats()["num_placements"] == 1 and d.stats()["l2_size_bytes"] == 2


def test_deregister_fences_l1_until_registered_again(d):
    post(d, batch(1, entries=[entry()]), batch(2, tier="l2", backend="fs", entries=[entry()]))
    d.deregister("mp-test-1")
    assert d.stats()["l1_count"] == 0 and d.stats()["l2_count"] == 1
    # 0.5.7: L1 batches of the departed incarnation are stale; L2 are admitted (fresh cursor)
    assert post(d, batch(3, entries=[entry()])) == {"applied": 0, "duplicates": 0, "stale": 1}
    assert post(d, batch(4, tier="l2", backend="fs", entries=[entry(C1)]))["applied"] == 1
    d.register(W.RegisterRequest(instance_id="mp-test-1", ip="127.0.0.1", http_port=1))
    assert post(d, batch(5, entries=[entry()]))["applied"] == 1


def test_dropped_events_rise_records_gap(d):
    post(d, batch(1, dropped_events=0))
    post(d, batch(2, dropped_events=0))
    assert d.cursors()["mp-test-1"]["gap_detected"] is False
    post(d, batch(3, dropped_events=4))
    c = d.cursors()["mp-test-1"]
    assert c["gap_detected"] is True and c["events_dropped"] == 4
    assert d.counters()["events_dropped"] == 4


def test_register_heartbeat_timeout(d):
    assert d.register(W.RegisterRequest(instance_id="mp-x", ip="127.0.0.1", http_port=19510), now=100.0) == \
        ("mp-x", False)
    assert d.register(W.RegisterRequest(instance_id="mp-x", ip="127.0.0.1", http_port=19510), now=100.0)[1] is True
    assert d.heartbeat("mp-x", now=110.0) is True
    assert d.heartbeat("nope") is False
    post(d, batch(1, inst="mp-x", entries=[entry()]))
    assert d.reap(now=135.0) == []
    assert d.reap(now=141.0) == ["mp-x"]
    assert d.heartbeat("mp-x") is False and d.stats()["num_keys"] == 0


def test_chunk_size_binding(d):
    assert d.chunk_size() == 256
    assert d.bind_chunk_size(512) == 512
    assert d.bind_chunk_size(512) == 512
    with pytest.raises(ChunkSizeConflict):
        d.bind_chunk_size(256)
    assert d.chunk_size() == 512


def test_decode_errors_name_the_field():
    import msgspec

    def bad(b):
        with pytest.raises(W.MPBodyError) as exc:
            W.decode(msgspec.json.encode({"batches": [b]}), W.CacheEventsRequest)
        return str(exc.value)

    assert "$.batches[0].seq" in bad(batch(0))
    assert "$.batches[0].event_type" in bad(batch(1, etype="STORE"))
    assert "$.batches[0].tier" in bad(batch(1, tier="all"))
    assert "$.batches[0].backend" in bad(batch(1, backend=""))
    assert "chunk_hash_hex" in bad(batch(1, entries=[entry("xyz")]))
    assert "model_name" in bad(batch(1, entries=[entry(model="a@b")]))
    assert "cache_salt" in bad(batch(1, entries=[entry(salt="a/b")]))
    assert "token_offset" in bad(batch(1, entries=[entry(offset=-2)]))
    assert "entries" in bad(batch(1, etype="config", entries=[entry()]))
    # the whole-batch check (wire.lmcache_mp._plain) leaves the naming to the entry-by-entry one
    assert "entries[2].key.chunk_hash_hex" in bad(batch(1, entries=[entry(), entry(C1), entry("0g" * 32)]))
    assert "entries[1].key.model_name" in bad(batch(1, entries=[entry(), entry(C1, model="a@b")]))
    assert "entries[0].key.cache_salt" in bad(batch(1, entries=[entry(salt="a/b"), entry(C1, salt="a/b")]))
    spaced = W.decode(msgspec.json.encode({"batches": [batch(1, entries=[entry(), entry(C1[:62] + " " + C1[62:])])]}),
                      W.CacheEventsRequest)  # bytes.fromhex takes whitespace between bytes, as the coordinator does
    assert len(spaced.batches[0].entries) == 2


def test_memory_per_placement(d, r, cluster):
    """<= 150 B of Redis memory per placement at 20k single-placement L1 keys (engine-driven: no tokens)."""
    if cluster:
        pytest.skip("measured on one server (INFO used_memory)")
    import os

    r.flushall()
    before = r.info("memory")["used_memory"]
    n = 50000
    for s in range(0, n, 1000):
        post(d, batch(s // 1000 + 1, entries=[entry(os.urandom(32).hex(), size=4194304) for _ in range(1000)]))
    used = r.info("memory")["used_memory"] - before
    assert d.stats()["num_placements"] == n
    assert used / n <= 150, used / n


def test_mp_key_strings_are_pinned():
    """Every MP key (docs/redis-schema.md) carries the {mp} hash tag: one slot."""
    from kvlookup.index.cluster_io import slot_of

    assert K.mp_bucket(C0) == "d52"
    assert K.mp_chunks_key("d52") == "kvl:v2:{mp}:c:d52"
    assert K.mp_page_key(3) == "kvl:v2:{mp}:k:3"
    assert K.mp_l1_key(7, 255) == "kvl:v2:{mp}:l1:7:255"
    assert K.mp_all_keys() == ["kvl:v2:{mp}:names", "kvl:v2:{mp}:stats", "kvl:v2:{mp}:cursors",
                               "kvl:v2:{mp}:departed", "kvl:v2:{mp}:instances", "kvl:v2:{mp}:heartbeats",
                               "kvl:v2:{mp}:capacity", "kvl:v2:{mp}:config"]
    slots = {slot_of(k) for k in [*K.mp_all_keys(), K.mp_chunks_key("fff"), K.mp_page_key(0), K.mp_l1_key(1, 0)]}
    assert slots == {slot_of(K.MP)}
    assert K.mp_blend_key(2) == "kvl:v2:{mp}:b:2" and slot_of(K.mp_blend_key(2)) == slot_of(K.MP)


def test_mp_script_keys_and_prefixes_are_pinned():
    """KEYS[1..10] of MP_APPLY and MP_DEPART (kvlookup.index.mp_scripts): the fixed hashes, then the
    prefixes the scripts complete with the ids they allocate or discover; each family's key is its
    prefix followed by the id, and every prefix is in the {mp} slot."""
    from kvlookup.index.cluster_io import slot_of

    assert K.mp_script_keys() == ["kvl:v2:{mp}:names", "kvl:v2:{mp}:stats", "kvl:v2:{mp}:cursors",
                                  "kvl:v2:{mp}:departed", "kvl:v2:{mp}:capacity", "kvl:v2:{mp}:instances",
                                  "kvl:v2:{mp}:heartbeats", "kvl:v2:{mp}:c:", "kvl:v2:{mp}:k:", "kvl:v2:{mp}:l1:"]
    assert K.mp_chunks_prefix() + "d52" == K.mp_chunks_key("d52")
    assert K.mp_page_prefix() + "3" == K.mp_page_key(3)
    assert K.mp_l1_prefix() + "7:255" == K.mp_l1_key(7, 255)
    assert {slot_of(k) for k in K.mp_script_keys()} == {slot_of(K.MP)}


def test_tokens_lookup_json_is_the_general_answer(d):
    """The fragment-built tokens-form answer (POST /directory/lookup's fast path) is byte for
    byte what lookup_keys(keys_for_tokens(...)) encodes: two ranks, L1 and L2, a shared pool,
    a token binding, an access count, a chunk held by one rank only, and a chunk held by none."""
    import msgspec

    toks = list(range(1000, 2024))  # 4 chunks
    h = mphash.chunk_hashes_hex(toks)
    r0, r1 = mphash.kv_rank(2, 0), mphash.kv_rank(2, 1)
    post(d, batch(1, entries=[entry(h[0], rank=r0, tokens=toks[:256], offset=0), entry(h[0], rank=r1),
                              entry(h[1], rank=r0), entry(h[1], rank=r1), entry(h[2], rank=r0)]),
         batch(2, tier="l2", backend="fs", entries=[entry(h[0], rank=r0, size=7), entry(h[1], rank=r1)]),
         batch(3, tier="l2", backend="nixl", shared=True, entries=[entry(h[0], rank=r1, size=9)]),
         batch(1, inst="mp-test-2", entries=[entry(h[0], rank=r0, size=5)]),
         batch(4, etype="access", tier="l1", backend="dram", entries=[entry(h[0], rank=r0)]))
    for ws, salt in ((2, ""), (1, ""), (2, "other")):
        chunks, keys = d.keys_for_tokens(toks + [1, 2], MODEL, ws, salt)
        want = msgspec.json.encode({"chunks": chunks, "results": d.lookup_keys(keys)}) + b"\n"
        assert d.lookup_tokens_json(toks + [1, 2], MODEL, ws, salt) == want
    got = msgspec.json.decode(d.lookup_tokens_json(toks, MODEL, 2))
    assert got["chunks"] == 4 and [len(x["placements"]) for x in got["results"]] == [3, 2, 1, 2, 1, 0, 0, 0]
    assert got["results"][0]["access_count"] == 1 and got["results"][0]["token_ids"] == toks[:256]


def test_prefix_read_stops_at_the_first_chunk_nobody_holds(d):
    """prefix_fields (one MP_READ_PREFIX call): the live instances, the capacities and the records up
    to and including the first chunk no rank holds; prefix_matches counts the chunks before it."""
    import time

    toks = list(range(1000, 2024))  # 4 chunks; chunk 2 held by nobody, chunk 3 held again
    h = mphash.chunk_hashes_hex(toks)
    r0, r1 = mphash.kv_rank(2, 0), mphash.kv_rank(2, 1)
    d.register(W.RegisterRequest(instance_id="mp-test-1", ip="127.0.0.1", http_port=1))
    post(d, batch(1, entries=[entry(x, rank=r) for x in (h[0], h[1], h[3]) for r in (r0, r1)]),
         batch(2, tier="l2", backend="fs", entries=[entry(h[0], rank=r0)]))
    sids = d.space_ids([f"{MODEL}\t\t{kr}\t0" for kr in (r0, r1)])
    live, capacity, flat = d.prefix_fields(mphash.chunk_hashes(toks), sids, time.time())
    assert list(live) == ["mp-test-1"] and capacity == d.capacity()
    assert len(flat) == 3 * 2 and flat[4:] == [None, None] and all(flat[:4])
    assert d.prefix_matches(toks, MODEL, 2) == [("mp-test-1", 512, {"l1/dram": 512})]
    assert d.prefix_matches(toks, MODEL, 1) == []


def test_reads_in_slices_answer_as_one(d, monkeypatch):
    """A prompt longer than READ_SLICE chunks is read in several script calls (MP_READ_CHUNKS,
    MP_READ_PREFIX): the same answers as one call, the prefix read stopping in the slice where the
    first chunk nobody holds is."""
    import msgspec

    from kvlookup.index import mp_records

    toks = list(range(1000, 3560))  # 10 chunks; 0-6 held, 7 not, 8 held
    h = mphash.chunk_hashes_hex(toks)
    d.register(W.RegisterRequest(instance_id="mp-test-1", ip="127.0.0.1", http_port=1))
    post(d, batch(1, entries=[entry(x, tokens=toks[i * 256:(i + 1) * 256], offset=i * 256)
                              for i, x in enumerate(h) if i not in (7, 9)]))
    one = (d.lookup_tokens_json(toks, MODEL), d.prefix_matches(toks, MODEL))
    monkeypatch.setattr(mp_records, "READ_SLICE", 3)
    assert (d.lookup_tokens_json(toks, MODEL), d.prefix_matches(toks, MODEL)) == one
    assert one[1] == [("mp-test-1", 7 * 256, {"l1/dram": 7 * 256})]
    assert [len(x["placements"]) for x in msgspec.json.decode(one[0])["results"]] == [1] * 7 + [0, 1, 0]
    sids = d.space_ids([f"{MODEL}\t\t{WS1}\t0"])
    assert len(d.prefix_fields(mphash.chunk_hashes(toks), sids)[2]) == 8  # slices of 3: 3, 3, then 2 (stops)


def _traffic(d: MPDirectory) -> list[dict]:
    """Batches that reach every branch of MP_APPLY's entry loop (new keys across key pages,
    broken by known keys, a key twice in one batch, another instance's and a shared placement on a
    key, access, delete, a restart that fences L1, a departure), answered in order; then
    everything the directory shows of them."""
    hashes = [i.to_bytes(2, "big").hex() * 16 for i in range(300)]
    inst2 = "mp-test-2"
    out = [
        post(d, batch(1, entries=[entry(h, size=100 + i) for i, h in enumerate(hashes[:3])])),  # interns the space
        post(d, batch(2, entries=[entry(h, size=7) for h in hashes[3:10] + hashes[:3] + hashes[10:200]
                                  + hashes[5:6]])),
        post(d, batch(1, inst=inst2, entries=[entry(h, size=9) for h in hashes[150:260]])),
        post(d, batch(3, tier="l2", backend="fs", shared=True, entries=[entry(h, size=5) for h in hashes[5:25]])),
        post(d, batch(2, inst=inst2, tier="l2", backend="fs", shared=True,
                      entries=[entry(h, size=6) for h in hashes[20:30]])),
        post(d, batch(4, etype="access", backend="", entries=[entry(h, size=0) for h in hashes[:12] * 2])),
        post(d, batch(5, etype="delete", entries=[entry(h, size=0) for h in hashes[:8] + hashes[40:60]])),
        post(d, batch(3, inst=inst2, etype="delete", tier="l2", backend="fs", shared=True,
                      entries=[entry(h, size=0) for h in hashes[18:22]])),
        post(d, batch(1, inst="mp-test-3", tier="l2", backend="s3", entries=[  # token bindings, some entries
            entry(h, size=3, tokens=range(256 * i, 256 * i + (256 if i % 3 else 100)), offset=256 * i if i % 2 else -1)
            if i % 4 else entry(h, size=3) for i, h in enumerate(hashes[60:70] + hashes[280:285])])),
        post(d, batch(6, tier="l2", backend="fs", entries=[entry(h, size=7) for h in hashes[290:295]]
                      + [entry(hashes[1][:62] + "  ", size=7)])),  # 64 characters, 31 bytes: the general form
        post(d, batch(1, inc=INC + 1, entries=[entry(h, size=11) for h in hashes[250:]])),  # restart: L1 fenced
    ]
    d.deregister(inst2)
    out.append(post(d, batch(4, inst=inst2, entries=[entry(h) for h in hashes[:3]])))  # departed: stale
    keys = [W.EncodedObjectKey(chunk_hash_hex=h, model_name=MODEL, kv_rank=WS1) for h in hashes]
    return out + [d.stats(), d.counters(), d.lookup_keys(keys), d.list_keys(limit=10_000),
                  d.list_keys(tier="l1", instance_id="mp-test-1", offset=3, limit=5),
                  d.blend_matches(list(range(256, 768)), MODEL, 1, "")]


def test_fixed_width_entries_apply_as_the_general_form(r, monkeypatch):
    """The fixed-width form of a batch's entries (MPDirectory._uniform, built with numpy) leaves
    the directory exactly as the general form does: the same traffic both ways, everything the
    directory answers compared."""
    import kvlookup.index.mp as M

    used = []
    refs = M._refs
    monkeypatch.setattr(M, "_refs", lambda *a: used.append(1) or refs(*a))
    fast = _traffic(MPDirectory(r))
    assert len(used) >= 5  # every batch after the space is interned, but the first
    r.flushall()
    monkeypatch.setattr(M, "np", None)
    assert _traffic(MPDirectory(r)) == fast
    assert fast[11] == {"applied": 0, "duplicates": 0, "stale": 1}
    # left: the restarted instance's new L1 keys, the shared L2 pool's keys but the 4 deleted, the
    # one L2 key of a 31-byte hash, the 10 keys another instance holds in L2
    assert fast[12]["num_keys"] == fast[15]["total"] == 50 + (25 - 4) + 1 + 10
    assert sum(len(k["token_ids"]) > 0 for k in fast[14]) == 11 and fast[17]  # bindings; a blend match


def test_key_pages_go_with_their_last_key(d, r):
    """A key page holds one field a key and goes with its last one: after every key is deleted no
    page is left (keys.mp_page_key)."""
    hashes = [i.to_bytes(2, "big").hex() * 16 for i in range(300)]
    post(d, batch(1, entries=[entry(hashes[0])]))
    post(d, batch(2, entries=[entry(h) for h in hashes]))  # the fixed-width form: pages 0-2
    assert r.hgetall(K.mp_page_key(1)) == {str(i): f"{h[:3]}{chunk_b64(h)}.1" for i, h in enumerate(hashes[127:255])}
    post(d, batch(3, etype="delete", entries=[entry(h) for h in hashes[128:200]]))
    assert d.list_keys(limit=1000)["total"] == 228
    post(d, batch(4, etype="delete", entries=[entry(h) for h in hashes]))
    assert d.stats()["num_keys"] == 0
    assert [r.exists(K.mp_page_key(p)) for p in range(4)] == [0, 0, 0, 0]


def test_blend_claims_merge_in_redis(d, r):
    """MP_BLEND_ADD adds the claims a fingerprint lacks and keeps what another controller wrote
    meanwhile (the merge happens in Redis, not read-modify-written from Python)."""
    key = K.mp_blend_key(7)
    r.hset(key, "fp1", "b,0;a,256")  # written by another controller
    assert d._blend_add(keys=[key], args=["fp1", "c,512;a,256", "fp2", "z,0"]) == 2
    assert r.hgetall(key) == {"fp1": "a,256;b,0;c,512", "fp2": "z,0"}
    assert d._blend_add(keys=[key], args=["fp1", "b,0"]) == 0
