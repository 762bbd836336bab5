"""Issue 20 item 10 (part): security defaults that match the deployment.

Real gunicorn + uvicorn controller bound to loopback with no ``api_token`` (the default):
- a cross-origin ``text/plain`` POST (what any web page may send without a preflight) to a
  mutating endpoint is refused (415), and so is any mutating call a browser sends (``Origin``:
  403); a JSON call from a program (no Origin) passes the guard;
- DNS rebinding: a request whose ``Host`` is not a loopback name is answered 421, on the Flask
  routes and on /lookup alike.
"""

from __future__ import annotations

import requests

from tests.conftest import SEED_TOKENS
from tests.support.procs import ControllerProc


def test_mutating_calls_from_web_pages_and_rebinding_hosts_are_refused(redis_args):
    ctl = ControllerProc(*redis_args, "--workers", "1").wait_ready()
    url = ctl.http
    body = '{"instance_id": "victim", "location": "LocalCPUBackend"}'
    try:
        for path in ("/clear", "/pin", "/compress", "/decompress", "/move"):
            resp = requests.post(url + path, data=body, headers={"Content-Type": "text/plain"}, timeout=5)
            assert resp.status_code == 415, (path, resp.status_code, resp.text)
            assert resp.json() == {"error": "Content-Type must be application/json"}
            resp = requests.post(url + path, data=body, timeout=5,
                                 headers={"Content-Type": "application/json", "Origin": "http://evil.example"})
            assert resp.status_code == 403
            assert "need api_token" in resp.json()["error"]
        resp = requests.post(url + "/clear", data=body, headers={"Content-Type": "application/json"}, timeout=5)
        assert resp.status_code not in (403, 415)  # a program's call passes the guard
        port = url.rsplit(":", 1)[1]
        for path, method in (("/health", "GET"), ("/lookup", "POST"), ("/lookup/explain", "POST")):
            resp = requests.request(method, url + path, json={"tokens": SEED_TOKENS}, timeout=5,
                                    headers={"Host": f"rebind.attacker.example:{port}"})
            assert resp.status_code == 421, (path, resp.status_code)
            ok = requests.request(method, url + path, json={"tokens": SEED_TOKENS}, timeout=5,
                                  headers={"Host": f"localhost:{port}"})
            assert ok.status_code == 200, (path, ok.status_code, ok.text)
    finally:
        ctl.stop()
