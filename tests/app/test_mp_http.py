"""The LMCache MP coordinator paths on the controller (app/coordinator.py): bodies, statuses
and error shapes as the real coordinator answers them (research doc §1-§4)."""

from __future__ import annotations

import json

import pytest

from kvlookup.app import coordinator, create_app
from tests.index.test_mp_index import C0, C1, INC, MODEL, batch, entry, key


@pytest.fixture()
def make_http(redis_settings):
    """Test clients of in-process apps; their MP reapers (a real-time daemon thread each, started
    by the first MP request) stop with the test, so none departs a later test's instances."""
    apps = []

    def make():
        apps.append(create_app({**redis_settings, "instance_ttl_s": 0}))
        return apps[-1].test_client()

    yield make
    for app in apps:
        app.extensions["kvlookup"]["mp_reaper"].stop()


@pytest.fixture()
def http(make_http):
    return make_http()


def send(http, method, path, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    resp = http.open(path, method=method, data=data, headers={"Content-Type": "application/json"})
    return resp.status_code, (resp.get_json(silent=True) if resp.data else None)


REG = {"instance_id": "mp-test-1", "ip": "127.0.0.1", "http_port": 19510}


def test_registration_heartbeat_deregistration(http):
    assert send(http, "POST", "/instances", REG) == (200, {"instance_id": "mp-test-1", "re_registered": False})
    assert send(http, "POST", "/instances", REG) == (200, {"instance_id": "mp-test-1", "re_registered": True})
    status, body = send(http, "POST", "/instances", {"ip": "127.0.0.1", "http_port": 1})
    assert status == 200 and body["instance_id"].startswith("mp-") and len(body["instance_id"]) == 35
    assert send(http, "PUT", "/instances/mp-test-1/heartbeat") == (200, {"instance_id": "mp-test-1"})
    assert send(http, "PUT", "/instances/nope/heartbeat") == (404, {"error": "unknown instance nope; re-register"})
    listed = send(http, "GET", "/instances")[1]["instances"]
    assert [i["instance_id"] for i in listed if i["instance_id"] == "mp-test-1"] == ["mp-test-1"]
    assert set(listed[0]) == {"instance_id", "ip", "http_port", "registration_time", "metadata",
                              "p2p_advertised_url", "mq_port"}
    assert send(http, "DELETE", "/instances/mp-test-1") == (204, None)
    assert send(http, "DELETE", "/instances/mp-test-1") == (204, None)
    assert send(http, "PUT", "/instances/mp-test-1/heartbeat")[0] == 404


@pytest.mark.parametrize("body, field", [
    ({"http_port": 1}, "ip"), ({"ip": " ", "http_port": 1}, "ip"), ({"ip": "x", "http_port": 0}, "http_port"),
    ({"ip": "x", "http_port": 1, "chunk_size": 0}, "chunk_size")])
def test_registration_422_names_the_field(http, body, field):
    status, out = send(http, "POST", "/instances", body)
    assert status == 422 and field in out["error"]


def test_chunk_size_binding_409(http):
    assert send(http, "PUT", "/config/chunk-size", {"chunk_size": 256}) == (200, {"chunk_size": 256})
    assert send(http, "PUT", "/config/chunk-size", {"chunk_size": 256}) == (200, {"chunk_size": 256})
    status, out = send(http, "PUT", "/config/chunk-size", {"chunk_size": 512})
    assert status == 409 and "already bound to chunk size 256" in out["detail"]
    status, out = send(http, "POST", "/instances", {**REG, "chunk_size": 128})
    assert status == 409
    assert send(http, "PUT", "/config/chunk-size", {"chunk_size": 0})[0] == 422


def test_events_and_directory(http):
    toks = list(range(1000, 1256))
    b1 = batch(1, entries=[entry(tokens=toks, offset=0)], shared=False, ts=1796108760.0)
    assert send(http, "POST", "/events", {"batches": [b1]}) == (200, {"applied": 1, "duplicates": 0, "stale": 0})
    assert send(http, "POST", "/events", {"batches": [b1]}) == (200, {"applied": 0, "duplicates": 1, "stale": 0})
    minimal = {"instance_id": "mp-test-1", "incarnation": INC, "seq": 2, "event_type": "store", "tier": "l2",
               "backend": "fs", "entries": [{"key": {"chunk_hash_hex": C0, "model_name": MODEL, "kv_rank": 16777472}}]}
    assert send(http, "POST", "/events", {"batches": [minimal]})[1]["applied"] == 1
    p_l1 = {"instance_id": "mp-test-1", "incarnation": INC, "tier": "l1", "backend": "dram",
            "size_bytes": 33554432, "shared": False}
    p_l2 = {**p_l1, "tier": "l2", "backend": "fs", "size_bytes": 0}
    status, out = send(http, "POST", "/directory/lookup", {"token_ids": list(range(1000, 1512)), "model_name": MODEL,
                                                           "world_size": 1, "cache_salt": ""})
    assert status == 200
    assert out == {"chunks": 2, "results": [
        {"key": key(), "placements": [p_l1, p_l2], "token_ids": toks, "access_count": 0},
        {"key": key(C1), "placements": [], "token_ids": [], "access_count": 0}]}
    assert send(http, "POST", "/directory/lookup", {"keys": [key()]}) == (200, {"chunks": 1, "results": [
        out["results"][0]]})
    assert send(http, "GET", "/directory/keys?tier=l1&instance_id=mp-test-1&backend=dram") == (200, {
        "total": 1, "keys": [{"key": key(), "placements": [p_l1], "num_tokens": 256, "access_count": 0}]})
    assert send(http, "GET", "/directory/stats")[1] == {
        "num_keys": 1, "num_placements": 2, "l1_keys_by_instance": {"mp-test-1": 1},
        "blend": {"num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0, "table_size": 0},
        "l1_count": 1, "l1_size_bytes": 33554432, "l2_count": 1, "l2_size_bytes": 0}


@pytest.mark.parametrize("body, status, words", [
    ({"keys": [], "token_ids": []}, 422, "exactly one of 'keys' or 'token_ids'"),
    ({"token_ids": [1, 2, 3]}, 422, "'model_name' is required"),
    ({"token_ids": [1], "model_name": "m", "cache_salt": "a/b"}, 400, "cache_salt"),
    ({"keys": [{"chunk_hash_hex": "zz", "model_name": "m", "kv_rank": 1}]}, 422, "$.keys[0].chunk_hash_hex")])
def test_directory_lookup_errors(http, body, status, words):
    got, out = send(http, "POST", "/directory/lookup", body)
    assert got == status and words in out["error"]


def test_short_prompt_no_chunks(http):
    assert send(http, "POST", "/directory/lookup", {"token_ids": [1, 2, 3], "model_name": "m"}) == (
        200, {"chunks": 0, "results": []})


def test_bad_batch_rejects_the_whole_request(http):
    good = batch(1, entries=[entry()])
    status, out = send(http, "POST", "/events", {"batches": [good, batch(2, etype="STORE")]})
    assert status == 422 and "$.batches[1].event_type" in out["error"]
    assert send(http, "GET", "/directory/stats")[1]["num_keys"] == 0
    status, out = send(http, "POST", "/events", raw=b"{not json")
    assert status == 422


def test_oversized_batch_list_413_nothing_applied(http, monkeypatch):
    monkeypatch.setattr(coordinator, "MAX_BATCHES", 3)
    status, out = send(http, "POST", "/events", {"batches": [batch(s, entries=[entry()]) for s in range(1, 5)]})
    assert status == 413 and "4 batches" in out["error"]
    assert send(http, "GET", "/directory/stats")[1]["num_keys"] == 0
    monkeypatch.setattr(coordinator, "MAX_ENTRIES", 2)
    status, _ = send(http, "POST", "/events", {"batches": [batch(1, entries=[entry(), entry(C1), entry("00")])]})
    assert status == 413


def test_blend_lookup_shapes(http):
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": "AQAAAAIAAAADAAAA", "model_name": "m"}) == (
        200, {"matches": []})
    toks = list(range(1000, 1256))
    send(http, "POST", "/events", {"batches": [batch(1, entries=[entry(tokens=toks, offset=0)])]})
    import base64
    from array import array

    query = [5, 6, 7] + toks + [9, 9] + toks[:10]
    b64 = base64.b64encode(array("I", query).tobytes()).decode()
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": b64, "model_name": MODEL}) == (
        200, {"matches": [{"chunk_hash": C0, "old_st": 0, "cur_st": 3}]})
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": b64, "model_name": MODEL,
                                                          "world_size": 2})[1] == {"matches": []}
    send(http, "POST", "/events", {"batches": [batch(2, etype="delete", entries=[entry()])]})
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": b64, "model_name": MODEL})[1] == {
        "matches": []}
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": "AQA", "model_name": "m"})[0] == 422
    assert send(http, "POST", "/directory/blend-lookup", {"tokens_b64": "AQAAAA=="})[0] == 422


P1 = list(range(1000, 1512))


def test_lookup_answers_mp_instances_scoped_by_model(http):
    send(http, "POST", "/instances", REG)
    send(http, "POST", "/instances", {**REG, "instance_id": "mp-b"})
    send(http, "POST", "/events", {"batches": [
        batch(1, "config", tier="l2", backend="s3", shared=True, capacity_bytes=1 << 30, capacity_revision=1),
        batch(2, entries=[entry(C0), entry(C1)]),
        batch(3, tier="l2", backend="fs", entries=[entry(C0)]),
        batch(1, inst="mp-b", tier="l2", backend="s3", shared=True, entries=[entry(C0)]),
        batch(2, inst="mp-b", entries=[entry(C0, model="other-model")])]})
    status, body = send(http, "POST", "/lookup?detail=1", {"tokens": P1 + [1, 2], "model_name": MODEL})
    assert status == 200
    # mp-test-1: both chunks in L1 (chunk 0 also in l2/fs, and in the shared s3 pool it declared)
    assert body["mp-test-1"] == ["l1/dram", 512]
    assert body["detail"]["mp-test-1"]["locations"] == {"l1/dram": 512, "l2/fs": 256, "l2/s3": 256}
    assert "mp-b" not in body  # it stored chunk 0 in s3 but did not declare the pool; its L1 chunk is another model's
    assert send(http, "POST", "/lookup", {"tokens": P1, "model_name": "other-model"})[1]["mp-b"] == ["l1/dram", 256]
    # world size 2: rank 1 holds nothing
    assert "mp-test-1" not in send(http, "POST", "/lookup", {"tokens": P1, "model_name": MODEL, "world_size": 2})[1]
    # without model_name: today's answer (no MP instance); another salt: nothing
    assert list(send(http, "POST", "/lookup", {"tokens": P1})[1]) == ["event_id"]
    assert list(send(http, "POST", "/lookup", {"tokens": P1, "model_name": MODEL, "cache_salt": "s"})[1]) == \
        ["event_id"]
    # a departed instance is answered for nothing
    send(http, "DELETE", "/instances/mp-test-1")
    assert "mp-test-1" not in send(http, "POST", "/lookup", {"tokens": P1, "model_name": MODEL})[1]


def test_lookup_world_size_bad(http):
    status, body = send(http, "POST", "/lookup", {"tokens": P1, "model_name": MODEL, "world_size": 0})
    assert status == 400 and "world_size" in body["error"]


def test_two_model_fleet_never_mixes_models(make_http, r):
    """Same prompts, two models; MP, classic LMCache and vLLM instances of each (classic ones
    declare their model through the owning sidecar's ``model`` setting, Store.model; vLLM ones
    through the model their sidecar discovered, VllmIngest.set_model)."""
    from kvlookup.hashing import mp as mphash
    from kvlookup.hashing.lmcache import HashProfile
    from kvlookup.index.store import ADMIT, Store
    from kvlookup.sidecar.vllm_ingest import VllmIngest
    from tests.support.vllm_helpers import payload, stored

    http = make_http()
    tokens = list(range(1000, 1512))  # 512 tokens: 2 chunks for both hash chains
    classic = [(ADMIT, h) for h in HashProfile().chunk_hashes(tokens)]
    for model, inst in (("model-a", "classic-a"), ("model-b", "classic-b"), (None, "classic-undeclared")):
        st = Store(r, purge_grace_s=0)
        st.model = model
        st.register_worker(inst, 0, "127.0.0.1", 8001)
        st.apply([(inst, 0, "LocalCPUBackend", classic)])
    for n, (model, inst) in enumerate((("model-a", "vllm-a"), ("model-b", "vllm-b"))):
        ing = VllmIngest(Store(r, purge_grace_s=0), inst)
        ing.set_model(model)
        blocks = stored([(n + 1) * 1000 + b for b in range(32)], tokens)  # 32 blocks of 16
        ing.handle_live(0, [b"kv@" + inst.encode(), (0).to_bytes(8, "big"), payload(blocks)])

    hashes = mphash.chunk_hashes_hex(tokens)
    for model, inst in (("model-a", "mp-a"), ("model-b", "mp-b")):
        send(http, "POST", "/instances", {**REG, "instance_id": inst})
        entries = [entry(h, model=model) for h in hashes]
        send(http, "POST", "/events", {"batches": [batch(1, inst=inst, entries=entries)]})
    everyone = send(http, "POST", "/lookup", {"tokens": tokens})[1]
    assert set(everyone) - {"event_id"} == {"classic-a", "classic-b", "classic-undeclared", "vllm-a", "vllm-b"}
    for model, other in (("model-a", "b"), ("model-b", "a")):
        body = send(http, "POST", "/lookup", {"tokens": tokens, "model_name": model})[1]
        mine = model[-1]
        assert body[f"mp-{mine}"] == ["l1/dram", 512]
        assert body[f"classic-{mine}"] == ["LocalCPUBackend", 512]
        assert body[f"vllm-{mine}"] == ["GPU", 512]
        assert not {f"mp-{other}", f"classic-{other}", f"vllm-{other}"} & set(body)
        assert "classic-undeclared" in body  # a model never declared is answered for every model


def test_metrics_count_batches_gaps_and_dropped_events(http):
    send(http, "POST", "/events", {"batches": [batch(1, entries=[entry()]), batch(4, dropped_events=3)]})
    text = http.get("/metrics").get_data(as_text=True)
    assert 'kvlookup_mp_directory_placements{tier="l1"} 1.0' in text
    assert 'kvlookup_mp_ingest_batches_total{outcome="applied"} 2.0' in text
    assert "kvlookup_mp_missing_batches_total 2.0" in text
    assert "kvlookup_mp_dropped_events_total 3.0" in text
    assert 'kvlookup_mp_emitter_gap{instance_id="mp-test-1"} 1.0' in text


def test_explain_names_mp_causes(http):
    for inst in ("mp-test-1", "mp-gone", "mp-salted", "mp-restarted", "mp-512"):
        send(http, "POST", "/instances", {**REG, "instance_id": inst})
    send(http, "POST", "/events", {"batches": [
        batch(1, entries=[entry(C0), entry(C1)]),
        batch(5, entries=[entry(C0)]),  # a gap: seq 2..4 never arrived
        batch(1, inst="mp-gone", entries=[entry(C0)]),
        batch(1, inst="mp-salted", entries=[entry(C0, salt="tenant-b")]),
        batch(1, inst="mp-restarted", tier="l2", backend="fs", entries=[entry(C0)]),
        batch(1, inst="mp-restarted", inc=INC + 5, etype="access", backend="", entries=[entry(C0)]),
        batch(1, inst="mp-512", entries=[entry(mphash_512())])]})
    send(http, "DELETE", "/instances/mp-gone")
    status, out = send(http, "POST", "/lookup/explain", {"tokens": P1, "model_name": MODEL})
    assert status == 200
    mp = out["mp"]["instances"]
    assert mp["mp-test-1"]["matched_prefix_length"] == 512
    assert [c["cause"] for c in mp["mp-test-1"]["causes"]] == ["gap"]
    assert mp["mp-test-1"]["causes"][0]["missing_batches"] == 3
    assert [c["cause"] for c in mp["mp-gone"]["causes"]] == ["departed"]
    assert mp["mp-gone"]["causes"][0]["reason"] == "deregistered"
    assert mp["mp-salted"]["causes"] == [{"cause": "other_namespace", "model_name": MODEL, "cache_salt": "tenant-b",
                                          "world_size": 1}]
    assert [c["cause"] for c in mp["mp-restarted"]["causes"]] == ["incarnation_changed"]
    assert mp["mp-restarted"]["matched_prefix_length"] == 256  # its L2 copy still counts
    assert mp["mp-512"]["causes"] == [{"cause": "other_chunk_size", "chunk_size": 512}]


def mphash_512():
    from kvlookup.hashing import mp as mphash

    return mphash.chunk_hashes_hex(P1, 512)[0]


def test_dashboard_overview_lists_mp_instances(http):
    send(http, "POST", "/instances", REG)
    send(http, "POST", "/events", {"batches": [
        batch(1, "config", tier="l1", backend="dram", capacity_bytes=1 << 30, capacity_revision=1),
        batch(3, entries=[entry()], dropped_events=2)]})
    ov = http.get("/controller/overview").get_json()
    (m,) = ov["mp_instances"]
    assert m["instance_id"] == "mp-test-1" and m["live"] and m["incarnation"] == INC and m["last_seq"] == 3
    assert m["gap"] and m["missing_batches"] == 1 and m["events_dropped"] == 2 and m["l1_keys"] == 1
    assert m["modules"] == [{"tier": "l1", "backend": "dram", "shared": False, "capacity_bytes": 1 << 30}]
    page = http.get("/static/dashboard.js").get_data(as_text=True) if http.get("/static/dashboard.js").status_code \
        == 200 else ""
    assert "mp-instances" in http.get("/").get_data(as_text=True) or "mp-instances" in page


def test_lookup_model_name_in_msgpack_and_packed_bodies(http):
    from array import array

    import msgspec

    send(http, "POST", "/instances", REG)
    send(http, "POST", "/events", {"batches": [batch(1, entries=[entry(C0), entry(C1)])]})
    resp = http.post("/lookup", data=msgspec.msgpack.encode({"tokens": P1, "model_name": MODEL}),
                     headers={"Content-Type": "application/msgpack"})
    assert resp.get_json()["mp-test-1"] == ["l1/dram", 512]
    packed = array("I", P1).tobytes()
    resp = http.post(f"/lookup?model_name={MODEL}&world_size=1", data=packed,
                     headers={"Content-Type": "application/octet-stream"})
    assert resp.get_json()["mp-test-1"] == ["l1/dram", 512]
    resp = http.post(f"/lookup?model_name={MODEL}&world_size=2", data=packed,
                     headers={"Content-Type": "application/octet-stream"})
    assert "mp-test-1" not in resp.get_json()


BIG = 2**63  # beyond int64: Lua wrote it as -2**63 and failed half-way through a request (mpbreak)


@pytest.mark.parametrize("where, value, field", [
    ("batch", {"seq": BIG}, "$.batches[1].seq"), ("batch", {"incarnation": 2**64}, "$.batches[1].incarnation"),
    ("batch", {"ts": 1e300}, "$.batches[1].ts"), ("batch", {"dropped_events": 2**64}, "$.batches[1].dropped_events"),
    ("batch", {"capacity_bytes": 2**64}, "$.batches[1].capacity_bytes"),
    ("batch", {"capacity_revision": 2**64}, "$.batches[1].capacity_revision"),
    ("entry", {"size": BIG}, "$.batches[1].entries[0].size_bytes"),
    ("entry", {"size": 2**53}, "$.batches[1].entries[0].size_bytes"),
    ("entry", {"tokens": range(256), "offset": BIG}, "$.batches[1].entries[0].token_offset")])
def test_numbers_beyond_what_lua_holds_are_422_and_nothing_applied(http, where, value, field):
    """A number the scripts cannot hold exactly (> 2**53 - 1) is refused whole, naming the field:
    size_bytes 2**63 used to leave a record the scripts could not parse (every later store of that
    chunk, by anyone, 503 for good), seq 2**63 a 503 after part of the request was written."""
    bad = {**batch(2, entries=[entry(C1)]), **value} if where == "batch" else batch(2, entries=[entry(C1, **value)])
    status, out = send(http, "POST", "/events", {"batches": [batch(1, entries=[entry()], inst="other"), bad]})
    assert status == 422 and field in out["error"] and "<= 9007199254740" in out["error"]
    assert send(http, "GET", "/directory/stats")[1]["num_keys"] == 0
    ok = {"batches": [batch(1, entries=[entry(), entry(C1, size=2**50)]), batch(2, tier="l2", backend="fs",
                                                                            entries=[entry(C1)])]}
    assert send(http, "POST", "/events", ok) == (200, {"applied": 2, "duplicates": 0, "stale": 0})
    assert send(http, "GET", "/directory/keys")[0] == 200
    stats = send(http, "GET", "/directory/stats")[1]  # a sum > 1e14: HINCRBY was passed "1.1258999068426e+15"
    assert (stats["num_keys"], stats["l1_size_bytes"]) == (2, 33554432 + 2**50)


def test_chunk_size_beyond_what_lua_holds_is_422_and_binds_nothing(http):
    """chunk_size 2**64 used to bind the fleet to -2**63 (Lua's %d of it), after which every
    tokens-form lookup was 400 and every registration with a chunk size 409, for good."""
    for path, method, body in (("/config/chunk-size", "PUT", {"chunk_size": 2**64}),
                               ("/instances", "POST", {**REG, "chunk_size": 2**64})):
        status, out = send(http, method, path, body)
        assert status == 422 and "$.chunk_size" in out["error"]
    assert send(http, "POST", "/directory/lookup", {"token_ids": [1] * 300, "model_name": "m"})[0] == 200
    assert send(http, "PUT", "/config/chunk-size", {"chunk_size": 256}) == (200, {"chunk_size": 256})


@pytest.mark.parametrize("ids", [300, 20_000])  # 20k ids: the body over 32 KiB takes the packed-ids decoders
def test_world_size_beyond_a_packed_rank_is_422(http, ids):
    """A world size of 2**24 used to build 2**24 keys for one lookup (a worker busy for minutes, its
    memory growing; 2**40 never came back): a packed kv_rank holds 8 bits of it, so > 255 is 422."""
    status, out = send(http, "POST", "/directory/lookup", {"token_ids": [1] * ids, "model_name": "m",
                                                          "world_size": 2**24})
    assert status == 422 and "$.world_size" in out["error"]
    status, out = send(http, "POST", "/directory/blend-lookup", {"tokens_b64": "AQAAAA==", "model_name": "m",
                                                                "world_size": 256})
    assert status == 422 and "$.world_size" in out["error"]
    status, out = send(http, "POST", "/directory/lookup", {"token_ids": [1] * ids, "model_name": "m",
                                                          "world_size": 255})
    assert status == 200 and len(out["results"]) == 255 * (ids // 256)


@pytest.mark.parametrize("backend", ["x\t1", "a,b", "a;b", "a\x1eb", "a\x1fb"])
def test_backend_holding_a_separator_is_422(http, backend):
    """A backend holding a tab used to make GET /directory/keys 500 for good (its placement's
    tier/backend/shared text split in 4), a ',' or ';' in a config batch's backend made the
    capacity declarations unreadable: POST /lookup with model_name answered no MP instance at all."""
    toks = list(range(1000, 1512))
    assert send(http, "POST", "/instances", REG)[0] == 200
    assert send(http, "POST", "/events", {"batches": [batch(1, entries=[entry(), entry(C1)])]})[1]["applied"] == 1
    for etype, kw in (("store", {"entries": [entry()]}), ("config", {"capacity_bytes": 1, "capacity_revision": 1})):
        status, out = send(http, "POST", "/events", {"batches": [batch(1, etype=etype, backend=backend, inst="evil",
                                                                       shared=True, **kw)]})
        assert status == 422 and "$.batches[0].backend" in out["error"]
    assert send(http, "GET", "/directory/keys")[0] == 200
    assert send(http, "POST", "/lookup", {"tokens": toks, "model_name": MODEL})[1]["mp-test-1"] == ["l1/dram", 512]
    assert send(http, "POST", "/events", {"batches": [batch(2, backend="a|b é", entries=[entry()])]})[0] == 200


_FIELDS = [("batch", f) for f in ("instance_id", "incarnation", "seq", "event_type", "tier", "backend", "entries",
                                  "shared", "ts", "capacity_bytes", "capacity_revision", "dropped_events")] + \
          [("entry", f) for f in ("size_bytes", "token_ids", "token_offset")] + \
          [("key", f) for f in ("chunk_hash_hex", "model_name", "kv_rank", "object_group_id", "cache_salt")]


def _any_json():
    from hypothesis import strategies as st

    leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([2**53 - 1, 2**53, 2**63])
            | st.floats(allow_nan=False, allow_infinity=False) | st.text("ab,;|\t\x1e\x1f.:@/ é0", max_size=6))
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=2), max_leaves=6)


def test_any_value_in_any_field_is_applied_or_422_and_the_directory_stays_whole(make_http):
    """Every field of a store (or config) batch replaced by any JSON value: 200 or 422, never a
    5xx, and the directory keeps working (a store, the key listing and a model lookup after
    each): how size_bytes 2**63 and a backend holding a tab or a comma were found."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    http = make_http()
    toks = list(range(1000, 1512))
    assert send(http, "POST", "/instances", REG)[0] == 200
    seq = iter(range(1, 10**6))

    edgy = st.one_of(st.sampled_from([-1, 0, 2**53 - 1, 2**53, 2**63, 2**64, 1e300]),
                     st.text("a,;|\t\x1e\x1f.:@/ é", min_size=1, max_size=4), _any_json())

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(st.sampled_from(_FIELDS), edgy, st.sampled_from(["store", "config"]))
    def one(field, value, etype):
        b = batch(1, etype=etype, inst="fuzz", entries=[] if etype == "config" else [entry(C1, tokens=range(256),
                                                                                          offset=256)])
        where = {"batch": b, "entry": (b["entries"] or [{}])[0], "key": (b["entries"] or [{"key": {}}])[0]["key"]}
        where[field[0]][field[1]] = value
        status, out = send(http, "POST", "/events", {"batches": [b]})
        assert status in (200, 422), (field, value, status, out)
        assert send(http, "POST", "/events", {"batches": [batch(next(seq), entries=[entry(), entry(C1)])]}) == (
            200, {"applied": 1, "duplicates": 0, "stale": 0})
        assert send(http, "GET", "/directory/keys")[0] == 200
        assert send(http, "POST", "/lookup", {"tokens": toks, "model_name": MODEL})[1]["mp-test-1"] == ["l1/dram", 512]
        assert send(http, "DELETE", "/instances/fuzz")[0] == 204
        assert send(http, "POST", "/instances", {**REG, "instance_id": "fuzz"})[0] == 200

    one()
