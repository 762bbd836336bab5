"""POST /lookup through the Flask app: response shapes and bad input (4xx JSON, never 500).

Every test runs under both implementations of the body decode and the hashes (``impl``:
python, native; tests/support/native.py): the answers and the errors are the same."""

from __future__ import annotations

import json

import pytest

from kvlookup.app import create_app
from kvlookup.index.store import ADMIT
from tests.conftest import SEED_HASH, SEED_TOKENS

pytestmark = pytest.mark.usefixtures("impl")


@pytest.fixture()
def make_app(redis_settings):
    def make(**overrides):
        return create_app({**redis_settings, **overrides}).test_client()
    return make


@pytest.fixture()
def http(make_app, store):
    store.register_worker("lmcache_default_instance", 0, "127.0.0.1", 8001)
    store.apply([("lmcache_default_instance", 0, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])
    return make_app()


def post(http, body, path="/lookup", raw=None):
    resp = http.post(path, data=raw if raw is not None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
    return resp.status_code, resp.get_json()


def test_seed_answer_flat_shape(http):
    status, body = post(http, {"tokens": SEED_TOKENS})
    assert status == 200
    assert list(body) == ["event_id", "lmcache_default_instance"]
    assert body["event_id"].startswith("Lookup")
    assert body["lmcache_default_instance"] == ["LocalCPUBackend", 12]


def test_layout_info_shape_per_request_and_config(http, make_app):
    status, body = post(http, {"tokens": SEED_TOKENS}, path="/lookup?format=layout_info")
    assert (status, body["layout_info"]) == (200, {"lmcache_default_instance": ["LocalCPUBackend", 12]})
    status, body = post(make_app(lookup_response="layout_info"), {"tokens": SEED_TOKENS})
    assert (status, list(body)) == (200, ["event_id", "layout_info"])


def test_no_match_is_event_id_only(http):
    status, body = post(http, {"tokens": [1, 2, 3]})
    assert status == 200 and list(body) == ["event_id"]
    status, body = post(http, {"tokens": []}, path="/lookup?format=layout_info")
    assert (status, body["layout_info"]) == (200, {})


def test_detail(http):
    for yes in ("1", "true", "Yes", "on"):
        status, body = post(http, {"tokens": SEED_TOKENS}, path="/lookup?detail=" + yes)
        assert body["detail"] == {"lmcache_default_instance": {
            "location": "LocalCPUBackend", "matched_prefix_length": 12, "locations": {"LocalCPUBackend": 12}}}
    for no in ("0", "false", "off", ""):
        assert "detail" not in post(http, {"tokens": SEED_TOKENS}, path="/lookup?detail=" + no)[1]
    assert post(http, {"tokens": SEED_TOKENS}, path="/lookup?detail=maybe") == (
        400, {"error": "query parameter 'detail' must be 1/true/yes/on or 0/false/no/off"})


@pytest.mark.parametrize(("raw", "status", "fragment"), [
    (b"not json", 400, "body is not valid JSON"),
    (b"", 400, "body is not valid JSON: the body is empty (expected a JSON object)"),
    (b"[1,2]", 400, "Expected `object`, got `array`"),
    (b"{}", 400, "missing required field `tokens`"),
    (b'{"tokens": "abc"}', 400, "Expected `array`, got `str` - at `$.tokens`"),
    (b'{"tokens": [1, "2"]}', 400, "Expected `int`, got `str` - at `$.tokens[1]`"),
    (b'{"tokens": [1, 2.5]}', 400, "Expected `int`, got `float` - at `$.tokens[1]`"),
    (b'{"tokens": [true]}', 400, "Expected `int`, got `bool` - at `$.tokens[0]`"),
    (b'{"tokens": [-1]}', 400, "Expected `int` >= 0 - at `$.tokens[0]`"),
    (b'{"tokens": [4294967296]}', 400, "Expected `int` <= 4294967295 - at `$.tokens[0]`"),
    (b'{"tokens": [null]}', 400, "Expected `int`, got `null` - at `$.tokens[0]`"),
    (b'{"tokens": [1e400]}', 400, "Number out of range - at `$.tokens[0]`"),
])
def test_bad_bodies(http, raw, status, fragment):
    got_status, body = post(http, None, raw=raw)
    assert got_status == status
    assert fragment in body["error"]


def test_too_many_tokens_is_413(make_app):
    http = make_app(max_tokens=10)
    status, body = post(http, {"tokens": list(range(11))})
    assert status == 413
    assert body == {"error": "'tokens' has 11 ids, more than the maximum 10"}


def test_body_size_limit_is_413(make_app):
    http = make_app(max_body_bytes=100)
    status, body = post(http, {"tokens": list(range(100))})
    assert (status, body) == (413, {"error": "request body too large"})


def test_bad_format_and_unknown_route(http):
    for query in ("?format=xml", "?format=", "?format"):
        status, body = post(http, {"tokens": [1]}, path="/lookup" + query)
        assert (status, body) == (400, {"error": "query parameter 'format' must be 'flat' or 'layout_info'"})
    resp = http.get("/lookup")
    assert (resp.status_code, resp.headers["Allow"]) == (405, "OPTIONS, POST") and "error" in resp.get_json()


def test_methods_head_options_and_flask_405_allow(http):
    head = http.head("/lookup")
    assert (head.status_code, head.data) == (405, b"")
    options = http.options("/lookup")
    assert (options.status_code, options.headers["Allow"], options.data) == (200, "OPTIONS, POST", b"")
    resp = http.get("/clear")  # a Flask endpoint names its methods too
    assert (resp.status_code, set(resp.headers["Allow"].split(", "))) == (405, {"OPTIONS", "POST"})
    assert resp.get_json() == {"error": "The method is not allowed for the requested URL."}


def test_redis_pool_is_bounded_and_blocking(make_app):
    import redis

    client = make_app(redis_max_connections=7).application.extensions["kvlookup"]["redis"]
    if hasattr(client, "get_nodes"):  # a cluster: one pool per node
        client.ping()
        pools = [n.redis_connection.connection_pool for n in client.get_nodes()]
    else:
        pools = [client.connection_pool]
    assert all(isinstance(p, redis.BlockingConnectionPool) and p.max_connections == 7 for p in pools)


def test_health_reports_redis(http):
    resp = http.get("/health")
    assert resp.status_code == 200
    assert resp.get_json()["redis"] == "ok"


def test_health_when_redis_is_down(make_app):
    http = create_app({"redis_url": "redis://127.0.0.1:1/0"}).test_client()
    resp = http.get("/health")
    assert (resp.status_code, resp.get_json()["redis"]) == (503, "unreachable")
    status, body = post(http, {"tokens": [1]})
    assert status == 503 and body["error"].startswith("index unavailable")
    # every Flask endpoint that reads the index answers the same way
    for method, path, body in [("post", "/clear", {"instance_id": "a", "location": "LocalCPUBackend"}),
                               ("post", "/health", {"instance_id": "a"}),
                               ("post", "/check_finish", {"event_id": "Clear1"}),
                               ("post", "/query_instance", {"ip": "10.0.0.1"}),
                               ("post", "/query_worker_info", {"instance_id": "a"}),
                               ("get", "/controller/workers", None),
                               ("get", "/controller/key-stats", None)]:
        resp = getattr(http, method)(path, json=body)
        assert resp.status_code == 503 and resp.get_json()["error"].startswith("index unavailable: "), path


def _without_event_id(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "event_id"}


def test_binary_bodies_answer_as_json_does(http):
    """application/msgpack (the same object) and application/octet-stream (packed little-endian
    uint32 ids) give the JSON answer; a raw body's namespace comes from the query string."""
    import struct

    import msgpack

    from kvlookup.app.lookup import parse_request

    raw = struct.pack(f"<{len(SEED_TOKENS)}I", *SEED_TOKENS)
    answers = []
    for ctype, data in (("application/json", json.dumps({"tokens": SEED_TOKENS})),
                        ("application/msgpack", msgpack.packb({"tokens": SEED_TOKENS})),
                        ("application/octet-stream", raw)):
        resp = http.post("/lookup", data=data, headers={"Content-Type": ctype})
        answers.append((resp.status_code, _without_event_id(resp.get_json())))
    assert answers == [(200, {"lmcache_default_instance": ["LocalCPUBackend", 12]})] * 3
    req = parse_request(raw, 100, "application/octet-stream", {"lora_name": ["sql"], "cache_salt": ["s1"]})
    assert (list(req.tokens), req.lora_name, req.cache_salt) == (SEED_TOKENS, "sql", "s1")  # native: array('I')
    big = struct.pack("<2I", 2**32 - 1, 0)
    assert list(parse_request(big, 100, "application/octet-stream; charset=binary").tokens) == [2**32 - 1, 0]


@pytest.mark.parametrize(("ctype", "data", "status", "error"), [
    ("application/octet-stream", b"\x01\x00\x00", 400,
     "an application/octet-stream body is packed uint32 token ids: 3 bytes is not a multiple of 4"),
    ("application/octet-stream", b"\x00" * 4 * 11, 413, "'tokens' has 11 ids, more than the maximum 10"),
    ("application/msgpack", b"\xc1", 400, "body is not valid MessagePack: MessagePack data is malformed: "
                                          "invalid opcode '\\xc1' (byte 0)"),
    ("application/msgpack", b"\x81\xa6tokens\x91\xff", 400, "invalid request: Expected `int` >= 0 - at `$.tokens[0]`"),
])
def test_bad_binary_bodies_name_the_problem(make_app, ctype, data, status, error):
    resp = make_app(max_tokens=10).post("/lookup", data=data, headers={"Content-Type": ctype})
    assert (resp.status_code, resp.get_json()) == (status, {"error": error})
