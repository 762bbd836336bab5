"""``GET /controller/overview``: the fleet at a glance, for the dashboard (``GET /``).

One JSON document, read from the registry in Redis in a few pipelined round trips (no SCAN):
instances with their workers, liveness and records per location (kvlookup.index.fleet), the
sidecars' leases (kvlookup.index.fleet.sidecar_leases) and the index's size and memory (``DBSIZE`` and
``INFO memory``, summed over every master on a Redis Cluster). A Redis error answers 503
``{"error": "index unavailable: ..."}`` (app.errors).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify

from kvlookup import kinds
from kvlookup.index import instances as index_instances
from kvlookup.index.fleet import Fleet, WorkerInfo, sidecar_leases

bp = Blueprint("overview", __name__)


def _worker_row(fleet: Fleet, w: WorkerInfo, counts: dict[str, int], instance_alive: bool, now: float) -> dict:
    """One worker: WorkerInfo's fields, epoch, live, last contact (unix s: registration, last
    heartbeat or last answer to a health call, whichever is latest), records per location."""
    return {
        **w.lmcache(),
        "epoch": w.epoch,
        "live": fleet.worker_live(w, instance_alive, now),
        "heartbeats": w.heartbeats,
        "probed_at": w.probed_at or None,
        "last_contact": max(w.registration_time, w.last_heartbeat_time, w.probed_at) or None,
        "key_count": sum(counts.values()),
        "locations": dict(sorted(counts.items())),
    }


def instances(fleet: Fleet, now: float) -> list[dict]:
    """Every registered instance, sorted by id: ``{"instance_id", "kind", "live", "lease_s"
    (seconds its liveness lease has left; None when liveness is off or it has none), "owner"
    (sidecar id), "key_count", "locations": {location: records}, "workers": [...]}``.
    ``key_count`` is what ``/controller/key-stats`` reports for the instance."""
    workers = fleet.workers()
    ids = sorted({w.instance_id for w in workers} | set(fleet.instance_ids()))
    counts = fleet.key_counts(workers)
    facts = index_instances.facts(fleet.r, ids)
    alive = fleet.alive(ids, now)
    rows: dict[str, dict[str, Any]] = {}
    for inst, f in zip(ids, facts, strict=True):
        lease = f.lease_ms
        rows[inst] = {"instance_id": inst, "kind": kinds.of(f.kind).name, "live": alive[inst],
                      "lease_s": None if lease is None or fleet.store.instance_ttl_ms <= 0
                      else round(lease / 1000 - now, 1),
                      "owner": f.owner, "key_count": 0, "locations": {}, "workers": []}
    for w, c in zip(workers, counts, strict=True):
        row = rows[w.instance_id]
        row["workers"].append(_worker_row(fleet, w, c, alive[w.instance_id], now))
        row["key_count"] += sum(c.values())
        for loc, n in c.items():
            row["locations"][loc] = row["locations"].get(loc, 0) + n
    for row in rows.values():
        row["locations"] = dict(sorted(row["locations"].items()))
    return [rows[inst] for inst in ids]


def sidecars(r, now: float) -> list[dict]:
    """Every sidecar holding a lease: ``{"sidecar_id", "live", "lease_s", "owned_instances",
    "host", "pid", "queued_ops", "lag_ms", "started_at", "updated_at"}`` (status fields as the
    sidecar last published them; absent ones are None)."""
    out = []
    for lease in sidecar_leases(r):
        row = {"sidecar_id": lease.sidecar_id, "live": lease.expiry_ms >= now * 1000,
               "lease_s": round(lease.expiry_ms / 1000 - now, 1), "owned_instances": lease.owned}
        for name in ("host", "pid", "queued_ops", "lag_ms", "started_at", "updated_at"):
            row[name] = lease.status.get(name)
        out.append(row)
    return out


def index_size(r) -> dict:
    """``{"keys": DBSIZE, "used_memory_bytes", "maxmemory_bytes" (0: no limit), "masters"}``,
    summed over every master of a Redis Cluster (the replicas hold copies)."""
    from redis.cluster import RedisCluster

    if isinstance(r, RedisCluster):
        # one master answers with its INFO, several with {node: INFO}
        per_node = r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        infos: list[dict[str, Any]] = [per_node] if "used_memory" in per_node else list(per_node.values())
        n_keys = r.dbsize(target_nodes=RedisCluster.PRIMARIES)
    else:
        infos, n_keys = [r.info("memory")], r.dbsize()
    return {"keys": int(n_keys), "used_memory_bytes": sum(int(i.get("used_memory", 0)) for i in infos),
            "maxmemory_bytes": sum(int(i.get("maxmemory", 0)) for i in infos), "masters": len(infos)}


def overview(ext: dict, now: float | None = None) -> dict:
    """The whole document (``ext``: the app's ``extensions["kvlookup"]``): ``{"generated_at",
    "instances", "totals", "sidecars", "index", "settings", "features"}``. Raises
    redis.RedisError when Redis cannot be read."""
    now = ext["fleet"].store.clock.now() if now is None else now  # liveness is Redis server time
    fleet, settings = ext["fleet"], ext["settings"]
    rows = instances(fleet, now)
    workers = [w for row in rows for w in row["workers"]]
    totals = {"instances": len(rows), "live_instances": sum(1 for row in rows if row["live"]),
              "workers": len(workers), "live_workers": sum(1 for w in workers if w["live"]),
              "records": sum(row["key_count"] for row in rows)}
    return {
        "generated_at": round(now, 3),
        "instances": rows,
        "totals": totals,
        "sidecars": sidecars(ext["redis"], now),
        "index": index_size(ext["redis"]),
        "settings": {"chunk_size": ext["client"].profile.chunk_size, "instance_ttl_s": settings.instance_ttl_s,
                     "worker_ttl_s": settings.worker_ttl_s, "max_tokens": settings.max_tokens},
        "features": {"tokenize": "tokenize" in current_app.blueprints},
        "mp_instances": mp_instances(ext["mp"], now) if "mp" in ext else [],
    }


def mp_instances(d, now: float) -> list[dict]:
    """LMCache MP instances for the dashboard: registration, liveness, gate cursor (incarnation,
    gap, dropped events), departure, declared capacity per (tier, backend) and L1 keys."""
    regs = {i["instance_id"]: i for i in d.instances()}
    beats = d.heartbeats()
    cursors, departed, capacity = d.cursors(), d.departed(), d.capacity()
    l1 = d.stats()["l1_keys_by_instance"]
    rows = []
    for inst in sorted(set(regs) | set(cursors) | set(departed)):
        reg, cur = regs.get(inst, {}), cursors.get(inst, {})
        hb = beats.get(inst)
        rows.append({
            "instance_id": inst, "registered": inst in regs, "ip": reg.get("ip"), "http_port": reg.get("http_port"),
            "live": hb is not None and now - hb / 1000 <= d.instance_timeout_s,
            "last_heartbeat_age_s": None if hb is None else round(now - hb / 1000, 1),
            "incarnation": cur.get("incarnation"), "last_seq": cur.get("last_seq"),
            "gap": bool(cur.get("gap_detected")), "missing_batches": cur.get("missing_batches", 0),
            "events_dropped": cur.get("events_dropped", 0), "departed": departed.get(inst),
            "modules": capacity.get(inst, {}).get("modules", []), "l1_keys": l1.get(inst, 0)})
    return rows


@bp.get("/controller/overview")
def controller_overview():
    """200 with :func:`overview`'s document; 503 ``{"error"}`` when Redis is unreadable."""
    return jsonify(overview(current_app.extensions["kvlookup"]))
