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
