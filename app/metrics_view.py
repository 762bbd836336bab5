"""``GET /metrics``: Prometheus text.

Counters and histograms (lookups, ingest ops, rejected frames, seq gaps, resyncs, reaped
workers, control calls) live in each process. When ``PROMETHEUS_MULTIPROC_DIR`` is set
(``kvlookup controller`` sets it for its gunicorn workers and embedded sidecar) they are
summed over every process writing there; otherwise this process's own values are served.
Fleet gauges come from Redis at scrape time (kvlookup.app.fleet_metrics).
"""

from __future__ import annotations

import os

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from kvlookup.app.fleet_metrics import FleetCollector

bp = Blueprint("metrics", __name__)


def build_registries(fleet) -> list[CollectorRegistry]:
    """The registries one scrape reads: process (or multiprocess) metrics, then fleet gauges."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        process = CollectorRegistry()
        multiprocess.MultiProcessCollector(process)
    else:
        process = REGISTRY
    fleet_registry = CollectorRegistry(auto_describe=False)
    fleet_registry.register(FleetCollector(fleet))
    return [process, fleet_registry]


@bp.get("/metrics")
def metrics():
    registries = current_app.extensions["kvlookup"]["metrics_registries"]
    body = b"".join(generate_latest(reg) for reg in registries)
    return Response(
        body, mimetype=CONTENT_TYPE_LATEST.split(";")[0], headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
