"""Whole-bucket copies of the LMCache MP directory (kvlookup.index.mp_copies) on one Redis and on a
cluster: ``/directory/lookup``'s tokens form answered from the copies is byte for byte the answer
of a directory without copies, after every kind of write from another connection (stores with
token bindings, deletes, accesses, shared placements, an incarnation change, a departure fence,
a new registration); a lookup whose buckets are all copied reads nothing from Redis (and is
answered under LOCAL_ONLY, as app.asgi's event loop asks); the field bound is kept."""

from __future__ import annotations

import msgspec
import pytest

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index.copies import MISS
from kvlookup.index.mp import MPDirectory
from kvlookup.index.mp_copies import FieldCopies
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis
from kvlookup.wire import lmcache_mp as W
from tests.support.helpers import wait_for

MODEL = "copies-model"
INC = 1796108700
PROMPT = list(range(5000, 5000 + 40 * 256))  # 40 chunks: ~40 buckets
HASHES = mphash.chunk_hashes_hex(PROMPT)
WS1 = mphash.kv_rank(1, 0)
R2 = [mphash.kv_rank(2, r) for r in range(2)]


def key(h, rank=WS1):
    return {"chunk_hash_hex": h, "model_name": MODEL, "kv_rank": rank, "object_group_id": 0, "cache_salt": ""}


def batch(seq, etype="store", tier="l1", backend="dram", entries=(), inst="mp-a", inc=INC, **kw):
    return {"instance_id": inst, "incarnation": inc, "seq": seq, "event_type": etype, "tier": tier,
            "backend": backend, "entries": list(entries), **kw}


def entry(h, size=1024, tokens=(), offset=-1, rank=WS1):
    return {"key": key(h, rank), "size_bytes": size, "token_ids": list(tokens), "token_offset": offset}


def post(d: MPDirectory, *batches) -> dict:
    req = W.decode(msgspec.json.encode({"batches": list(batches)}), W.CacheEventsRequest)
    return d.apply(req.batches)


def chunk_tokens(i: int) -> list[int]:
    return PROMPT[i * 256:(i + 1) * 256]


@pytest.fixture()
def dirs(r):
    """(writer, plain reader, fenced copies, unfenced copies): separate directories on one client."""
    writer, plain = MPDirectory(r), MPDirectory(r)
    fenced = MPDirectory(r, copy_fields=100_000, copy_fence=True)
    unfenced = MPDirectory(r, copy_fields=100_000)
    yield writer, plain, fenced, unfenced
    for d in (fenced, unfenced):
        reads = d.bucket_reads()
        for m in list(reads._masters.values()) if hasattr(reads, "_masters") else [reads]:
            m.close()


def answers(d: MPDirectory, ws: int = 1, model: str = MODEL) -> bytes:
    """The tokens-form answer; with copies, after the copier has copied what this one lacked, so
    the next answer comes from the copies."""
    out = d.lookup_tokens_json(PROMPT, model, ws)
    if d.copy_fields:
        assert wait_for(d.copier().idle, True)
    return out


def same(plain, *copied, ws: int = 1) -> bytes:
    want = answers(plain, ws)
    for d in copied:
        assert answers(d, ws) == want
    return want


def test_copies_answer_as_redis_does_after_every_kind_of_write(dirs):
    writer, plain, fenced, unfenced = dirs
    w = {"seq": 0}

    def send(*bs):
        out = post(writer, *bs)
        assert out["stale"] == 0, out
        return out

    def nxt():
        w["seq"] += 1
        return w["seq"]

    assert answers(plain) == answers(fenced)  # nothing stored: every bucket copied empty
    send(batch(nxt(), entries=[entry(h, tokens=chunk_tokens(i), offset=i * 256) for i, h in enumerate(HASHES[:30])]))
    same(plain, fenced)
    send(batch(nxt(), tier="l2", backend="fs", entries=[entry(h, size=7) for h in HASHES[10:35]]))
    same(plain, fenced)
    send(batch(nxt(), etype="delete", entries=[entry(h, size=0) for h in HASHES[5:8]]))
    same(plain, fenced)
    send(batch(nxt(), etype="access", backend="", entries=[entry(h, size=0) for h in HASHES[:12] * 2]))
    got = same(plain, fenced)
    assert b'"access_count":2' in got
    # a shared pool, last reporter wins
    send(batch(nxt(), tier="l2", backend="s3", shared=True, entries=[entry(h, size=3) for h in HASHES[20:40]]))
    post(writer, batch(1, inst="mp-b", inc=9, tier="l2", backend="s3", shared=True,
                       entries=[entry(h, size=4) for h in HASHES[25:30]]))
    same(plain, fenced)
    # a new incarnation drops mp-a's L1 placements (L2 stays)
    w["seq"] = 0
    send(batch(nxt(), inc=INC + 1, tier="l2", backend="fs", entries=[entry(HASHES[0], size=1)]))
    got = same(plain, fenced)
    assert b'"tier":"l1"' not in got and b'"tier":"l2"' in got
    send(batch(nxt(), inc=INC + 1, entries=[entry(h) for h in HASHES[:4]]))
    same(plain, fenced)
    writer.deregister("mp-a")  # the departure fence removes its L1 placements
    got = same(plain, fenced)
    assert b'"tier":"l1"' not in got
    writer.register(W.RegisterRequest(instance_id="mp-a", ip="127.0.0.1", http_port=1))
    send(batch(nxt(), inc=INC + 1, entries=[entry(h) for h in HASHES[30:32]]))
    same(plain, fenced)
    # the unfenced copies see every change once its invalidation has arrived
    assert wait_for(lambda: answers(unfenced), answers(plain)) == answers(plain)


def test_world_size_two_and_another_model(dirs):
    writer, plain, fenced, _ = dirs
    post(writer, batch(1, entries=[entry(h, rank=R2[0]) for h in HASHES[:20]]),
         batch(2, tier="l2", backend="fs", entries=[entry(h, rank=R2[1]) for h in HASHES[:15]]))
    same(plain, fenced, ws=2)
    same(plain, fenced, ws=1)
    assert answers(fenced, model="another") == answers(plain, model="another")
    post(writer, batch(3, etype="delete", entries=[entry(h, size=0, rank=R2[0]) for h in HASHES[:3]]))
    same(plain, fenced, ws=2)


def test_all_copied_reads_nothing_and_answers_locally(dirs):
    writer, plain, _, unfenced = dirs
    post(writer, batch(1, entries=[entry(h, tokens=chunk_tokens(i), offset=i * 256) for i, h in enumerate(HASHES)]))
    want = answers(plain)
    assert answers(unfenced) == want  # the chunks read, every bucket copied after
    stats = unfenced.bucket_reads().stats
    misses = stats["misses"]
    buckets = len({K.mp_bucket(h) for h in HASHES})
    token = LOCAL_ONLY.set(True)
    try:
        assert answers(unfenced) == want
    finally:
        LOCAL_ONLY.reset(token)
    assert unfenced.bucket_reads().stats["misses"] == misses  # nothing sent
    assert unfenced.bucket_reads().stats["hits"] >= buckets
    assert unfenced.reads_locally()
    post(writer, batch(2, etype="delete", entries=[entry(HASHES[7], size=0)]))

    def local_try():
        token = LOCAL_ONLY.set(True)
        try:
            return answers(unfenced)
        except NeedsRedis:
            return "needs redis"
        finally:
            LOCAL_ONLY.reset(token)

    assert wait_for(local_try, "needs redis") == "needs redis"  # its bucket's copy went
    assert answers(unfenced) == answers(plain) != want  # its chunk read, its bucket copied again
    assert local_try() == answers(plain)


def test_field_bound():
    c = FieldCopies(max_keys=10, max_fields=5)
    c.put("a", {"x": "1", "y": "2"})
    c.put("b", {"x": "1", "y": "2"})
    assert c.fields == 4
    c.put("c", {"x": "1", "y": "2"})  # over 5: the oldest goes
    assert c.fields == 4 and c.get("a") is MISS and c.get("b") == {"x": "1", "y": "2"} and len(c) == 2
    c.put("big", {str(i): "" for i in range(6)})  # larger than the whole bound: never kept
    assert len(c) == 2 and c.fields == 4
    c.pop("b")
    assert c.fields == 2
    c.clear()
    assert c.fields == 0 and len(c) == 0
    with pytest.raises(ValueError, match="mp_copy_fields"):
        FieldCopies(10, 0)


def test_bucket_bound_keeps_answers_right(r):
    writer, plain = MPDirectory(r), MPDirectory(r)
    small = MPDirectory(r, copy_fields=8, copy_fence=True)  # fewer fields than the prompt's buckets hold
    post(writer, batch(1, entries=[entry(h) for h in HASHES]),
         batch(2, tier="l2", backend="fs", entries=[entry(h) for h in HASHES]))
    for _ in range(3):
        assert answers(small) == answers(plain)
    reads = small.bucket_reads()
    for copies in [m._copies for m in getattr(reads, "_masters", {}).values()] or [reads._copies]:
        assert copies.fields <= 8


def test_the_setting_is_checked():
    from kvlookup.config import load

    assert load(None, overrides={}, env={}).mp_copy_fields == 200_000
    assert load(None, overrides={"mp_copy_fields": 0}, env={}).mp_copy_fields == 0
    for bad in (-1, "many"):
        with pytest.raises(ValueError, match="mp_copy_fields"):
            load(None, overrides={"mp_copy_fields": bad}, env={})
