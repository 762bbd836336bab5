"""vLLM writes left in flight while the next batch decodes (sidecar.vllm_writer; the sidecar's
``vllm_overlap_writes``), against a real Redis: order kept, one write in flight at most, a failed
write (a real WRONGTYPE error reply) counted, logged and healed by replay to the exact records,
and the setting off behaving as before."""

from __future__ import annotations

import logging
import random

import pytest

from kvlookup.hashing import vllm as vh
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.sidecar.vllm_ingest import VllmIngest
from tests.support.vllm_helpers import Stream, cleared, removed, stored

N_BLOCKS = 24


def tokens(i: int) -> list[int]:
    return list(range(10_000 + 16 * i, 10_000 + 16 * (i + 1)))


def own(i: int) -> int:
    """kvlookup's chunk hash of root block ``i`` (16 tokens)."""
    return vh.chain(vh.request_root(16), tokens(i), 16)[0]


def engine(i: int) -> int:
    return 5000 + i


def script(seed: int, n: int) -> list[list[dict]]:
    """``n`` batches of root stores and removes over the first N_BLOCKS - 2 blocks (the last two
    are the tests' own), each block stored and removed again in batches that follow one another
    (so writes applied out of order leave other records)."""
    rnd, held, out = random.Random(seed), set(), []
    for _ in range(n):
        batch = []
        for i in rnd.sample(range(N_BLOCKS - 2), 3):
            if i in held:
                batch.append(removed([engine(i)]))
                held.discard(i)
            else:
                batch.append(stored([engine(i)], tokens(i)))
                held.add(i)
        out.append(batch)
    return out


def held_after(batches: list[list[dict]]) -> set[int]:
    held: set[int] = set()
    for batch in batches:
        for ev in batch:
            if ev["type"] == "AllBlocksCleared":
                held.clear()
                continue
            i = ev["block_hashes"][0] - 5000
            (held.add if ev["type"] == "BlockStored" else held.discard)(i)
    return held


def view(r, instance: str) -> set[int]:
    """Root blocks ``instance`` holds on GPU, read straight from the chunk sets (live holders)."""
    dead = set(r.zrange(keys.dead_holders_key(), 0, -1))
    desc = r.hgetall(keys.holders_key())
    out = set()
    for i in range(N_BLOCKS):
        for hid in r.zrange(keys.chunk_key(own(i), "v16"), 0, -1):
            if hid in desc and hid not in dead and keys.parse_holder(desc[hid])[::2] == (instance, "GPU"):
                out.add(i)
    return out


def engine_map(r, instance: str) -> dict[str, str]:
    return r.hgetall(keys.engine_map_key(instance, 0))


def expected_map(held: set[int]) -> dict[str, str]:
    return {str(engine(i)): f"{own(i)}|GPU|v16" for i in held}


@pytest.fixture()
def store(r):
    return Store(r, purge_grace_s=0)


def test_order_kept_one_write_in_flight_and_same_as_off(store, r):
    """Every batch its own write, in flight while the next one decodes: the records, engine map
    and persisted seq are exactly those of the same stream written inline."""
    batches = script(7, 60) + [[cleared()]] + script(8, 20)
    on, off = VllmIngest(store, "pod-on", overlap=True), VllmIngest(store, "pod-off", overlap=False)
    s_on, s_off = Stream(), Stream()
    for k, batch in enumerate(batches):
        if k % 10 == 9:  # some calls carry several consecutive messages: one write for them
            continue
        for ing, s in ((on, s_on), (off, s_off)):
            if k % 10 == 8:
                msgs = []
                for b in (batch, batches[k + 1]):
                    seq = s.send(None, *b)
                    msgs.append([b"kv@pod-a", seq.to_bytes(8, "big"), s.buffer[-1][1]])
                ing.handle_live_many(0, msgs)
            else:
                s.send(ing, *batch)
    assert on.writer.in_flight <= 1 and on.writer.peak == 1 and off.writer.peak == 0
    on.settle()
    assert on.writer.in_flight == 0
    held = held_after(batches)
    assert held  # the script leaves some held
    assert view(r, "pod-on") == view(r, "pod-off") == held
    assert engine_map(r, "pod-on") == engine_map(r, "pod-off") == expected_map(held)
    last = str(len(batches) - 1)
    assert r.hget(keys.instance_key("pod-on"), "seq:0") == r.hget(keys.instance_key("pod-off"), "seq:0") == last
    # 81 batches, 8 pairs written as one, the clear's batch in two (what came before it, then after)
    assert on.writer.submitted == off.writer.submitted == 74
    assert on.rejected == off.rejected == {} and on.resyncs == off.resyncs == {}


def _break_map(r, instance: str):
    """Make the rank's engine map a string (its next HSET answers WRONGTYPE); returns its DUMP."""
    key = keys.engine_map_key(instance, 0)
    dump = r.dump(key)
    r.delete(key)
    r.set(key, "not a hash")
    return dump


def _mend_map(r, instance: str, dump) -> None:
    key = keys.engine_map_key(instance, 0)
    r.delete(key)
    r.restore(key, 0, dump)


@pytest.mark.parametrize("heal", ["live", "catch_up"])
def test_failed_write_counted_logged_and_replayed(store, r, caplog, heal, cluster):
    """A write left in flight gets an error reply (WRONGTYPE from Redis): counted
    (``write_failed``), logged, the rank back to the seq before it; replay (the next live
    message's gap, or the catch-up the loop schedules) writes it again: exact records. (A
    Redis Cluster writes at once: the same failure is the handler error it always was.)"""
    reason = "handler_error" if cluster else "write_failed"
    s = Stream()
    ing = VllmIngest(store, "pod-a", replay=s.replay, overlap=True)
    batches = script(3, 30)
    for batch in batches[:20]:
        s.send(ing, *batch)
    ing.settle()
    dump = _break_map(r, "pod-a")
    failing = [stored([engine(i)], tokens(i)) for i in (N_BLOCKS - 1, N_BLOCKS - 2)]
    with caplog.at_level(logging.WARNING, "kvlookup.sidecar.vllm_ingest"):
        seq = s.send(ing, *failing)  # left in flight; fails there
        ing.settle()
    assert ing.rejected == {reason: 1} and ing.writer.failed == (0 if cluster else 1)
    assert ing.ranks[0].last == seq - 1 and ing.replay_due == (set() if cluster else {0})
    assert any(f"write of seq {seq}..{seq} failed (ResponseError" in m for m in caplog.messages) != cluster
    _mend_map(r, "pod-a", dump)
    all_batches = batches[:20] + [failing] + batches[20:]
    if heal == "catch_up":
        assert ing.catch_up(0) == "caught_up"
        assert s.replays == [seq - 1]
        for batch in batches[20:]:
            s.send(ing, *batch)
    else:
        for batch in batches[20:]:
            s.send(ing, *batch)
        assert s.replays == [seq]  # the gap from the failed seq, replayed once
    ing.settle()
    held = held_after(all_batches)
    assert view(r, "pod-a") == held
    assert engine_map(r, "pod-a") == expected_map(held)
    assert r.hget(keys.instance_key("pod-a"), "seq:0") == str(len(all_batches) - 1)
    assert ing.rejected == {reason: 1} and ing.resyncs == {}


def test_off_writes_before_returning_and_fails_as_before(store, r):
    """Setting off: each write is done when handle_live returns (no settle needed), nothing is
    left in flight, and a failed write is the handler error it was (the next message's gap
    replays it)."""
    s = Stream()
    ing = VllmIngest(store, "pod-a", replay=s.replay, overlap=False)
    batches = script(5, 12)
    for k, batch in enumerate(batches[:8]):
        s.send(ing, *batch)
        assert ing.writer.in_flight == 0
        assert view(r, "pod-a") == held_after(batches[:k + 1])
    dump = _break_map(r, "pod-a")
    failing = [stored([engine(N_BLOCKS - 1)], tokens(N_BLOCKS - 1)), removed([engine(N_BLOCKS - 1)]),
               stored([engine(N_BLOCKS - 2)], tokens(N_BLOCKS - 2))]
    seq = s.send(ing, *failing)
    assert ing.rejected == {"handler_error": 1} and ing.ranks[0].last == seq - 1 and not ing.replay_due
    _mend_map(r, "pod-a", dump)
    for batch in batches[8:]:
        s.send(ing, *batch)
    assert s.replays == [seq]
    held = held_after(batches[:8] + [failing] + batches[8:])
    assert held_after([failing]) == {N_BLOCKS - 2}
    assert view(r, "pod-a") == held
    assert engine_map(r, "pod-a") == expected_map(held)
    assert ing.writer.peak == 0
