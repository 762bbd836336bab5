"""GET /openapi.json (OpenAPI 3.1, generated from the structs by msgspec) is a valid document
(openapi-spec-validator) that covers every route, and real answers of a real controller
(gunicorn, an LMCache worker registered over ZMQ) validate against its schemas; GET /docs is
Swagger UI from app/static, rendered by headless Chromium without reaching anywhere else."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openapi_spec_validator import validate

from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_TOKENS
from tests.support import browser as chromium
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.single_node

ROUTES = {"/lookup", "/lookup/explain", "/health", "/clear", "/pin", "/compress", "/decompress", "/move",
          "/check_finish", "/query_instance", "/query_worker_info", "/controller/workers", "/controller/key-stats",
          "/controller/overview", "/tokenize", "/metrics",
          # LMCache MP coordinator paths (app/coordinator.py)
          "/instances", "/instances/{instance_id}/heartbeat", "/instances/{instance_id}", "/config/chunk-size",
          "/healthz", "/events", "/directory/lookup", "/directory/keys", "/directory/stats", "/directory/blend-lookup"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pull = free_port()
    ctrl = ControllerProc("--data-dir", str(tmp_path_factory.mktemp("data")), "--monitor-port", str(pull)).wait_ready()
    worker = WorkerSim("inst-a", 0, era="0.3", pull_url=f"127.0.0.1:{pull}", port=free_port())
    worker.register()
    worker.admit(HashProfile().chunk_hashes(SEED_TOKENS))
    wait_for(lambda: ctrl.layout(SEED_TOKENS), {"inst-a": ["LocalCPUBackend", 12]})
    yield ctrl
    worker.close()
    ctrl.stop()


def schema_of(doc: dict, path: str, method: str, status: str = "200") -> jsonschema.Draft202012Validator:
    schema = doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_the_document_is_valid_openapi_3_1_and_covers_every_route(fleet):
    resp = fleet.session.get(fleet.http + "/openapi.json", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/json")
    doc = resp.json()
    validate(doc)  # openapi-spec-validator: raises on any error
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == ROUTES
    body = doc["paths"]["/lookup"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/msgpack", "application/octet-stream"}
    assert doc["components"]["schemas"]["LookupRequest"]["required"] == ["tokens"]


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("post", "/lookup", {"tokens": SEED_TOKENS}, "200"),
    ("post", "/lookup?format=layout_info&detail=1", {"tokens": SEED_TOKENS}, "200"),
    ("post", "/lookup?detail=1", {"tokens": SEED_TOKENS}, "200"),
    ("post", "/lookup", {"tokenz": [1]}, "400"),
    ("post", "/lookup/explain", {"tokens": SEED_TOKENS}, "200"),
    ("get", "/health", None, "200"),
    ("post", "/health", {"instance_id": "inst-a"}, "200"),
    ("post", "/query_worker_info", {"instance_id": "all"}, "200"),
    ("post", "/query_instance", {"ip": "127.0.0.1"}, "200"),
    ("get", "/controller/workers", None, "200"),
    ("get", "/controller/key-stats", None, "200"),
    ("get", "/controller/overview", None, "200"),
    ("post", "/instances", {"ip": "127.0.0.1", "http_port": 8080, "instance_id": "mp-a"}, "200"),
    ("post", "/events", {"batches": []}, "200"),
    ("post", "/events", {"batches": [{"instance_id": "mp-a"}]}, "422"),
    ("get", "/directory/stats", None, "200"),
    ("get", "/healthz", None, "200"),
])
def test_real_answers_match_the_schemas(fleet, method, path, body, status):
    doc = fleet.session.get(fleet.http + "/openapi.json", timeout=10).json()
    resp = getattr(fleet.session, method)(fleet.http + path, json=body, timeout=20)
    assert str(resp.status_code) == status, resp.text
    errors = [e.message for e in schema_of(doc, path.split("?")[0], method, status).iter_errors(resp.json())]
    assert errors == [], json.dumps(resp.json())[:500]


def test_every_route_the_app_serves_is_described(fleet, redis_settings):
    """The Flask routes (url_map: every path and method) and the ASGI front's /lookup and
    /lookup/explain, against the document's paths: a new route cannot go undescribed."""
    import re

    from kvlookup.app import create_app

    app = create_app(redis_settings)
    served = {(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
              for rule in app.url_map.iter_rules() for method in rule.methods - {"HEAD", "OPTIONS"}}
    served -= {("/", "get"), ("/docs", "get"), ("/openapi.json", "get"), ("/static/{filename}", "get")}
    served |= {("/lookup", "post"), ("/lookup/explain", "post")}  # the ASGI front's own routes
    doc = fleet.session.get(fleet.http + "/openapi.json", timeout=10).json()
    described = {(path, method) for path, item in doc["paths"].items() for method in item if method != "parameters"}
    assert sorted(served ^ described) == []


def test_docs_render_swagger_ui_from_the_controller_only(fleet):
    browser = chromium.require()
    driver = chromium.start(browser)
    try:
        driver.get(fleet.http + "/docs")
        assert driver.title == "kvlookup API"
        shown = wait_for(lambda: driver.execute_script(
            "return [...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent.trim())"
            ".filter(p => p === '/lookup' || p === '/openapi.json' || p === '/controller/key-stats')"),
            ["/lookup", "/controller/key-stats"], timeout=30)
        assert shown == ["/lookup", "/controller/key-stats"]
        title = driver.execute_script("return document.querySelector('.info .title').textContent")
        assert title.startswith("kvlookup")
        hosts = driver.execute_script(
            "return [...new Set(performance.getEntriesByType('resource').map(e => new URL(e.name).host))]")
        assert hosts == [fleet.http.removeprefix("http://")]  # nothing loaded from elsewhere
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        driver.quit()
