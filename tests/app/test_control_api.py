"""LMCache control API on the controller, against simulated REP workers (real zmq sockets)."""

from __future__ import annotations

import re

import pytest

from kvlookup import kinds
from kvlookup.app import create_app
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.wire import lmcache_control as ctl
from kvlookup.wire.lmcache import ErrorMsg
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.repworker import RepWorker

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@pytest.fixture()
def app(redis_settings):
    app = create_app({**redis_settings, "control_timeout_s": 0.3, "control_retries": 1})
    yield app
    app.extensions["kvlookup"]["control"].close()


@pytest.fixture()
def http(app):
    return app.test_client()


@pytest.fixture()
def workers():
    made: list[RepWorker] = []

    def make(**kw) -> RepWorker:
        made.append(RepWorker(**kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _register(store: Store, inst: str, reps: list[RepWorker], ip: str = "127.0.0.1") -> None:
    for wid, rep in enumerate(reps):
        store.register_worker(inst, wid, ip, rep.port, f"127.0.0.1:{9200 + wid}")


def test_clear_fans_out_to_every_worker_in_order(http, store, workers):
    w0, w1 = workers(), workers()
    _register(store, "inst", [w0, w1])
    resp = http.post("/clear", json={"instance_id": "inst", "location": "LocalCPUBackend"})
    assert resp.status_code == 200
    body = resp.get_json()
    assert list(body) == ["event_id", "num_tokens"] and body["num_tokens"] == 12
    assert re.fullmatch("Clear" + UUID, body["event_id"])
    assert [m.worker_event_id for m in w0.received] == [f"Worker0{body['event_id']}"]
    assert [m.worker_event_id for m in w1.received] == [f"Worker1{body['event_id']}"]
    assert w0.received[0].location == "LocalCPUBackend"
    assert w0.raw[0] == ctl.encode(ctl.ClearWorkerMsg(f"Worker0{body['event_id']}", "LocalCPUBackend"))
    done = http.post("/check_finish", json={"event_id": body["event_id"]})
    assert (done.status_code, done.get_json()) == (200, {"status": "finished"})


def test_pin_compress_decompress_move_messages(http, store, workers):
    src, dst = workers(), workers()
    _register(store, "a", [src])
    _register(store, "b", [dst])
    assert (
        http.post(
            "/pin", json={"instance_id": "a", "location": "LocalCPUBackend", "tokens": [1, 2]}
        ).get_json()["num_tokens"]
        == 12
    )
    assert src.received[-1].tokens == [1, 2] and src.received[-1].worker_event_id.startswith("Worker0Pin")
    for path, cls in (("/compress", ctl.CompressWorkerMsg), ("/decompress", ctl.DecompressWorkerMsg)):
        resp = http.post(path, json={"instance_id": "a", "method": "cachegen", "location": "LocalCPUBackend"})
        assert resp.status_code == 200 and resp.get_json()["num_tokens"] == 12
        msg = src.received[-1]
        assert type(msg) is cls and (msg.method, msg.location, msg.tokens) == (
            "cachegen",
            "LocalCPUBackend",
            [],
        )
        assert re.fullmatch(
            cls.__name__.replace("Msg", "").replace("Worker", "") + "Worker0" + UUID, msg.worker_event_id
        )
    resp = http.post(
        "/move",
        json={
            "old_position": ["a", "LocalCPUBackend"],
            "new_position": ["b", "LocalCPUBackend"],
            "tokens": [5],
            "should_copy": True,
        },
    )
    assert resp.status_code == 200 and resp.get_json()["num_tokens"] == 12
    move = src.received[-1]
    assert (move.old_position, move.new_position, move.tokens, move.copy) == (
        "LocalCPUBackend",
        ("127.0.0.1:9200", "LocalCPUBackend"),
        [5],
        True,
    )
    assert dst.received == []
    bad = http.post("/move", json={"old_position": ["a", "x"], "new_position": ["b", "LocalDiskBackend"]})
    assert bad.status_code == 400 and "LocalCPUBackend" in bad.get_json()["error"]


def test_dead_worker_is_a_clear_error_and_never_wedges(http, store, workers):
    live, dead = workers(), workers(answer=lambda msg: None)
    _register(store, "inst", [live, dead])
    resp = http.post("/clear", json={"instance_id": "inst", "location": "LocalCPUBackend"})
    assert resp.status_code == 504
    body = resp.get_json()
    assert (
        body["error"]
        == f"worker 1: no answer from 127.0.0.1:{dead.port} within 0.3s (2 attempt(s))"
    )
    assert body["workers"]["0"] == {"outcome": "ok", "error": ""}
    assert body["workers"]["1"]["outcome"] == "timeout"
    assert http.post("/check_finish", json={"event_id": body["event_id"]}).get_json() == {"status": "failed"}
    health = http.post("/health", json={"instance_id": "inst"}).get_json()
    assert health["error_codes"] == {"0": 0, "1": -1004}
    assert re.fullmatch("health" + UUID, health["event_id"])
    assert set(health["errors"]) == {"1"}
    # the dead worker comes back on the same port: the next call reaches it on a fresh socket
    port = dead.port
    dead.close()
    revived = workers(port=port)
    assert http.post("/health", json={"instance_id": "inst"}).get_json()["error_codes"] == {"0": 0, "1": 0}
    assert len(revived.received) == 1


def test_worker_errors_map_to_lmcache_codes(http, store, workers):
    err = workers(answer=lambda msg: ErrorMsg(error="Worker error: boom"))
    odd = workers(answer=lambda msg: ctl.ClearWorkerRetMsg(3))
    junk = workers(answer=lambda msg: b"\xc1garbage")
    _register(store, "inst", [err, odd, junk])
    health = http.post("/health", json={"instance_id": "inst"}).get_json()
    assert health["error_codes"] == {"0": -1001, "1": -1002, "2": -1003}
    assert health["errors"]["0"] == "Worker error: boom"
    resp = http.post("/clear", json={"instance_id": "inst", "location": "LocalCPUBackend"})
    assert resp.status_code == 502
    assert resp.get_json()["workers"]["0"] == {"outcome": "worker_error", "error": "Worker error: boom"}


def test_disagreeing_workers_and_unknown_instances(http, store, workers):
    a, b = workers(), workers(answer=lambda msg: ctl.ClearWorkerRetMsg(7))
    _register(store, "inst", [a, b])
    resp = http.post("/clear", json={"instance_id": "inst", "location": "LocalCPUBackend"})
    assert resp.status_code == 502
    assert resp.get_json()["num_tokens_by_worker"] == {"0": 12, "1": 7}
    missing = http.post("/clear", json={"instance_id": "nope", "location": "LocalCPUBackend"})
    assert missing.status_code == 404
    assert missing.get_json() == {"error": "instance 'nope' has no registered workers"}
    health = http.post("/health", json={"instance_id": "nope"}).get_json()
    assert health["error_codes"] == {}
    unknown = http.post("/check_finish", json={"event_id": "Clearxyz"})
    assert unknown.status_code == 404 and "Clearxyz" in unknown.get_json()["error"]
    store.register_worker("v", 0, kind=kinds.VLLM)
    vllm = http.post("/clear", json={"instance_id": "v", "location": "GPU"})
    assert vllm.status_code == 409


def test_bearer_token_guards_mutating_endpoints(redis_settings, store, workers):
    rep = workers()
    _register(store, "inst", [rep])
    app = create_app({**redis_settings, "api_token": "s3cret", "control_timeout_s": 0.3})
    http = app.test_client()
    body = {"instance_id": "inst", "location": "LocalCPUBackend"}
    for path in ("/clear", "/pin", "/compress", "/decompress", "/move"):
        resp = http.post(path, json=body)
        assert resp.status_code == 401, path
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="kvlookup"'
        assert "bearer token" in resp.get_json()["error"]
    assert http.post("/clear", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert rep.received == []
    ok = http.post("/clear", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.get_json()["num_tokens"] == 12
    assert http.post("/health", json={"instance_id": "inst"}).status_code == 200
    assert http.post("/lookup", json={"tokens": [1]}).status_code == 200
    app.extensions["kvlookup"]["control"].close()


def test_query_instance_tells_instances_on_one_ip_apart(http, store):
    store.register_worker("a", 0, "10.0.0.5", 8001)
    store.register_worker("b", 0, "10.0.0.5", 8002)
    store.register_worker("c", 0, "10.0.0.6", 8001)
    ok = http.post("/query_instance", json={"event_id": "x", "ip": "10.0.0.6"})
    assert ok.status_code == 200 and ok.get_json()["res"] == "c"
    assert re.fullmatch("QueryInst" + UUID, ok.get_json()["event_id"])
    amb = http.post("/query_instance", json={"event_id": "x", "ip": "10.0.0.5"})
    assert amb.status_code == 409
    assert amb.get_json()["candidates"] == [
        {"instance_id": "a", "port": 8001},
        {"instance_id": "b", "port": 8002},
    ]
    assert http.post("/query_instance", json={"ip": "10.0.0.5", "port": 8002}).get_json()["res"] == "b"
    assert http.post("/query_instance", json={"ip": "10.0.0.5:8001"}).get_json()["res"] == "a"
    unknown = http.post("/query_instance", json={"event_id": "x", "ip": "10.9.9.9"})
    assert unknown.status_code == 404
    assert (
        unknown.get_json()["res"] is None
        and unknown.get_json()["error"] == "no instance registered from 10.9.9.9"
    )
    store.deregister_worker("b", 0)
    assert http.post("/query_instance", json={"ip": "10.0.0.5"}).get_json()["res"] == "a"


def test_worker_info_and_key_stats(http, store):
    store.register_worker("a", 0, "127.0.0.1", 8001, "127.0.0.1:9200", now=1000.0)
    store.register_worker("a", 1, "127.0.0.1", 8002, None, now=1001.0)
    store.register_worker("b", 0, "127.0.0.2", 8001, None, now=1002.0)
    store.apply(
        [
            ("a", 0, "LocalCPUBackend", [("a", 1), ("a", 2)]),
            ("a", 1, "LocalCPUBackend", [("a", 1)]),
            ("a", 0, "LocalDiskBackend", [("a", 1)]),
            ("b", 0, "LocalCPUBackend", [("a", 9)]),
        ]
    )
    info = http.post("/query_worker_info", json={"instance_id": "a", "worker_ids": None}).get_json()
    assert re.fullmatch("QueryWorkerInfo" + UUID, info["event_id"])
    assert info["worker_infos"] == [
        {
            "instance_id": "a",
            "worker_id": 0,
            "ip": "127.0.0.1",
            "port": 8001,
            "peer_init_url": "127.0.0.1:9200",
            "registration_time": 1000.0,
            "last_heartbeat_time": 1000.0,
        },
        {
            "instance_id": "a",
            "worker_id": 1,
            "ip": "127.0.0.1",
            "port": 8002,
            "peer_init_url": None,
            "registration_time": 1001.0,
            "last_heartbeat_time": 1001.0,
        },
    ]
    only1 = http.post("/query_worker_info", json={"instance_id": "all", "worker_ids": [1]}).get_json()
    assert [(w["instance_id"], w["worker_id"]) for w in only1["worker_infos"]] == [("a", 1)]
    assert http.post("/query_worker_info", json={"instance_id": "zz"}).get_json()["worker_infos"] == []
    workers = http.get("/controller/workers?instance_id=a").get_json()
    assert workers["total_count"] == 2
    assert [(w["worker_id"], w["key_count"], w["live"], w["epoch"]) for w in workers["workers"]] == [
        (0, 3, True, 1),
        (1, 1, True, 1),
    ]
    assert http.get("/controller/workers?instance_id=zz").status_code == 404
    assert http.get("/controller/workers?instance_id=a&worker_id=7").status_code == 404
    assert http.get("/controller/workers?worker_id=0").get_json()["total_count"] == 2
    stats = http.get("/controller/key-stats").get_json()
    assert stats == {
        "total_key_count": 5,
        "total_instance_count": 2,
        "total_worker_count": 3,
        "instances": [
            {"instance_id": "a", "key_count": 4, "worker_count": 2},
            {"instance_id": "b", "key_count": 1, "worker_count": 1},
        ],
    }


def _sample(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_endpoint(http, store, r):
    store.register_worker("a", 0)
    store.register_worker("a", 1)
    store.register_worker("b", 0)
    store.apply(
        [
            ("a", 0, "LocalCPUBackend", [("a", SEED_HASH), ("a", 2)]),
            ("a", 1, "LocalCPUBackend", [("a", SEED_HASH)]),
            ("b", 0, "LocalDiskBackend", [("a", 3)]),
        ]
    )
    r.zrem(keys.alive_key(), "b")
    before = http.get("/metrics").get_data(as_text=True)
    assert http.post("/lookup", json={"tokens": SEED_TOKENS}).get_json()["a"] == ["LocalCPUBackend", 12]
    assert http.post("/clear", json={"instance_id": "zz", "location": "x"}).status_code == 404
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = resp.get_data(as_text=True)
    assert (
        _sample(text, "kvlookup_lookups_total", '{outcome="hit"}')
        - _sample(before, "kvlookup_lookups_total", '{outcome="hit"}')
        == 1
    )
    assert (
        _sample(text, "kvlookup_lookup_seconds_count") - _sample(before, "kvlookup_lookup_seconds_count") == 1
    )
    assert (
        _sample(text, "kvlookup_lookup_matched_tokens_sum")
        - _sample(before, "kvlookup_lookup_matched_tokens_sum")
        == 12
    )
    assert _sample(text, "kvlookup_index_up") == 1
    assert _sample(text, "kvlookup_live", '{kind="instances"}') == 1
    assert _sample(text, "kvlookup_live", '{kind="workers"}') == 2
    assert _sample(text, "kvlookup_records", '{instance_id="a",location="LocalCPUBackend"}') == 3
    assert _sample(text, "kvlookup_records", '{instance_id="b",location="LocalDiskBackend"}') == 1
    for name in (
        "kvlookup_ingest_ops_total",
        "kvlookup_rejected_frames_total",
        "kvlookup_seq_gaps_total",
        "kvlookup_resyncs_total",
    ):
        assert f"# TYPE {name} counter" in text


def test_body_limit_and_bad_bodies(redis_settings):
    app = create_app({**redis_settings, "max_body_bytes": 64})
    http = app.test_client()
    big = http.post("/clear", data=b"{" + b" " * 100 + b"}", content_type="application/json")
    assert (big.status_code, big.get_json()) == (413, {"error": "request body too large"})
    bad = http.post("/clear", json={"instance_id": 5, "location": "x"})
    assert bad.status_code == 400 and "$.instance_id" in bad.get_json()["error"]
    app.extensions["kvlookup"]["control"].close()
