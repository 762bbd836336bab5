"""POST /lookup/explain: the exact explanation of every reason a match stops (both backends)."""

from __future__ import annotations

import pytest

from kvlookup import kinds
from kvlookup.app import create_app
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.explain import iso
from kvlookup.index.store import ADMIT, EVICT

CPU = "LocalCPUBackend"
TOKENS = list(range(1000, 1600))  # 600 tokens: chunks 256/256/88
H = HashProfile().chunk_hashes(TOKENS)
T0 = 1_795_994_464_987


@pytest.fixture()
def explain(redis_settings, store):
    def call(tokens=TOKENS, body=None, **settings):
        http = create_app({**redis_settings, **settings}).test_client()
        resp = http.post("/lookup/explain", json={"tokens": tokens, **(body or {})})
        assert resp.status_code == 200, resp.get_json()
        return resp.get_json()
    return call


def admit(store, inst, hashes, wid=0, now_ms=None):
    store.apply([(inst, wid, CPU, [(ADMIT, h) for h in hashes])], now_ms=now_ms)


def stop_of(out, inst):
    return next(e for e in out["instances"] if e["instance_id"] == inst)["stop"]


def test_complete_match_and_answer_is_the_lookup_answer(store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    out = explain()
    assert {k: v for k, v in out["answer"].items() if k != "event_id"} == {"inst-a": [CPU, 600]}
    assert (out["tokens"], out["chunks"], out["hashed_tokens"], out["cause"]) == (600, 3, 600, "hit")
    assert out["profile"] == {"chunk_size": 256, "save_unfull_chunk": True, "none_hash": 0, "extra_keys": "empty",
                              "algorithm": "builtin"}
    assert out["instances"] == [{"instance_id": "inst-a", "worker_id": "", "space": "", "matched_prefix_length": 600,
                                 "matched_chunks": 3, "stop": None}]
    assert out["diagnosis"] == ["instance inst-a matched all 600 tokens"]


def test_never_stored(store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H[:1])
    out = explain()
    why = f"chunk 1 (tokens 256-512, hash {H[1]}) was never stored there"
    assert stop_of(out, "inst-a") == {"chunk": 1, "token_offset": 256, "chunk_hash": str(H[1]),
                                      "reason": "never_stored", "explanation": why}
    assert out["diagnosis"] == [f"instance inst-a matched 256 of 600 tokens: {why}"]


def test_evicted_and_when(store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    store.apply([("inst-a", 0, CPU, [(EVICT, H[0])])], now_ms=T0)
    out = explain()
    why = f"chunk 0 (tokens 0-256, hash {H[0]}) was evicted from {CPU} at 2026-11-29T23:21:04.987+00:00"
    assert iso(T0) == "2026-11-29T23:21:04.987+00:00"
    assert stop_of(out, "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]), "reason": "evicted",
                                      "at_ms": T0, "location": CPU, "explanation": why}
    assert out["diagnosis"] == [f"instance inst-a matched 0 of 600 tokens: {why}"]
    assert out["cause"] == "evicted"


def test_ranks(store, explain):
    for wid in (0, 1, 2):
        store.register_worker("inst-tp", wid, "127.0.0.1", 8001 + wid)
    for wid in (0, 1, 2):
        admit(store, "inst-tp", H if wid == 0 else H[:1], wid=wid)
    out = explain()
    why = f"chunk 1 (tokens 256-512, hash {H[1]}) is held by rank(s) 0 only; rank(s) 1, 2 lack it, " \
          "and every TP rank must hold a chunk"
    assert stop_of(out, "inst-tp") == {"chunk": 1, "token_offset": 256, "chunk_hash": str(H[1]), "reason": "ranks",
                                       "ranks_holding": ["0"], "ranks_missing": ["1", "2"], "explanation": why}
    assert out["diagnosis"] == [f"instance inst-tp matched 256 of 600 tokens: {why}"]


def test_instance_not_alive(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    r.zadd(keys.alive_key(), {"inst-a": T0})  # its lease ran out at T0
    out = explain()
    why = ("its liveness lease expired at 2026-11-29T23:21:04.987+00:00 (no sidecar renews it), "
           "so its chunks do not count")
    assert stop_of(out, "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                      "reason": "instance_not_alive", "at_ms": T0, "explanation": why}
    assert (out["diagnosis"], out["cause"]) == ([f"instance inst-a matched 0 of 600 tokens: {why}"], "dead_instance")


def test_worker_silent(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    store.heartbeat_worker("inst-a", 0, now=T0 / 1000)
    out = explain(worker_ttl_s=5)
    why = "worker 0 sent its last heartbeat at 2026-11-29T23:21:04.987+00:00, more than worker_ttl_s ago, " \
          "so its chunks do not count"
    assert stop_of(out, "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                      "reason": "worker_silent", "at_ms": T0, "explanation": why}


def _retired_at(r, hid) -> int:
    return int(r.zscore(keys.dead_holders_key(), hid))


def test_deregistered_holder_of_chunk_0_is_named_as_gone(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    hid = store.holder_id("inst-a", 0, CPU)
    store.register_worker("inst-keep", 0, "127.0.0.1", 8002)  # the instance set stays non-empty
    assert store.deregister_worker("inst-a", 0)
    t = _retired_at(r, hid)
    out = explain()
    why = f"worker 0 deregistered at {iso(t)}, so its chunks no longer count"
    assert stop_of(out, "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                      "reason": "deregistered", "at_ms": t, "explanation": why}
    assert out["diagnosis"] == [f"instance inst-a matched 0 of 600 tokens: {why}"]


def test_after_the_purge_the_departures_log_names_who_left(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    hid = store.holder_id("inst-a", 0, CPU)
    store.register_worker("inst-keep", 0, "127.0.0.1", 8002)
    assert store.deregister_worker("inst-a", 0)
    t = _retired_at(r, hid)
    while store.purge():
        pass
    assert r.exists(keys.chunk_key(H[0])) == 0  # the records are gone
    out = explain()
    assert out["instances"] == []
    assert out["diagnosis"] == [f"no instance holds chunk 0 (tokens 0-256, hash {H[0]}) of this prompt, under this "
                                "or any other hash profile tried; workers that left in the last hour, whose records "
                                f"are purged (one may have held it): instance inst-a worker 0 deregistered at {iso(t)}"]


def test_reaped(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    hid = store.holder_id("inst-a", 0, CPU)
    store.suspect("inst-a", 0, 1)  # evidence it is gone, deadline long past
    assert store.reap_worker("inst-a", 0)
    t = _retired_at(r, hid)
    assert r.zscore(keys.departures_key(), "0\tinst-a\treaped") == t
    why = f"worker 0 was reaped at {iso(t)}, so its chunks no longer count"
    assert stop_of(explain(), "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                            "reason": "reaped", "at_ms": t, "explanation": why}


def test_new_epoch(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", H)
    hid = store.holder_id("inst-a", 0, CPU)
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)  # the engine restarted cold
    t = _retired_at(r, hid)
    why = f"worker 0 re-registered at {iso(t)} (epoch 2), so its earlier chunks no longer count"
    assert stop_of(explain(), "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                            "reason": "new_epoch", "at_ms": t, "epoch": 2, "explanation": why}


def test_retired_by_full_sync(r, store, explain):
    store.register_worker("inst-a", 0, "127.0.0.1", 8001, now=T0 / 1000)
    admit(store, "inst-a", H)
    hid = store.holder_id("inst-a", 0, CPU)
    store.retire_location("inst-a", 0, CPU)
    t = _retired_at(r, hid)
    why = f"worker 0's chunks in {CPU} were retired at {iso(t)} (a full sync began)"
    assert stop_of(explain(), "inst-a") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]),
                                            "reason": "retired", "at_ms": t, "location": CPU, "explanation": why}


def test_chunk_size_mismatch_names_the_setting_and_instances(store, explain):
    h512 = HashProfile(chunk_size=512).chunk_hashes(TOKENS)
    for inst in ("inst-a", "inst-b"):
        store.register_worker(inst, 0, "127.0.0.1", 8001)
        admit(store, inst, h512)
    out = explain()
    assert out["answer"].keys() == {"event_id"}
    assert out["profiles"] == [{"chunk_size": 512, "setting": "hash.chunk_size: 512", "instances": {
        "inst-a": {"chunks": 2, "tokens": 600}, "inst-b": {"chunks": 2, "tokens": 600}}}]
    assert out["diagnosis"] == ["instances inst-a, inst-b store chunk_size 512; this controller uses chunk_size 256: "
                                "set hash.chunk_size: 512"]
    assert stop_of(out, "inst-b") == {"chunk": 0, "token_offset": 0, "chunk_hash": str(H[0]), "reason": "hash_profile",
                                      "explanation": "it holds this prompt's first chunks under another hash profile "
                                                     "(chunk_size 512)", "fix": "hash.chunk_size: 512"}
    assert out["cause"] == "profile_mismatch_suspected"


def test_none_hash_seed_and_extra_keys_variants(store, explain):
    seeded = HashProfile.from_settings({"none_hash": "seed", "hash_seed": "123", "extra_keys": "none"})
    store.register_worker("inst-old", 0, "127.0.0.1", 8001)
    admit(store, "inst-old", seeded.chunk_hashes(TOKENS))
    out = explain(hash={"hash_seed": "123"})
    assert out["profiles"] == [{"none_hash": "seed", "extra_keys": "none",
                                "setting": "hash.none_hash: seed, hash.extra_keys: none",
                                "instances": {"inst-old": {"chunks": 3, "tokens": 600}}}]
    assert out["diagnosis"] == ["instance inst-old stores none_hash seed, extra_keys none; this controller uses "
                                "none_hash 0, extra_keys empty: set hash.none_hash: seed, hash.extra_keys: none"]


def test_partial_chunk_not_hashed(store, explain):
    p = HashProfile(save_unfull_chunk=False)
    store.register_worker("inst-a", 0, "127.0.0.1", 8001)
    admit(store, "inst-a", p.chunk_hashes(TOKENS))
    out = explain(hash={"save_unfull_chunk": False})
    why = "the remaining 88 tokens (from 512) are a partial chunk, which is not hashed"
    assert stop_of(out, "inst-a") == {"chunk": 2, "token_offset": 512, "chunk_hash": None,
                                      "reason": "partial_chunk_not_hashed", "explanation": why}
    assert out["diagnosis"] == [f"instance inst-a matched 512 of 600 tokens: {why}"]


def test_prompt_shorter_than_one_chunk(store, explain):
    out = explain(tokens=TOKENS[:100], hash={"save_unfull_chunk": False})
    assert (out["chunks"], out["instances"], out["cause"]) == (0, [], "short_prompt")
    assert out["diagnosis"] == ["the prompt has 100 tokens, fewer than one chunk (256), and partial chunks are not "
                                "hashed (save_unfull_chunk: false): nothing to look up"]


def test_nothing_anywhere(store, explain):
    out = explain()
    assert (out["instances"], out["profiles"], out["cause"]) == ([], [], "no_holder")
    assert out["diagnosis"] == [f"no instance holds chunk 0 (tokens 0-256, hash {H[0]}) of this prompt, under this "
                                "or any other hash profile tried, nor held it recently"]


def test_other_namespace(r, store, explain):
    from kvlookup.hashing import vllm as vh
    store.register_worker("vl", 0, "127.0.0.1", 8001, kind=kinds.VLLM)
    r.hset(keys.block_sizes_key(), keys.worker_member("vl", 0), 16)
    base = vh.chain(vh.request_root(16), TOKENS, 16)
    store.apply([("vl", 0, "GPU", [(ADMIT, h) for h in base])], space=keys.vllm_space(16))
    out = explain(body={"lora_name": "sql"})
    assert out["namespaces"] == [{"block_size": 16, "lora_name": None, "cache_salt": None,
                                  "setting": "no lora_name, no cache_salt",
                                  "instances": {"vl": {"chunks": 4, "tokens": 64}}}]
    assert out["diagnosis"][0] == ("instance vl holds this prompt's first blocks (block size 16) under no lora_name, "
                                   "no cache_salt, not this request's namespace")
    entry = next(e for e in out["instances"] if e["space"] == "v16")
    assert entry["stop"]["reason"] == "other_namespace"
    assert entry["stop"]["explanation"] == "it holds this prompt's first blocks under another namespace (block_size 16)"
    assert out["cause"] == "namespace"


def test_bad_bodies_are_the_lookup_errors(redis_settings, store):
    http = create_app(redis_settings).test_client()
    for raw, error in ((b"{}", "missing required field `tokens`"),
                       (b'{"tokens": [1, "2"]}', "Expected `int`, got `str` - at `$.tokens[1]`")):
        resp = http.post("/lookup/explain", data=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and error in resp.get_json()["error"]
    assert http.get("/lookup/explain").status_code == 405


def test_miss_cause_metrics(redis_settings, store):
    from kvlookup.app import fleet_metrics
    def count(*labels):
        return fleet_metrics.OUTCOMES.labels(*labels)._value.get()

    http = create_app({**redis_settings, "lookup_cache": "on"}).test_client()
    before = count("miss", "no_holder")
    http.post("/lookup", json={"tokens": TOKENS})
    assert count("miss", "no_holder") == before + 1
