"""LMCache's control API: clear, pin, compress, decompress, move, health, check_finish.

Request and response shapes are LMCache 0.5.6's (docs/lmcache-protocol.md §3);
the controller fans each call out to every worker of the instance (sorted by worker id)
through :class:`kvlookup.wire.lmcache_control.ControlClient`, with a deadline. Differences from
LMCache, all on error paths: bad bodies get 400 ``{"error"}`` instead of 422; an instance
with no workers gets 404 instead of 500; a worker that does not answer gets 504 (or
health code -1004) within the timeout instead of hanging; workers that disagree get 502.
"""

from __future__ import annotations

import uuid
from typing import Annotated

import msgspec
import redis
from flask import Blueprint, current_app, jsonify, request

from kvlookup.app.auth import require_token
from kvlookup.app.errors import ApiError, decode_body
from kvlookup.client import TokenId, new_event_id
from kvlookup.index import control as index_control
from kvlookup.index.fleet import WorkerInfo
from kvlookup.wire import lmcache_control as ctl

bp = Blueprint("control", __name__)

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
EVENT_TTL_S = 3600


class ClearRequest(msgspec.Struct):
    instance_id: Name
    location: Name


class PinRequest(msgspec.Struct):
    instance_id: Name
    location: Name
    tokens: list[TokenId]


class CompressRequest(msgspec.Struct):
    instance_id: Name
    method: Name
    location: Name
    tokens: list[TokenId] = []


class MoveRequest(msgspec.Struct):
    old_position: tuple[Name, Name]
    new_position: tuple[Name, Name]
    tokens: list[TokenId] = []
    should_copy: bool | None = None
    copy: bool | None = None


class HealthRequest(msgspec.Struct):
    instance_id: Name


class CheckFinishRequest(msgspec.Struct):
    event_id: Name


def parse(model: type):
    """The request body decoded as ``model``; ApiError 400 naming the bad field."""
    return decode_body(request.get_data(cache=False), model)


def _ext() -> dict:
    return current_app.extensions["kvlookup"]


def lmcache_workers(instance_id: str) -> list[WorkerInfo]:
    """Registered workers of an LMCache instance; 404 when none, 409 for a vLLM instance."""
    fleet = _ext()["fleet"]
    workers = fleet.workers([instance_id])
    kind = fleet.instance_kind(instance_id)
    if not workers:
        raise ApiError(404, f"instance {instance_id!r} has no registered workers")
    if not kind.control:
        raise ApiError(
            409, f"instance {instance_id!r} is a {kind.name} instance; only LMCache workers take control calls"
        )
    return workers


def fan_out(event_id: str, workers: list[WorkerInfo], make_msg, retries: int | None = None):
    """Call every worker; the LMCache answer ``{"event_id", "num_tokens"}`` or an error JSON.

    403 before any call when a worker's address is outside ``worker_networks``.
    """
    targets = [ctl.Target(w.worker_id, w.ip, w.port, make_msg(w)) for w in workers]
    control = _ext()["control"]
    refused = [f"worker {t.worker_id}: {why}" for t in targets if (why := control.refusal(t))]
    if refused:
        raise ApiError(403, "; ".join(refused))
    results = control.call(targets, retries)
    failed = [r for r in results if r.outcome != ctl.OK]
    if failed:
        status = 504 if any(r.outcome == ctl.TIMEOUT for r in failed) else 502
        body = {
            "error": "; ".join(f"worker {r.worker_id}: {r.error}" for r in failed),
            "event_id": event_id,
            "workers": {str(r.worker_id): {"outcome": r.outcome, "error": r.error} for r in results},
        }
        _record(event_id, "failed")
        return jsonify(body), status
    counts = {str(r.worker_id): r.reply.num_tokens for r in results}
    if len(set(counts.values())) > 1:
        _record(event_id, "failed")
        return jsonify(
            error="workers disagree on num_tokens", event_id=event_id, num_tokens_by_worker=counts
        ), 502
    _record(event_id, "finished")
    return jsonify(event_id=event_id, num_tokens=next(iter(counts.values())))


def _record(event_id: str, status: str) -> None:
    try:
        index_control.record_event(_ext()["redis"], event_id, status, EVENT_TTL_S)
    except redis.RedisError:
        pass  # /check_finish then answers 404; the call itself already happened


@bp.post("/clear")
@require_token
def clear():
    """``{"instance_id","location"}`` -> ``{"event_id":"Clear<uuid>","num_tokens"}``."""
    req = parse(ClearRequest)
    eid = new_event_id("Clear")
    return fan_out(
        eid,
        lmcache_workers(req.instance_id),
        lambda w: ctl.ClearWorkerMsg(f"Worker{w.worker_id}{eid}", req.location),
    )


@bp.post("/pin")
@require_token
def pin():
    """``{"instance_id","location","tokens"}`` -> ``{"event_id":"Pin<uuid>","num_tokens"}``."""
    req = parse(PinRequest)
    eid = new_event_id("Pin")
    return fan_out(
        eid,
        lmcache_workers(req.instance_id),
        lambda w: ctl.PinWorkerMsg(f"Worker{w.worker_id}{eid}", req.location, req.tokens),
    )


def _compress(prefix: str, msg_type: type):
    req = parse(CompressRequest)
    eid = new_event_id(prefix)
    return fan_out(
        eid,
        lmcache_workers(req.instance_id),
        lambda w: msg_type(
            f"{prefix}Worker{w.worker_id}{uuid.uuid4()}", req.method, req.location, req.tokens
        ),
    )


@bp.post("/compress")
@require_token
def compress():
    """``{"instance_id","method","location","tokens"?}`` -> ``{"event_id":"Compress<uuid>","num_tokens"}``."""
    return _compress("Compress", ctl.CompressWorkerMsg)


@bp.post("/decompress")
@require_token
def decompress():
    """Same shapes as /compress, event id prefix ``Decompress``."""
    return _compress("Decompress", ctl.DecompressWorkerMsg)


@bp.post("/move")
@require_token
def move():
    """``{"old_position":[inst,loc],"new_position":[inst,loc],"tokens","should_copy"}`` ->
    ``{"event_id":"Move<uuid>","num_tokens"}``. Each source worker sends to the destination
    worker of the same id (its peer_init_url); only LocalCPUBackend destinations, as LMCache.
    Not retried (a move is not idempotent)."""
    req = parse(MoveRequest)
    if req.new_position[1] != "LocalCPUBackend":
        raise ApiError(
            400, "'new_position'[1] must be 'LocalCPUBackend' (the only move target LMCache supports)"
        )
    src = lmcache_workers(req.old_position[0])
    dst = {w.worker_id: w for w in lmcache_workers(req.new_position[0])}
    missing = [w.worker_id for w in src if not (dst.get(w.worker_id) and dst[w.worker_id].peer_init_url)]
    if missing:
        raise ApiError(
            409, f"destination {req.new_position[0]!r} has no peer_init_url for worker(s) {missing}"
        )
    copy = bool(req.should_copy if req.should_copy is not None else req.copy)
    eid = new_event_id("Move")
    return fan_out(
        eid,
        src,
        lambda w: ctl.MoveWorkerMsg(
            f"MoveWorker{w.worker_id}{uuid.uuid4()}",
            req.old_position[1],
            (dst[w.worker_id].peer_init_url, req.new_position[1]),
            req.tokens,
            copy,
        ),
        retries=0,
    )


@bp.post("/health")
def health_fan_out():
    """``{"instance_id"}`` -> ``{"event_id":"health<uuid>","error_codes":{"<wid>":int}}``.

    0 = healthy; -1001 worker error, -1002 unexpected reply, -1003 undecodable reply (as
    LMCache), -1004 no reply within the timeout, -1005 unusable address, -1006 address outside
    ``worker_networks``, never contacted (kvlookup). Failures add ``errors``
    ``{"<wid>": reason}``. An unknown instance answers ``error_codes: {}`` (as LMCache).
    (``GET /health`` is the controller's own Redis check.)
    """
    req = parse(HealthRequest)
    eid = new_event_id("health")
    try:
        workers = lmcache_workers(req.instance_id)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return jsonify(event_id=eid, error_codes={})
    targets = [
        ctl.Target(w.worker_id, w.ip, w.port, ctl.HealthWorkerMsg(f"HealthWorker{w.worker_id}{uuid.uuid4()}"))
        for w in workers
    ]
    results = _ext()["control"].call(targets)
    codes = {
        str(r.worker_id): (r.reply.error_code if r.outcome == ctl.OK else ctl.HEALTH_CODES[r.outcome])
        for r in results
    }
    body: dict = {"event_id": eid, "error_codes": codes}
    errors = {str(r.worker_id): r.error for r in results if r.outcome != ctl.OK}
    if errors:
        body["errors"] = errors
    return jsonify(body)


@bp.post("/check_finish")
def check_finish():
    """``{"event_id"}`` -> ``{"status": "finished"|"failed"}`` for a control call of the last
    hour (calls here complete before they answer); 404 for an unknown event id."""
    req = parse(CheckFinishRequest)
    status = index_control.event_status(_ext()["redis"], req.event_id)
    if status is None:
        raise ApiError(
            404, f"unknown event_id {req.event_id!r} (not issued here, or older than {EVENT_TTL_S}s)"
        )
    return jsonify(status=status)
