"""Registry queries: /query_instance, /query_worker_info, /controller/workers, /controller/key-stats.

Shapes are LMCache 0.5.6's (docs/lmcache-protocol.md §3). Differences:
/query_instance tells instances on one IP apart by port (``"port"`` field, or ``"ip":
"host:port"``), answers 409 listing the candidates when an IP alone is ambiguous, and 404
JSON (``"res": null``) for an unknown IP instead of a 500. ``/controller/workers`` adds
``live`` and ``epoch`` to each worker.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from flask import Blueprint, current_app, jsonify, request

from kvlookup.app.control import Name, parse
from kvlookup.app.errors import ApiError
from kvlookup.client import new_event_id
from kvlookup.index.fleet import Fleet, WorkerInfo

bp = Blueprint("registry", __name__)


class QueryInstanceRequest(msgspec.Struct):
    ip: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
    event_id: str = ""
    port: Annotated[int, msgspec.Meta(ge=0, lt=65536)] | None = None


class QueryWorkerInfoRequest(msgspec.Struct):
    instance_id: Name
    worker_ids: list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]] | None = None


def _fleet() -> Fleet:
    return current_app.extensions["kvlookup"]["fleet"]


def _split_host_port(ip: str, port: int | None) -> tuple[str, int | None]:
    """``"10.0.0.1:8001"`` / ``"[::1]:8001"`` -> (host, port); a bare IP keeps ``port``."""
    if port is None:
        if ip.startswith("[") and "]:" in ip:
            host, tail = ip[1:].split("]:", 1)
        elif ip.count(":") == 1:
            host, tail = ip.split(":")
        else:
            return ip.strip("[]"), None
        if tail.isdigit() and int(tail) < 65536:
            return host, int(tail)
        raise ApiError(400, f"invalid request: 'ip' {ip[:80]!r} has a bad port")
    return ip.strip("[]"), port


@bp.post("/query_instance")
def query_instance():
    """``{"ip", "port"?}`` -> ``{"event_id":"QueryInst<uuid>","res":"<instance_id>"}``."""
    req = parse(QueryInstanceRequest)
    ip, port = _split_host_port(req.ip, req.port)
    eid = new_event_id("QueryInst")
    found = _fleet().instances_on_ip(ip)
    if port is not None:
        found = [(p, inst) for p, inst in found if p == port]
    instances = sorted({inst for _p, inst in found})
    if not instances:
        where = f"{ip}:{port}" if port is not None else ip
        return jsonify(event_id=eid, res=None, error=f"no instance registered from {where}"), 404
    if len(instances) > 1:
        return jsonify(
            event_id=eid,
            res=None,
            error=f"{len(instances)} instances registered from {ip}; pass 'port'",
            candidates=[{"instance_id": inst, "port": p} for p, inst in found],
        ), 409
    return jsonify(event_id=eid, res=instances[0])


@bp.post("/query_worker_info")
def query_worker_info():
    """``{"instance_id": "all"|id, "worker_ids": [int]|null}`` ->
    ``{"event_id":"QueryWorkerInfo<uuid>","worker_infos":[WorkerInfo]}`` (unknown: empty list)."""
    req = parse(QueryWorkerInfoRequest)
    workers = _fleet().workers(None if req.instance_id == "all" else [req.instance_id])
    if req.worker_ids is not None:
        wanted = set(req.worker_ids)
        workers = [w for w in workers if w.worker_id in wanted]
    return jsonify(event_id=new_event_id("QueryWorkerInfo"), worker_infos=[w.lmcache() for w in workers])


def _worker_rows(workers: list[WorkerInfo]) -> list[dict]:
    fleet = _fleet()
    counts = fleet.key_counts(workers)
    alive = fleet.alive(sorted({w.instance_id for w in workers}))
    return [
        {
            **w.lmcache(),
            "key_count": sum(c.values()),
            "live": fleet.worker_live(w, alive[w.instance_id]),
            "epoch": w.epoch,
        }
        for w, c in zip(workers, counts, strict=True)
    ]


@bp.get("/controller/workers")
def controller_workers():
    """``?instance_id=&worker_id=`` -> ``{"workers":[{...WorkerInfo, key_count, live, epoch}],
    "total_count"}``; 404 when a named instance or worker is unknown."""
    inst, wid = request.args.get("instance_id"), request.args.get("worker_id")
    workers = _fleet().workers([inst] if inst else None)
    if inst and not workers:
        raise ApiError(404, f"unknown instance_id {inst!r}")
    if wid is not None:
        workers = [w for w in workers if str(w.worker_id) == wid]
        if not workers:
            raise ApiError(404, f"unknown worker_id {wid!r}")
    rows = _worker_rows(workers)
    return jsonify(workers=rows, total_count=len(rows))


@bp.get("/controller/key-stats")
def key_stats():
    """``{"total_key_count","total_instance_count","total_worker_count",
    "instances":[{"instance_id","key_count","worker_count"}]}`` (key_count: records)."""
    fleet = _fleet()
    workers = fleet.workers()
    counts = fleet.key_counts(workers)
    per: dict[str, dict] = {}
    for w, c in zip(workers, counts, strict=True):
        row = per.setdefault(w.instance_id, {"instance_id": w.instance_id, "key_count": 0, "worker_count": 0})
        row["key_count"] += sum(c.values())
        row["worker_count"] += 1
    rows = [per[k] for k in sorted(per)]
    return jsonify(
        total_key_count=sum(r["key_count"] for r in rows),
        total_instance_count=len(rows),
        total_worker_count=len(workers),
        instances=rows,
    )
