"""10,000+ malformed HTTP bodies (hypothesis): every one gets a 4xx JSON ``{"error"}``, never a 500.

Bodies are malformed by construction: not JSON, JSON that is not an object, an object with a
required field missing, or with one required field of a wrong type or out of range. Missing
and wrong fields must be named in the error. The bulk goes through Flask's test client; a
sample goes through a real HTTP server; valid requests work afterwards.
"""

from __future__ import annotations

import json
import threading

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.serving import make_server

from kvlookup.app import create_app
from tests.conftest import SEED_TOKENS

NAME, TOKENS, PAIR, IP = "name", "tokens", "pair", "ip"
SPECS: dict[str, dict[str, str]] = {
    "/lookup": {"tokens": TOKENS},
    "/clear": {"instance_id": NAME, "location": NAME},
    "/pin": {"instance_id": NAME, "location": NAME, "tokens": TOKENS},
    "/compress": {"instance_id": NAME, "method": NAME, "location": NAME},
    "/decompress": {"instance_id": NAME, "method": NAME, "location": NAME},
    "/move": {"old_position": PAIR, "new_position": PAIR},
    "/health": {"instance_id": NAME},
    "/check_finish": {"event_id": NAME},
    "/query_instance": {"ip": IP},
    "/query_worker_info": {"instance_id": NAME},
}
ENDPOINTS = sorted(SPECS)

finite = st.floats(allow_nan=False, allow_infinity=False)
json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | finite | st.text(max_size=8)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
not_str = json_any.filter(lambda v: not isinstance(v, str))
bad_token = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**32),
    st.booleans(),
    finite,
    st.text(max_size=4),
    st.none(),
)
WRONG = {
    NAME: st.one_of(not_str, st.just(""), st.text(min_size=257, max_size=300)),
    IP: st.one_of(not_str, st.just(""), st.text(min_size=301, max_size=320)),
    TOKENS: st.one_of(
        json_any.filter(lambda v: not isinstance(v, list)),
        st.tuples(st.lists(st.integers(0, 2**32 - 1), max_size=5), bad_token).map(lambda t: t[0] + [t[1]]),
    ),
    PAIR: st.one_of(
        json_any.filter(lambda v: not isinstance(v, list)),
        st.lists(st.text(min_size=1), max_size=1),
        st.lists(st.text(min_size=1), min_size=3, max_size=4),
        st.tuples(st.text(min_size=1), not_str).map(list),
    ),
}
GOOD = {
    NAME: st.text(min_size=1, max_size=20),
    IP: st.just("10.0.0.1"),
    TOKENS: st.lists(st.integers(0, 99), max_size=4),
    PAIR: st.tuples(st.text(min_size=1, max_size=5), st.just("LocalCPUBackend")).map(list),
}


@st.composite
def malformed(draw, path: str) -> tuple[bytes, str | None]:
    """(body, field the error must name or None)."""
    spec = SPECS[path]
    kind = draw(st.sampled_from(["bytes", "nonobject", "missing", "wrong"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=40))
        try:
            json.loads(raw)
            raw = b"{" + raw  # make sure it is not JSON
        except (ValueError, UnicodeDecodeError):
            pass
        return raw, None
    if kind == "nonobject":
        return json.dumps(draw(json_any.filter(lambda v: not isinstance(v, dict)))).encode(), None
    body = {f: draw(GOOD[t]) for f, t in spec.items()}
    field = draw(st.sampled_from(sorted(spec)))
    if kind == "missing":
        del body[field]
    else:
        body[field] = draw(WRONG[spec[field]])
    return json.dumps(body).encode(), field


bodies = st.tuples(*[malformed(p) for p in ENDPOINTS])


def _check(status: int, payload, field: str | None, path: str, body: bytes) -> None:
    assert 400 <= status < 500, (path, body, status, payload)
    assert isinstance(payload, dict) and isinstance(payload.get("error"), str), (path, body, payload)
    if field is not None:
        assert field in payload["error"], (path, body, payload)


def test_ten_thousand_malformed_bodies_get_4xx_json(redis_settings):
    app = create_app({**redis_settings, "control_timeout_s": 0.2, "max_body_bytes": 4096})
    http = app.test_client()
    seen = {"requests": 0}

    @settings(
        max_examples=1000,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies)
    def fuzz(batch):
        for path, (body, field) in zip(ENDPOINTS, batch, strict=True):
            resp = http.post(path, data=body, content_type="application/json")
            _check(resp.status_code, resp.get_json(silent=True), field, path, body)
            seen["requests"] += 1

    fuzz()
    assert seen["requests"] >= 10_000
    too_big = http.post("/clear", data=b"x" * 5000)
    assert (too_big.status_code, too_big.get_json()) == (413, {"error": "request body too large"})
    ok = http.post("/lookup", json={"tokens": SEED_TOKENS})
    assert ok.status_code == 200 and list(ok.get_json()) == ["event_id"]

    # a sample through a real HTTP server
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        for body, path in (
            (b"", "/clear"),
            (b"{", "/lookup"),
            (b'{"tokens": [-1]}', "/lookup"),
            (b'{"ip": 5}', "/query_instance"),
            (b"[1,2]", "/move"),
            (b"\xff\xfe", "/health"),
            (b'{"instance_id": ""}', "/query_worker_info"),
            (b"x" * 5000, "/pin"),
        ):
            resp = requests.post(
                base + path, data=body, headers={"Content-Type": "application/json"}, timeout=5
            )
            _check(resp.status_code, resp.json(), None, path, body)
        assert requests.post(base + "/lookup", json={"tokens": SEED_TOKENS}, timeout=5).status_code == 200
    finally:
        server.shutdown()
        thread.join(5)
        app.extensions["kvlookup"]["control"].close()
