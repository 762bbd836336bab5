"""Smoke test of bench/: the in-process parts on a tiny fleet (no timing assertions)."""

from __future__ import annotations

import pytest

from kvlookup.bench import feed
from kvlookup.bench.agree import OMITTED, SUFFIX_ONLY, Agreement, classify, truth_tokens
from kvlookup.bench.memory import one_case
from kvlookup.bench.workload import TRACE_HEAD, ChunkHasher, Fleet, chunk_ends, load_trace, replay, request_tokens
from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import Store
from tests.support.helpers import SidecarThread, wait_for


def test_trace_chunk_hashes_equal_lmcache_profile():
    reqs = load_trace(20, path=TRACE_HEAD)
    hasher = ChunkHasher()
    for req in reqs:
        tokens = request_tokens(req)
        assert len(tokens) == req.input_length
        assert hasher.hashes(req) == HashProfile().chunk_hashes(tokens)


def test_classify_names_lmcache_mistakes():
    truth = {"a": 512, "b": 512}
    assert classify(truth, {"a": 512, "b": 512}) == []
    assert classify(truth, {"a": 512}) == [OMITTED]
    assert classify({"a": 512}, {"a": 512, "c": 768}) == [SUFFIX_ONLY]


def test_tiny_fleet_through_sidecar_matches_truth(r):
    reqs = load_trace(60, path=TRACE_HEAD)
    fleet = Fleet(3, cpu_chunks=40, disk_chunks=80)
    hasher = ChunkHasher()
    streams = replay(reqs, fleet, hasher)
    encoded = [feed.encode_stream(fleet.instance_name(i), i, s, 21000 + i) for i, s in enumerate(streams)]
    assert [e.n_ops for e in encoded] == [len(s) + 1 for s in streams]
    client = Client(redis=r, instance_ttl_s=0)
    with SidecarThread(Store(r, instance_ttl_s=0)) as sc:
        workers = feed.register_and_push(encoded, sc.pull_url, sc.reply_url)
        for i, e in enumerate(encoded):
            want = {fleet.instance_name(i): ("LocalCPUBackend", 256)}
            assert wait_for(lambda e=e: client.lookup(e.sentinel_tokens)[1], want, timeout=30) == want
        for w in workers:
            w.close()
    agg = Agreement()
    for i, req in enumerate(reqs):
        tokens = request_tokens(req)
        truth = truth_tokens(fleet.truth(hasher.hashes(req)), chunk_ends(len(tokens)))
        kv = {m.instance_id: [m.location, m.matched_prefix_length] for m in client.matches(tokens)}
        agg.add(i, truth, kv, kv)
    res = agg.result()
    assert res["requests"] == 60
    assert res["right_pct"] == {"kvlookup": 100.0, "lmcache": 100.0}
    assert res["identical_answers_pct"] == 100.0
    assert res["with_a_holder"] > 0


def test_memory_case_structure():
    res = one_case(2000, 2)
    assert res["records"] == 2000
    assert res["holders_per_chunk"] == 2
    assert res["chunk_zset_encoding"] == "listpack"
    assert res["reverse_set_encoding"] == "intset"
    assert set(res) == {"records", "holders_per_chunk", "used_memory_delta", "bytes_per_record",
                        "chunk_zset_bytes_per_chunk", "chunk_zset_encoding", "reverse_sets_bytes_per_record",
                        "reverse_set_encoding"}


def test_gunicorn_conf_names():
    from kvlookup.bench.procs import gunicorn_conf

    assert gunicorn_conf("gevent:2") == ("gevent", 2, 1)
    assert gunicorn_conf("gthread:2x4") == ("gthread", 2, 4)
    with pytest.raises(ValueError, match="is not <worker class>:<workers>"):
        gunicorn_conf("2x4")


@pytest.mark.single_node  # bench stages measures the single-node path
def test_stage_handlers_stop_where_told(redis_url, store):
    from kvlookup.bench.stages import _make_handler
    from kvlookup.index.store import ADMIT, Match
    from tests.conftest import SEED_HASH, SEED_TOKENS

    store.register_worker("a", 0)
    store.apply([("a", 0, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])
    body = b'{"tokens": %s}' % str(SEED_TOKENS).encode()
    assert _make_handler("read", redis_url)(body) == body
    assert list(_make_handler("decode", redis_url)(body)) == SEED_TOKENS  # array('I') from the C decode
    assert [c.hashes for c in _make_handler("hash", redis_url)(body)] == [[SEED_HASH]]
    assert _make_handler("walk", redis_url)(body) == [Match("a", "", 12, {"LocalCPUBackend": 12})]


def test_purge_part_deletes_every_record_of_the_retired_holder(store):
    from kvlookup.bench.purge import purge_case

    res = purge_case(store, 5_000)
    assert (res["records"], res["removed"], res["records_left"]) == (5_000, 5_000, 0)
    assert res["calls"] >= 1 and res["records_per_s"] > 0


def test_fresh_bodies_keep_the_held_chunks_and_draw_the_last_one():
    import json

    from kvlookup.bench.fresh import fresh_split
    prompt = list(range(1000, 1600))  # 600 tokens: chunks 0-255, 256-511 held, 512-599 new
    head, tail = fresh_split(prompt)
    assert tail == 88 and head.startswith('{"tokens": [1000, 1001, ') and head.endswith("1511, ")
    body = json.loads(head + ",".join(["7"] * tail) + "]}")  # as the wrk script builds each body
    assert body["tokens"] == prompt[:512] + [7] * 88
    assert fresh_split([5] * 12) == ('{"tokens": [', 12)  # one partial chunk: all of it new
    assert json.loads('{"tokens": [' + ",".join(["3"] * 12) + "]}")["tokens"] == [3] * 12
