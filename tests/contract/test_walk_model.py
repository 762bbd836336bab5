"""The walk (kvlookup.index.walk over staged digest reads) against a plain-Python model of the
matching rule, on random fleets.

Rule (docs/redis-schema.md, README): an instance is credited with its longest run of
consecutive chunks from chunk 0 where every registered TP rank holds the chunk in some
location; per location, the tokens of the matched chunks that location holds (on any rank).
The walk settles runs of chunks with identical holders lazily, so the model pins it on
fleets with gaps, tier moves, ranks that disagree and chunks shared by several instances.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlookup.index import keys, staged
from kvlookup.index.store import ADMIT, Chain, Store

LOCATIONS = ("LocalCPUBackend", "LocalDiskBackend", "GPU")
CHUNK = 4


@st.composite
def fleets(draw):
    """(n_chunks, n_tokens, {(instance, rank): tp}, {(instance, rank, location): set of chunks})."""
    n_chunks = draw(st.integers(1, 10))
    n_tokens = draw(st.integers((n_chunks - 1) * CHUNK + 1, n_chunks * CHUNK))
    tp = {f"i{k}": draw(st.integers(1, 2)) for k in range(draw(st.integers(1, 4)))}
    held = {}
    for inst, ranks in tp.items():
        for rank in range(ranks):
            for loc in draw(st.sets(st.sampled_from(LOCATIONS), min_size=1, max_size=2)):
                # mostly long prefixes (runs to settle), sometimes holes
                upto = draw(st.integers(0, n_chunks))
                chunks = set(range(upto)) - draw(st.sets(st.integers(0, n_chunks - 1), max_size=2))
                held[(inst, rank, loc)] = chunks
    return n_chunks, n_tokens, tp, held


def model(n_chunks, n_tokens, tp, held) -> dict:
    out = {}
    for inst, ranks in tp.items():
        matched, locs = 0, {}
        for c in range(n_chunks):
            if not all(any(c in held.get((inst, r, loc), ()) for loc in LOCATIONS) for r in range(ranks)):
                break
            end = min((c + 1) * CHUNK, n_tokens)
            for loc in LOCATIONS:
                if any(c in held.get((inst, r, loc), ()) for r in range(ranks)):
                    locs[loc] = locs.get(loc, 0) + end - matched
            matched = end
        if matched:
            out[inst] = (matched, locs)
    return out


@pytest.fixture(params=["one stage", "staged"])
def stages(request, monkeypatch):
    """The cluster backend reads chunks in stages; "staged" makes every stage tiny so the walk
    is fed across several rounds (no effect on the single-node Lua walk)."""
    if request.param == "staged":
        monkeypatch.setattr(staged, "FIRST_STAGE", 2)
        monkeypatch.setattr(staged, "STAGE_GROWTH", 2)


def _flush(r) -> None:
    for node in r.get_primaries() if hasattr(r, "get_primaries") else [None]:
        (node.redis_connection if node else r).flushdb()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet=fleets())
def test_walk_matches_model(r, stages, fleet):
    n_chunks, n_tokens, tp, held = fleet
    _flush(r)
    store = Store(r, instance_ttl_s=0)
    hashes = [1000 + c for c in range(n_chunks)]
    for inst, ranks in tp.items():
        for rank in range(ranks):
            store.register_worker(inst, rank)
    store.apply([(inst, rank, loc, [(ADMIT, hashes[c]) for c in sorted(chunks)])
                 for (inst, rank, loc), chunks in held.items() if chunks])
    got = {m.instance_id: (m.matched_prefix_length, m.locations)
           for m in store.lookup([Chain(keys.chunk_prefix(), hashes, CHUNK, n_tokens)])}
    assert got == model(n_chunks, n_tokens, tp, held)
