"""A lookup read by digest (a fresh prompt's first miss: kvlookup.index.tracking.UNTRACKED) takes
the chunks the process's copies have from them (kvlookup.index.staged ``peek``) and reads only
the rest from Redis, on one server and on a cluster: the answer is the one a read of every chunk
gives, the held prefix costs no read of Redis, and a change to a kept chunk or to the new chunk
reaches the next lookup exactly."""

from __future__ import annotations

import pytest

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import staged
from kvlookup.index.copies import MISS
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.index.tracking import UNTRACKED
from tests.support.helpers import wait_for

CPU = "LocalCPUBackend"
N = 200  # chunks: read in two stages (128, then the rest)
HELD = list(range(20_000, 20_000 + N * 256))
FRESH = HELD[:-256] + list(range(90_000, 90_256))  # the same prompt with a new last chunk
HASHES = HashProfile().chunk_hashes(HELD)
NEW = HashProfile().chunk_hashes(FRESH)[-1]


def _untracked(client: Client, tokens: list[int]) -> dict[str, int]:
    token = UNTRACKED.set(True)  # as app.asgi asks it in a thread after a first miss
    try:
        return {m.instance_id: m.matched_prefix_length for m in client.matches(tokens)}
    finally:
        UNTRACKED.reset(token)


@pytest.fixture()
def fleet(r):
    writer = Store(r, purge_grace_s=0)
    for inst in ("a", "b"):
        writer.register_worker(inst, 0)
    writer.apply([("a", 0, CPU, [(ADMIT, h) for h in HASHES])])
    writer.apply([("b", 0, CPU, [(ADMIT, h) for h in HASHES[:100]])])
    return writer


@pytest.mark.parametrize("copies", [True, False])
def test_a_first_miss_reads_only_what_the_copies_lack(r, fleet, monkeypatch, copies):
    monkeypatch.setattr(staged, "MISS_COPIES", copies)
    plain = Client(store=Store(r, purge_grace_s=0))
    client = Client(store=Store(r, purge_grace_s=0, cache_reads=True))
    cached = client.store.records.cached
    held = {"a": N * 256, "b": 100 * 256}
    assert {m.instance_id: m.matched_prefix_length for m in client.matches(HELD)} == held  # read tracked, kept
    fresh = {"a": (N - 1) * 256, "b": 100 * 256}
    assert {m.instance_id: m.matched_prefix_length for m in plain.matches(FRESH)} == fresh
    hits = cached.stats["hits"]
    assert _untracked(client, FRESH) == fresh
    # peek: every chunk but the new one, and the registry version, from the copies
    assert cached.stats["hits"] - hits == (N - 1 + 1 if copies else 0)
    fleet.apply([("a", 0, CPU, [(ADMIT, NEW)])])  # the new chunk stored: never copied, read at once
    assert _untracked(client, FRESH) == {"a": N * 256, "b": 100 * 256}
    fleet.apply([("b", 0, CPU, [(EVICT, HASHES[40])])])  # a kept chunk changed: its copy goes
    want = {"a": N * 256, "b": 40 * 256}
    assert wait_for(lambda: _untracked(client, FRESH), want, timeout=2) == want
    assert {m.instance_id: m.matched_prefix_length for m in plain.matches(FRESH)} == want
    fleet.deregister_worker("a", 0)  # the registry version moves: the kept version goes too
    want = {"b": 40 * 256}
    assert wait_for(lambda: _untracked(client, FRESH), want, timeout=2) == want


def _reads(r, cluster: bool) -> int:
    """Chunk reads sent so far: EVALSHA calls on one server (CHUNK_HEADS; the commands its Lua
    runs are counted apart), ZRANGE and EVALSHA calls on every master of a cluster."""
    if not cluster:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    infos = r.info("commandstats", target_nodes="primaries").values()
    return sum(int(info.get(f"cmdstat_{c}", {}).get("calls", 0)) for info in infos for c in ("evalsha", "zrange"))


def _zranges(r) -> int:
    return int(r.info("commandstats").get("cmdstat_zrange", {}).get("calls", 0))


def test_a_held_prefix_with_a_new_last_chunk_costs_one_read(r, fleet, cluster):
    """The copies hold both stages of the held prefix (200 chunks: 128, then 72): the lookup read by
    digest peeks ahead through them and reads the new chunk's head only (one CHUNK_HEADS on one
    server, one ZRANGE on a cluster)."""
    client = Client(store=Store(r, purge_grace_s=0, cache_reads=True))
    assert {m.instance_id: m.matched_prefix_length for m in client.matches(HELD)} == {"a": N * 256, "b": 100 * 256}
    _untracked(client, FRESH)  # its script loaded
    fresh = HELD[:-256] + list(range(95_000, 95_256))
    before = _reads(r, cluster)
    assert _untracked(client, fresh) == {"a": (N - 1) * 256, "b": 100 * 256}
    assert _reads(r, cluster) - before == 1


def test_an_empty_chunk_read_twice_is_kept_and_a_write_reaches_the_next_lookup(r, fleet, cluster):
    """A chunk nobody holds that lookups keep asking for (here the first chunk of an unheld
    prompt) is kept empty once read tracked twice: the next lookup reads nothing; a write to it
    drops the copy, and the lookup after sees the new holder."""
    from kvlookup.index import keys

    client = Client(store=Store(r, purge_grace_s=0, cache_reads=True))
    cached = client.store.records.cached
    other = list(range(60_000, 60_512))  # two chunks nobody holds
    first = keys.chunk_key(HashProfile().chunk_hashes(other)[0])
    assert client.matches(other) == [] and cached.peek([("ZRANGE", first)]) == [MISS]  # read once: not kept
    assert client.matches(other) == [] and cached.peek([("ZRANGE", first)]) == [()]  # twice: kept empty
    reads = _reads(r, True) if cluster else _reads(r, False) + _zranges(r)
    assert client.matches(other) == []  # answered from the copies: nothing read
    assert (_reads(r, True) if cluster else _reads(r, False) + _zranges(r)) == reads
    fleet.apply([("a", 0, CPU, [(ADMIT, HashProfile().chunk_hashes(other)[0])])])
    want = {"a": 256}
    got = wait_for(lambda: {m.instance_id: m.matched_prefix_length for m in client.matches(other)}, want, timeout=2)
    assert got == want
