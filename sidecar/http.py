"""A standalone sidecar's HTTP port (``metrics_port``): ``GET /metrics`` and ``GET /health``.

Served by the standard library's WSGI server in a daemon thread (one request at a time is
plenty for scrapes and probes); ``/metrics`` is prometheus-client's WSGI app.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import make_wsgi_app

from kvlookup import __version__

#: A loop turn older than this means the ingest loop is stuck.
STALLED_S = 5.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, *_args) -> None:  # scrapes every few seconds would flood the log
        pass


def health(sidecar) -> tuple[int, dict]:
    """(status code, body) of ``GET /health``: 503 while Redis is unreachable, the ingest loop
    has not turned for ``STALLED_S`` or the vLLM thread died.

    Body: ``{"status", "sidecar_id", "version", "components": {"redis", "loop", "vllm"?}}``;
    ``loop`` carries ``queued_ops``, ``lag_ms`` (age of the oldest unwritten op) and
    ``last_turn_s`` (seconds since the loop last turned).
    """
    comps: dict[str, dict] = {}
    try:
        start = time.perf_counter()
        sidecar.store.r.ping()
        comps["redis"] = {"state": "up", "ms": round((time.perf_counter() - start) * 1000, 3)}
    except redis.RedisError as exc:
        comps["redis"] = {"state": "down", "error": str(exc)}
    age = time.monotonic() - sidecar.last_turn
    comps["loop"] = {"state": "up" if age < STALLED_S else "stalled", "last_turn_s": round(age, 3),
                     "queued_ops": sidecar.lmcache.queued_ops, "lag_ms": round(sidecar.lmcache.lag_s() * 1000, 1)}
    if sidecar.vllm is not None:
        alive = sidecar.vllm.thread.is_alive()
        comps["vllm"] = {"state": "up" if alive else "down", "instances": sorted(sidecar.vllm.ingests)}
    ok = all(c["state"] == "up" for c in comps.values())
    return (200 if ok else 503), {"status": "ok" if ok else "unavailable", "sidecar_id": sidecar.sidecar_id,
                                  "version": __version__, "components": comps}


def serve(sidecar, host: str, port: int) -> WSGIServer:
    """Start serving ``/metrics`` and ``/health`` on host:port in a daemon thread."""
    metrics_app = make_wsgi_app()

    def app(environ: dict, start_response: Callable):
        if environ.get("PATH_INFO") == "/health":
            code, body = health(sidecar)
            data = json.dumps(body).encode()
            start_response(f"{code} {'OK' if code == 200 else 'Service Unavailable'}",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
            return [data]
        return metrics_app(environ, start_response)

    server = make_server(host, port, app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kvlookup-sidecar-http", daemon=True).start()
    return server
