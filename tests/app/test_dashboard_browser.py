"""GET / in a real browser: a real controller (gunicorn, embedded sidecar on --monitor-ports)
with real traffic (simulated LMCache engines registering and storing over ZMQ), loaded in
headless Chromium; the assertions read the DOM the page's own JavaScript rendered.

``KVLOOKUP_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` also saves the screenshot the README
shows (tests/support/browser.py says what the browser needs).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import requests

from kvlookup.app import tokenizer
from kvlookup.devtools.workersim import SimEngine, WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import staleness
from kvlookup.proc.redis_server import connect, free_port, running_url
from tests.support import browser as chromium
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.single_node  # the overview on a cluster: tests/app/test_dashboard.py
PROFILE = HashProfile()
PROMPT_A = list(range(1000, 2024))  # 4 chunks of 256
TEXT_B = "You are the support assistant of Northwind Bank. How long does a wire to Germany take?"


def _traffic(ctrl: ControllerProc, pull: int, reply: int) -> tuple[SimEngine, WorkerSim, list[int]]:
    """pod-a: a 0.5-era engine with 2 TP ranks holding PROMPT_A (CPU) and its first half (disk);
    pod-b: a 0.3-era worker holding TEXT_B's tokens (or a short token prompt without a tokenizer)."""
    engine = SimEngine("pod-a", era="0.5", pull_url=f"127.0.0.1:{pull}", reply_url=f"127.0.0.1:{reply}", tp=2)
    engine.register()
    engine.heartbeat()
    engine.store(PROFILE.chunk_hashes(PROMPT_A))
    engine.store(PROFILE.chunk_hashes(PROMPT_A[:512]), location="LocalDiskBackend")
    if tokenizer.available():
        tokens_b = requests.post(ctrl.http + "/tokenize", json={"text": "<|begin_of_text|>" + TEXT_B},
                                 timeout=10).json()["tokens"]
    else:
        tokens_b = [128000, 849, 21435, 279]
    worker = WorkerSim("pod-b", 0, era="0.3", pull_url=f"127.0.0.1:{pull}", port=free_port())
    worker.register()
    worker.admit(PROFILE.chunk_hashes(tokens_b), location="LocalDiskBackend")
    return engine, worker, tokens_b


def _records(ctrl: ControllerProc) -> dict[str, int]:
    stats = ctrl.session.get(ctrl.http + "/controller/key-stats", timeout=5).json()
    return {i["instance_id"]: i["key_count"] for i in stats["instances"]}


def _rendered(driver) -> dict[str, int]:
    """Instance id -> records, as the page shows them."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#instances tr.instance')]"
        ".map(r => [r.dataset.instance, Number(r.querySelector('td.records').dataset.value)]))")


def _until(fn, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _look_up(driver, text: str, mode: str = "tokens") -> dict[str, int]:
    """Type a prompt in the lookup box, submit, return instance -> matched tokens shown."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, f"input[name=mode][value={mode}]").click()
    box = driver.find_element(By.ID, "lookup-input")
    box.clear()
    box.send_keys(text)
    before = driver.find_element(By.ID, "lookup-status").text
    driver.find_element(By.ID, "lookup-button").click()
    _until(lambda: driver.find_element(By.ID, "lookup-status").text not in (before, "looking up…"))
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#lookup-result tbody tr')]"
        ".map(r => [r.dataset.instance, Number(r.querySelector('td.matched').textContent.replace(/,/g, ''))]))")


def test_the_dashboard_shows_the_fleet_and_answers_lookups(tmp_path):
    browser = chromium.require()
    pull, reply = free_port(), free_port()
    ctrl = ControllerProc("--monitor-ports", json.dumps({"pull": pull, "reply": reply}),
                          "--data-dir", str(tmp_path / "data"),
                          env={"KVLOOKUP_API_TOKEN": "dashboard-test-token"}).wait_ready()
    engine = worker = driver = None
    try:
        engine, worker, tokens_b = _traffic(ctrl, pull, reply)
        want = {"pod-a": 2 * (4 + 2), "pod-b": len(PROFILE.chunk_hashes(tokens_b))}
        assert wait_for(lambda: _records(ctrl), want) == want
        for n in (300, 700, 1024, 10):
            ctrl.lookup(PROMPT_A[:n])
        assert requests.post(ctrl.http + "/clear", json={"instance_id": "pod-a", "location": "x"},
                             timeout=5).status_code == 401  # the token is on; the page needs none

        driver = chromium.start(browser)
        driver.get(ctrl.http + "/")
        assert _until(lambda: _rendered(driver) == _records(ctrl)), (_rendered(driver), _records(ctrl))
        assert driver.title == "kvlookup fleet"
        ranks = driver.execute_script(
            "return [...document.querySelectorAll('#instances tr.worker')].map(r => r.dataset.instance + '/' "
            "+ r.dataset.worker)")
        assert ranks == ["pod-a/0", "pod-a/1", "pod-b/0"]
        assert driver.find_element("id", "card-records").get_attribute("data-value") == str(sum(want.values()))
        assert "healthy" in driver.find_element("id", "status").text

        shown = _look_up(driver, ", ".join(map(str, PROMPT_A[:700])))
        assert shown == {k: v[1] for k, v in ctrl.layout(PROMPT_A[:700]).items()} == {"pod-a": 512}
        explain = requests.post(ctrl.http + "/lookup/explain", json={"tokens": PROMPT_A[:700]}, timeout=5)
        assert driver.find_element("id", "explain-panel").is_displayed() == (explain.status_code == 200)
        if tokenizer.available():
            assert _look_up(driver, TEXT_B, mode="text") == {"pod-b": len(tokens_b)}
        assert "not an integer" in _look_up_error(driver, "1, 2, x")

        # an instance whose sidecar was killed is flagged (kvlookup.index.staleness), with why on hover
        staleness.mark(connect(running_url(tmp_path / "data")), ["pod-b"], 1_700_000_000_000, "sidecar killed")
        flagged = "return [...document.querySelectorAll('#instances tr.instance')].filter(r => " \
                  "r.querySelector('.stale')).map(r => [r.dataset.instance, r.querySelector('.stale').title])"
        assert _until(lambda: driver.execute_script(flagged)) == [["pod-b", "sidecar killed"]]

        for n in (256, 512, 800):  # traffic between two scrapes draws the lookup chart
            ctrl.lookup(PROMPT_A[:n])
        assert _until(lambda: driver.execute_script(
            "return document.querySelectorAll('#chart-lookups polyline').length > 0"
            " && document.querySelectorAll('#chart-hit-ratio polyline').length > 0"))
        median = "return KvMetrics.quantile(0.5, [], [{le: 1, count: 2}, {le: Infinity, count: 2}])"
        assert driver.execute_script(median) == 0.5
        _screenshot(driver, tmp_path)
        logs = driver.get_log("browser")
        assert [e for e in logs if e["level"] == "SEVERE" and "/lookup/explain" not in e["message"]] == []
    finally:
        if driver is not None:
            driver.quit()
        if engine is not None:
            engine.close()
        if worker is not None:
            worker.close()
        ctrl.stop()


def _look_up_error(driver, text: str) -> str:
    _look_up(driver, text)
    return driver.find_element("id", "lookup-status").text


def _screenshot(driver, tmp_path) -> None:
    """The whole page, into tmp_path and, when asked, where KVLOOKUP_DASHBOARD_SCREENSHOT says."""
    height = driver.execute_script("window.scrollTo(0, 0); return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1366, "height": int(height), "deviceScaleFactor": 1, "mobile": False})
    path = tmp_path / "dashboard.png"
    driver.save_screenshot(str(path))
    target = os.environ.get("KVLOOKUP_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copy(path, target)
