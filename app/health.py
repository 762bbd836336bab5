"""``GET /health``: can this controller replica answer? Component by component.

The answer is built from a list of *checks* per app (``health_checks(app)``; append to it to
add components). A check is ``check(app) -> iterable of (name, detail, ok)``: ``detail`` is a
JSON-able dict, ``ok`` says whether the component is up. A name reported by several checks is
up only if every one says so; their details merge. The defaults: this worker's own Redis PING,
the states the controller's supervisor publishes (kvlookup.proc.supervise: the embedded Redis
keeper, the embedded sidecar) through the file named by ``$KVLOOKUP_STATUS_FILE``, and every
sidecar's lease and status in the registry (standalone sidecars on other hosts included).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import redis
from flask import Blueprint, Flask, current_app, jsonify

from kvlookup.index.clock import write_refusal
from kvlookup.index.fleet import sidecar_leases
from kvlookup.proc.supervise import STATUS_ENV

bp = Blueprint("health", __name__)

Component = tuple[str, dict, bool]
Check = Callable[[Flask], Iterable[Component]]
#: A status file not rewritten for this long means the supervisor (the master) is gone or stuck.
STALE_S = 5.0


def redis_check(app: Flask) -> list[Component]:
    """This worker's PING: ``("redis", {"state": "up", "ms": <round trip>}, True)`` or down with
    the error. A ``MISCONF`` refusal is an answer: Redis refuses PING with the writes when it
    cannot persist (a full disk), and reads still work, so Redis is up and ``redis writes`` says
    why it is down."""
    client = app.extensions["kvlookup"]["redis"]
    start = time.perf_counter()
    try:
        client.ping()
    except redis.RedisError as exc:
        if not str(exc).startswith("MISCONF"):
            return [("redis", {"state": "down", "error": str(exc)}, False)]
    return [("redis", {"state": "up", "ms": round((time.perf_counter() - start) * 1000, 3)}, True), *_writes(client)]


def _writes(client) -> list[Component]:
    """``redis writes``: down when Redis refuses a write (OOM under ``maxmemory`` with
    ``noeviction``: ingest stops; MISCONF: the disk under the AOF/RDB is full, ``disk_full``).
    Lookups go on answering from what is there either way."""
    try:
        text = write_refusal(client)
    except redis.RedisError:
        return []  # not a refusal: the redis component reports the connection
    if text is not None:
        return [("redis writes", {"state": "down", "error": text, "disk_full": text.startswith("MISCONF")}, False)]
    return [("redis writes", {"state": "up"}, True)]


def supervised_check(_app: Flask) -> list[Component]:
    """The supervisor's published components (none outside ``kvlookup controller``)."""
    path = os.environ.get(STATUS_ENV)
    if not path:
        return []
    try:
        status = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return [("supervisor", {"state": "down", "error": f"status file unreadable: {exc}"}, False)]
    age = time.time() - float(status.get("updated", 0))
    if age > STALE_S:
        return [("supervisor", {"state": "down", "error": f"no status for {age:.0f} s"}, False)]
    return [(name, detail, detail.get("state") == "up") for name, detail in status.get("components", {}).items()]


#: A dead sidecar fails /health at least this long after its lease ran out (see sidecars_check).
GONE_AFTER_S = 30.0


def sidecars_check(app: Flask) -> list[Component]:
    """Every sidecar that owns instances, from the registry (``keys.sidecars_key`` leases and
    ``keys.sidecar_status_key``): up while its lease holds; down (503) when the lease ran out
    and it still owns instances, until their own leases have lapsed too (``instance_ttl_s``, at
    least GONE_AFTER_S): then ``gone``, listed but no longer failing, since lookups no longer
    count its instances. A sidecar stopped on purpose signs off and is not listed.
    Detail: queued_ops, lag_ms (age of its oldest unwritten op), pid, host, lease_s (left)."""
    try:
        leases = sidecar_leases(app.extensions["kvlookup"]["redis"])
    except redis.RedisError:
        return []  # redis_check reports it
    now_ms = app.extensions["kvlookup"]["fleet"].store.clock.now_ms()  # leases are Redis server time
    gone_ms = max(app.extensions["kvlookup"]["settings"].instance_ttl_s, GONE_AFTER_S) * 1000
    out = []
    for lease in leases:
        up = lease.expiry_ms >= now_ms
        if not up and not lease.owned:
            continue  # gone for good, and nothing depends on it any more
        gone = now_ms - lease.expiry_ms > gone_ms
        detail = {"state": "up" if up else "gone" if gone else "down", "owned_instances": lease.owned,
                  "lease_s": round((lease.expiry_ms - now_ms) / 1000, 1),
                  **{k: v for k, v in lease.status.items() if k in ("queued_ops", "lag_ms", "pid", "host")}}
        out.append((f"sidecar {lease.sidecar_id}", detail, up or gone))
    return out


DEFAULT_CHECKS: tuple[Check, ...] = (redis_check, supervised_check, sidecars_check)


def health_checks(app: Flask) -> list[Check]:
    """The app's list of checks (the defaults until changed); append to add components."""
    return app.extensions["kvlookup"].setdefault("health_checks", list(DEFAULT_CHECKS))


def components(app: Flask) -> tuple[dict[str, dict], bool]:
    """Run every check: ``({name: detail}, all up)``; each detail carries ``state``."""
    out: dict[str, dict] = {}
    up: dict[str, bool] = {}
    for check in health_checks(app):
        for name, detail, ok in check(app):
            merged = dict(out.get(name, {}))
            merged.update({k: v for k, v in detail.items() if v is not None or k not in merged})
            if up.get(name, True) and not ok:
                merged["state"] = detail.get("state") or "down"
            elif up.get(name, True):
                merged["state"] = detail.get("state") or "up"  # up, or a state that does not fail (gone)
            else:
                merged["state"] = out[name]["state"]
            out[name], up[name] = merged, up.get(name, True) and ok
    return out, all(up.values())


@bp.get("/health")
def health():
    """200 ``{"status": "ok", "redis": "ok", "redis_ms": ..., "components": {...}}``; 503 with
    ``"status": "unavailable"`` while any component is down (``"redis": "unreachable"`` and
    ``"error"`` when it is Redis). Each component: ``{"state": "up"|"down"|..., ...}``."""
    found, ok = components(current_app)
    redis_detail = found.get("redis", {})
    body: dict = {"status": "ok" if ok else "unavailable"}
    if redis_detail.get("state") == "up":
        body.update(redis="ok", redis_ms=redis_detail.get("ms"))
    else:
        body.update(redis="unreachable", error=redis_detail.get("error"))
    body["components"] = found
    return jsonify(body), 200 if ok else 503
