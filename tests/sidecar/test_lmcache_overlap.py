"""LMCache slices left in flight while the next messages decode (sidecar.lmcache_ingest with
``overlap``; the sidecar's ``lmcache_overlap_writes``), against a real Redis: the records of
inline writes, one slice in flight at most, a registration settling the slice before it, a
failed write (a real WRONGTYPE error reply) put back at the head of the queue in order, and
the setting refused when invalid."""

from __future__ import annotations

import random

import pytest
import redis

from kvlookup.config import load
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.sidecar.lmcache_ingest import MAX_REDIS_FAILURES, LMCacheIngest
from kvlookup.wire import lmcache as proto

CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"
HASHES = [7_000_000 + i for i in range(60)]


def batch(inst: str, loc: str, ops: list[tuple[str, int]], seq: int) -> bytes:
    return proto.encode(proto.BatchedKVOperationMsg(
        inst, 0, loc, [proto.OpEvent(op, h, seq + k) for k, (op, h) in enumerate(ops)]))


def register(inst: str) -> bytes:
    return proto.encode(proto.RegisterMsg(inst, 0, "127.0.0.1", 9000, None))


def script(seed: int) -> list[tuple[str, bytes]]:
    """("push" | "request", frame) steps: random admits and evicts of two instances' two tiers,
    each chunk admitted and evicted again in frames that follow one another, and a re-registration
    (a new epoch: what was queued before it is moot) of one instance in the middle."""
    rnd, held, seq, out = random.Random(seed), set(), {}, []
    for step in range(40):
        if step == 25:
            out.append(("request", register("i-1")))
        inst, loc = rnd.choice(["i-0", "i-1"]), rnd.choice([CPU, DISK])
        ops = []
        for h in rnd.sample(HASHES, 12):
            k = (inst, loc, h)
            ops.append(("evict" if k in held else "admit", h))
            (held.discard if k in held else held.add)(k)
        s = seq.get((inst, loc), 0)
        seq[(inst, loc)] = s + len(ops)
        out.append(("push", batch(inst, loc, ops, s)))
    return out


def snapshot(r) -> tuple[dict, dict]:
    """Every chunk set's members and every holder's record count."""
    members = {h: sorted(r.zrange(keys.chunk_key(h), 0, -1)) for h in HASHES}
    return members, r.hgetall(keys.records_key())


def play(r, overlap: bool, steps, budget: int) -> tuple[tuple[dict, dict], int]:
    """Apply the steps on a fresh index, flushing ``budget`` ops after each; returns the final
    snapshot and the most slices seen in flight at once."""
    r.flushdb()
    ingest = LMCacheIngest(Store(r, purge_grace_s=0), "sc", overlap=overlap)
    for inst in ("i-0", "i-1"):
        ingest.handle_request(register(inst))
    peak = 0
    for kind, frame in steps:
        if kind == "request":
            ingest.handle_request(frame)
        else:
            ingest.handle_push([frame])
        ingest.flush(budget)
        peak = max(peak, ingest._in_flight is not None)
    while ingest.queued_ops:
        ingest.flush(budget)
    ingest.settle()
    return snapshot(r), peak


@pytest.mark.parametrize("seed", [1, 2])
def test_overlap_leaves_the_records_of_inline_writes(r, seed):
    steps = script(seed)
    inline, peak_off = play(r, False, steps, 7)
    overlapped, peak_on = play(r, True, steps, 7)
    assert (peak_off, peak_on) == (0, 1)  # a cluster's write is done at once, its replies read later
    assert overlapped == inline
    assert any(inline[0].values())  # the script leaves records to compare


@pytest.mark.single_node  # a cluster writes at once (no slice in flight)
def test_a_budgeted_flush_leaves_one_slice_in_flight_and_a_full_flush_none(r):
    store = Store(r, purge_grace_s=0)
    ingest = LMCacheIngest(store, "sc", overlap=True)
    ingest.handle_request(register("i-0"))
    ingest.handle_push([batch("i-0", CPU, [("admit", h) for h in HASHES[:10]], 0)])
    assert ingest.flush(4) == 4
    assert ingest._in_flight is not None and ingest.queued_ops == 10  # in flight still counts
    assert ingest.flush(4) == 4 and ingest._in_flight.ops == 4
    assert ingest.flush() == 2 and ingest._in_flight is None  # all: written before it returns
    assert ingest.queued_ops == 0
    assert all(r.zcard(keys.chunk_key(h)) == 1 for h in HASHES[:10])


@pytest.mark.single_node  # a cluster writes at once (no slice in flight)
def test_a_registration_settles_the_slice_sent_before_it(r):
    store = Store(r, purge_grace_s=0)
    ingest = LMCacheIngest(store, "sc", overlap=True)
    ingest.handle_request(register("i-0"))
    old = store.holder_id("i-0", 0, CPU)
    ingest.handle_push([batch("i-0", CPU, [("admit", h) for h in HASHES[:10]], 0)])
    ingest.flush(100)
    assert ingest._in_flight is not None
    ingest.handle_request(register("i-0"))  # a new epoch: the old holder is retired after its write
    assert ingest._in_flight is None and ingest.queued_ops == 0
    new = store.holder_id("i-0", 0, CPU)
    assert new != old
    assert r.hget(keys.records_key(), old) == "10"  # written to the epoch that sent them, as inline
    assert r.hget(keys.records_key(), new) is None


@pytest.mark.single_node  # a cluster writes at once (no slice in flight)
def test_a_write_failing_in_flight_goes_back_to_the_head_of_the_queue(r):
    store = Store(r, purge_grace_s=0)
    ingest = LMCacheIngest(store, "sc", overlap=True)
    ingest.handle_request(register("i-0"))
    hid = store.holder_id("i-0", 0, CPU)
    bad = keys.holder_chunks_key(hid, keys.chunk_bucket(str(HASHES[0])))  # the call's first write
    r.set(bad, "not a set")  # APPLY_OPS meets WRONGTYPE before it wrote anything
    ingest.handle_push([batch("i-0", CPU, [("admit", h) for h in HASHES[:10]], 0)])
    ingest.flush(10)  # sent; the error is in its reply
    ingest.handle_push([batch("i-0", CPU, [("evict", h) for h in HASHES[:3]], 10)])
    for again in (True, False):
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            ingest.flush(10)  # settles the failed slice: put back at the head, the error raised
        assert ingest._in_flight is None and ingest.queued_ops == 13
        if again:
            ingest.flush(10)  # the same slice sent again, the evicts still behind it
    r.delete(bad)
    ingest.flush()
    assert ingest.queued_ops == 0
    assert [h for h in HASHES[:10] if r.zscore(keys.chunk_key(h), hid) is not None] == HASHES[3:10]
    assert r.hget(keys.records_key(), hid) == "7"


@pytest.mark.single_node  # a cluster writes at once (no slice in flight)
def test_a_write_failing_in_flight_again_and_again_is_dropped(r):
    store = Store(r, purge_grace_s=0)
    ingest = LMCacheIngest(store, "sc", overlap=True)
    ingest.handle_request(register("i-0"))
    r.set(keys.chunk_key(HASHES[0]), "x")
    ingest.handle_push([batch("i-0", CPU, [("admit", h) for h in HASHES[:4]], 0)])
    for _ in range(MAX_REDIS_FAILURES - 1):
        ingest.flush(10)  # sent
        with pytest.raises(redis.ResponseError):
            ingest.flush(10)  # failed: put back
        assert ingest.queued_ops == 4
    ingest.flush(10)
    ingest.flush(10)  # failure 5 drops the slice instead of wedging the sidecar
    assert ingest.queued_ops == 0 and ingest._in_flight is None


def test_off_writes_each_slice_before_returning(r):
    ingest = LMCacheIngest(Store(r, purge_grace_s=0), "sc")
    assert ingest.overlap is False
    ingest.handle_request(register("i-0"))
    ingest.handle_push([batch("i-0", CPU, [("admit", h) for h in HASHES[:10]], 0)])
    assert ingest.flush(4) == 4 and ingest._in_flight is None and ingest.queued_ops == 6


def test_the_setting_is_refused_when_invalid_naming_it():
    assert load(None, overrides={}, env={}).lmcache_overlap_writes is True
    assert load(None, overrides={"lmcache_overlap_writes": "off"}, env={}).lmcache_overlap_writes is False
    with pytest.raises(ValueError, match="lmcache_overlap_writes"):
        load(None, overrides={"lmcache_overlap_writes": "sometimes"}, env={})
