"""The dashboard's layout in headless Chromium at 1400 and 400 px wide, measured in the DOM the
page rendered: the page never scrolls sideways, every control is inside the viewport, instance
ids are never broken or clipped (a wide table scrolls inside its panel), the explain diagnosis
wraps; and once every instance has left, the page says so instead of "No instance has
registered yet"."""

from __future__ import annotations

import json

import pytest

from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.proc.redis_server import free_port
from tests.support import browser as chromium
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.single_node
LONG_ID = "vllm-llama-3-1-8b-instruct-7f9c4d5b8-x2k4p"
PROMPT = list(range(1000, 1700))

LAYOUT = """
const vw = document.documentElement.clientWidth;
const box = (el) => el.getBoundingClientRect();
const controls = ['pause', 'interval', 'lookup-button', 'lookup-input'].map((id) => document.getElementById(id));
const id = document.querySelector('#instances td.id');
const pre = document.getElementById('explain');
return {
  page_overflow: document.documentElement.scrollWidth - vw,
  controls_outside: controls.filter((c) => { const r = box(c); return r.left < 0 || r.right > vw || r.width === 0; })
                            .map((c) => c.id),
  id_lines: id ? (() => {
    const r = document.createRange();
    r.selectNodeContents(id);
    return r.getClientRects().length;
  })() : null,
  id_clipped: id ? id.scrollWidth > id.clientWidth : null,
  explain_overflow: pre.scrollWidth - pre.clientWidth,
};
"""


@pytest.fixture()
def fleet(tmp_path):
    pull, reply = free_port(), free_port()
    ctrl = ControllerProc("--monitor-ports", json.dumps({"pull": pull, "reply": reply}),
                          "--data-dir", str(tmp_path / "data")).wait_ready()
    engine = SimEngine(LONG_ID, era="0.5", pull_url=f"127.0.0.1:{pull}", reply_url=f"127.0.0.1:{reply}")
    engine.register()
    engine.store(HashProfile().chunk_hashes(PROMPT[:512]))
    wait_for(lambda: ctrl.layout(PROMPT), {LONG_ID: ["LocalCPUBackend", 512]})
    yield ctrl, engine
    engine.close()
    ctrl.stop()


@pytest.mark.parametrize("width", [1400, 400])
def test_layout_at_desktop_and_phone_width(fleet, width):
    ctrl, _engine = fleet
    browser = chromium.require()
    driver = chromium.start(browser, width=width, height=900)
    try:
        driver.get(ctrl.http + "/")
        assert wait_for(lambda: driver.execute_script("return document.querySelectorAll('#instances td.id').length"),
                        1, timeout=30) == 1
        box = driver.find_element("id", "lookup-input")
        box.send_keys(", ".join(map(str, PROMPT)))
        driver.find_element("id", "lookup-button").click()
        wait_for(lambda: driver.find_element("id", "explain").text != "", True, timeout=30)
        measured = driver.execute_script(LAYOUT)
        assert measured == {"page_overflow": 0, "controls_outside": [], "id_lines": 1, "id_clipped": False,
                            "explain_overflow": 0}, (width, measured)
    finally:
        driver.quit()


def test_a_fleet_that_left_is_not_called_never_registered(fleet):
    ctrl, engine = fleet
    browser = chromium.require()
    driver = chromium.start(browser)
    try:
        driver.get(ctrl.http + "/")
        assert wait_for(lambda: driver.execute_script("return document.querySelectorAll('#instances td.id').length"),
                        1, timeout=30) == 1
        for worker in engine.workers:
            worker.deregister()
        shown = wait_for(lambda: driver.find_element("id", "instances-gone").is_displayed(), True, timeout=30)
        assert shown and not driver.find_element("id", "no-instances").is_displayed()
        assert "healthy" in driver.find_element("id", "status").text
    finally:
        driver.quit()
