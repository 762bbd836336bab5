"""``kvlookup sidecar --vllm-url``: endpoints and model from a vLLM 0.33 server's HTTP API.

The server is simulated: a small HTTP server answering ``GET /kv_event_sources`` and
``/v1/models`` in vLLM 0.33's shapes (vllm/entrypoints/serve/instrumentator/basic.py:59-63: a
map dp rank -> the publisher's resolved KVEventsConfig), in front of one loopback publisher per
DP rank. The sidecar is the real ``python -m kvlookup sidecar`` process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlookup.client import Client, VllmChains
from kvlookup.proc.redis_server import free_port
from kvlookup.sidecar.vllm_discovery import DiscoveryError, _reachable, discover
from tests.support.helpers import vllm_sidecar, wait_for
from tests.support.procs import ROOT, ControllerProc, SidecarProc
from tests.support.vllm_helpers import LoopbackPublisher, dp_publishers, layout, payload, stored

A = list(range(1000, 1032))
B = list(range(2000, 2016))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class FakeVllmServer:
    """/kv_event_sources and /v1/models as vLLM 0.33 serves them; ``sources`` may be changed
    (an engine restarted on other ports); ``old`` answers 404 there, as servers before 0.33."""

    def __init__(self, sources: dict, model: str = MODEL, old: bool = False, port: int = 0):
        self.sources, self.model, self.old = sources, model, old
        outer = self

        class SourcesHandler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path == "/kv_event_sources" and not outer.old:
                    body = outer.sources
                elif self.path == "/v1/models":
                    body = {"object": "list", "data": [{"id": outer.model, "object": "model", "owned_by": "vllm"}]}
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), SourcesHandler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def events_config(pub: LoopbackPublisher, topic: str = "kv@pod") -> dict:
    """A rank's KVEventsConfig as vLLM resolves it: bound on every interface (``*``)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub.port}",
            "replay_endpoint": f"tcp://*:{pub.replay_port}", "buffer_steps": 10000, "hwm": 100000,
            "max_queue_size": 100000, "topic": topic}


def test_discover_reads_every_rank_and_the_model():
    pubs = dp_publishers(topic=b"kv@pod")
    server = FakeVllmServer({str(r): events_config(p) for r, p in enumerate(pubs)})
    try:
        found = discover(server.url)
        assert found.model == MODEL
        assert [(rs.rank, rs.endpoint, rs.replay_endpoint, rs.topic, rs.bind) for rs in found.ranks] == [
            (r, f"tcp://127.0.0.1:{p.port}", f"tcp://127.0.0.1:{p.replay_port}", "kv@pod", False)
            for r, p in enumerate(pubs)]
        free = free_port()
        server.sources = {"0": {**events_config(pubs[0]), "endpoint": f"tcp://127.0.0.1:{free}"}}  # vLLM connects
        assert discover(server.url).ranks[0].bind is True
    finally:
        server.close()
        for p in pubs:
            p.close()


def test_bind_or_connect_as_vllm_resolved_the_endpoint():
    """vLLM binds ``*``, ``::`` and ipc endpoints and connects to the rest (kv_events.py
    ``_is_bind_endpoint``), but reports ``tcp://*:0`` as the concrete address it bound (``_bind``):
    a concrete endpoint this host cannot bind (not its address, or a listener on the port) was
    bound by vLLM; one it can bind is where vLLM connects; one the sidecar uses keeps its decision."""
    listener = LoopbackPublisher()  # a port with a listener: what vLLM's tcp://*:0 leaves
    free = free_port()
    try:
        cases = {
            f"tcp://*:{free}": (f"tcp://pod:{free}", False),
            f"tcp://0.0.0.0:{free}": (f"tcp://pod:{free}", False),
            "tcp://[::]:5557": ("tcp://pod:5557", False),
            "tcp://[fd00::5]:5557": ("tcp://[fd00::5]:5557", False),  # holds "::": vLLM binds
            "ipc:///tmp/kv": ("ipc:///tmp/kv", False),
            f"tcp://127.0.0.1:{listener.port}": (f"tcp://127.0.0.1:{listener.port}", False),
            "tcp://192.0.2.7:5557": ("tcp://192.0.2.7:5557", False),  # not this host's: vLLM bound it
            f"tcp://127.0.0.1:{free}": (f"tcp://127.0.0.1:{free}", True),  # vLLM connects here
        }
        assert {e: _reachable(e, "pod") for e in cases} == cases
        own = f"tcp://127.0.0.1:{listener.port}"
        assert _reachable(own, "pod", {own: True}) == (own, True)  # the sidecar's own bind, kept
        gone = f"tcp://127.0.0.1:{free}"  # what a stopped engine had bound: the port is free now
        assert _reachable(gone, "pod", {gone: False}) == (gone, False)  # still connected to
    finally:
        listener.close()


def test_older_server_one_line_error(redis_args):
    server = FakeVllmServer({}, old=True)
    try:
        with pytest.raises(DiscoveryError, match="older than 0.33"):
            discover(server.url)
        out = subprocess.run([sys.executable, "-m", "kvlookup", "sidecar", *redis_args, "--vllm-url", server.url],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"kvlookup: error: {server.url}/kv_event_sources answered 404: vLLM older than 0.33 has no "
            "/kv_event_sources; give --vllm-endpoint (and --vllm-replay-endpoint) instead"]
    finally:
        server.close()


def test_vllm_url_alone_subscribes_every_rank_scopes_by_model_and_follows_a_restart(r, redis_args):
    pubs = dp_publishers(topic=b"kv@pod")
    server = FakeVllmServer({str(rank): events_config(p) for rank, p in enumerate(pubs)})
    ctl = ControllerProc(*redis_args, "--workers", "1").wait_ready()
    sc = SidecarProc(*redis_args, "--vllm-url", server.url).start()
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    inst = server.url.removeprefix("http://")
    try:
        pubs[0].publish(payload(stored([1], A[:16])), send=False)  # before the sidecar listened: caught up
        pubs[1].publish(payload(stored([1, 2], A, rank=1), rank=1))
        want = {inst: ("GPU", 32, {"0": 16, "1": 32})}
        assert wait_for(lambda: layout(client, A, "ranks", model_name=MODEL), want) == want
        assert layout(client, A, "ranks", model_name="another-model") == {}
        assert layout(client, A, "ranks") == want  # no model named: every instance
        def http(model: str) -> dict:  # POST /lookup through the real controller
            got = ctl.session.post(f"{ctl.http}/lookup", json={"tokens": A, "model_name": model}, timeout=10).json()
            return {k: v for k, v in got.items() if k != "event_id"}

        assert wait_for(lambda: http(MODEL), {inst: ["GPU", 32]}) == {inst: ["GPU", 32]}
        assert http("another-model") == {}
        # the engine restarts on other ports: the sidecar reads /kv_event_sources again
        for p in pubs:
            p.close()
        pubs = dp_publishers(topic=b"kv@pod")
        server.sources = {str(rank): events_config(p) for rank, p in enumerate(pubs)}
        pubs[1].publish(payload(stored([7], B, rank=1), rank=1), send=False)
        want = {inst: ("GPU", 16, {"1": 16})}
        assert wait_for(lambda: layout(client, B, "ranks", model_name=MODEL), want, timeout=8.0) == want
        assert layout(client, A, "ranks") == {}  # the restarted engine's cache is empty
    finally:
        sc.stop()
        ctl.stop()
        server.close()
        for p in pubs:
            p.close()


def test_older_server_with_vllm_endpoint_falls_back_to_it(r, redis_args, tmp_path):
    """``--vllm-url`` of a server older than 0.33 beside ``--vllm-endpoint``: the one line is logged
    and the sidecar subscribes to the endpoint given."""
    server = FakeVllmServer({}, old=True)
    pub = LoopbackPublisher(topic=b"kv@pod")
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    sc = SidecarProc(*redis_args, "--log-level", "INFO", "--vllm-url", server.url, "--instance-id", "pod-a",
                     "--vllm-endpoint", pub.endpoint, "--vllm-replay-endpoint", pub.replay_endpoint,
                     log=tmp_path / "sidecar.log").start()
    try:
        pub.publish(payload(stored([1, 2], A)), send=False)  # caught up from replay at start
        want = {"pod-a": ("GPU", 32)}
        assert wait_for(lambda: layout(client, A), want) == want
        assert [line.split("WARNING", 1)[-1].split(": ", 1)[-1] for line in sc.lines("older than 0.33")] == [
            f"{server.url}/kv_event_sources answered 404: vLLM older than 0.33 has no /kv_event_sources; "
            f"give --vllm-endpoint (and --vllm-replay-endpoint) instead; using --vllm-endpoint {pub.endpoint}"]
    finally:
        sc.stop()
        server.close()
        pub.close()


def test_sidecar_waits_for_a_server_still_loading(r, redis_args, tmp_path):
    """At start the vLLM server does not answer yet (its engine is loading the model): the sidecar
    says so once and asks again until it answers, instead of exiting."""
    port = free_port()
    pub = LoopbackPublisher(topic=b"kv@pod")
    url = f"http://127.0.0.1:{port}"
    servers: list[FakeVllmServer] = []
    later = threading.Timer(3.0, lambda: servers.append(FakeVllmServer({"0": events_config(pub)}, port=port)))
    later.start()
    sc = SidecarProc(*redis_args, "--vllm-url", url, log=tmp_path / "sidecar.log")
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    try:
        sc.start(timeout=30)
        assert len(sc.lines("waiting for the vLLM server")) == 1
        pub.publish(payload(stored([1, 2], A)))
        want = {f"127.0.0.1:{port}": ("GPU", 32)}
        assert wait_for(lambda: layout(client, A, model_name=MODEL), want) == want
    finally:
        later.cancel()
        later.join()
        sc.stop()
        for server in servers:
            server.close()
        pub.close()


def test_rediscovery_outlasts_a_long_restart(r, monkeypatch):
    """An engine restart that keeps the server down past the fast retries (a model reload takes
    minutes) is still followed: the URL is asked again, slower, until it answers."""
    from kvlookup.sidecar import vllm_zmq

    monkeypatch.setattr(vllm_zmq, "REDISCOVER_AFTER_S", 0.1)
    monkeypatch.setattr(vllm_zmq, "REDISCOVER_EVERY_S", 0.1)
    monkeypatch.setattr(vllm_zmq, "REDISCOVER_TRIES", 3)
    monkeypatch.setattr(vllm_zmq, "REDISCOVER_SLOW_S", 0.5)
    pub = LoopbackPublisher(topic=b"kv@pod")
    server = FakeVllmServer({"0": events_config(pub)})
    port = server.httpd.server_address[1]
    source = vllm_zmq.VllmSource.discovered("pod-a", server.url, discover(server.url), replay_timeout_s=0.5)
    sc = vllm_sidecar(r, source)
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    try:
        pub.publish(payload(stored([1, 2], A)))
        assert wait_for(lambda: layout(client, A), {"pod-a": ("GPU", 32)}) == {"pod-a": ("GPU", 32)}
        pub.close()  # the engine stops, and so does its API server, for longer than the fast retries
        server.close()
        time.sleep(2.0)
        pub = LoopbackPublisher(topic=b"kv@pod")  # back on other ports
        server = FakeVllmServer({"0": events_config(pub)}, port=port)
        pub.publish(payload(stored([7], B)), send=False)
        want = {"pod-a": ("GPU", 16)}
        assert wait_for(lambda: layout(client, B), want, timeout=5.0) == want
    finally:
        sc.close()
        server.close()
        pub.close()
