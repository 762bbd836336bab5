"""``GET /health``: is Redis reachable from this controller replica?"""

from __future__ import annotations

import time

import redis
from flask import Blueprint, current_app, jsonify

bp = Blueprint("health", __name__)


@bp.get("/health")
def health():
    """200 ``{"status": "ok", "redis": "ok", "redis_ms": <round trip>}``; 503 when Redis is down."""
    client = current_app.extensions["kvlookup"]["redis"]
    start = time.perf_counter()
    try:
        client.ping()
    except redis.RedisError as exc:
        return jsonify(status="unavailable", redis="unreachable", error=str(exc)), 503
    return jsonify(status="ok", redis="ok", redis_ms=round((time.perf_counter() - start) * 1000, 3))
