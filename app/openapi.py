"""``GET /openapi.json`` (OpenAPI 3.1) and ``GET /docs`` (Swagger UI, shipped in app/static).

The schemas are generated, not written: the request structs are the ones the routes decode
(``LookupRequest``, ``ClearRequest``, ...), the response structs below mirror what the routes
build, and ``msgspec.json.schema_components`` turns both into JSON Schema (2020-12, which is
OpenAPI 3.1's dialect). tests/app/test_openapi.py validates the document with
``openapi-spec-validator`` and checks real answers of the running app against these schemas,
so a route and its description cannot drift apart. Swagger UI (npm ``swagger-ui-dist``
5.35.0, Apache-2.0, app/static/swagger-ui/) loads nothing from elsewhere.

LMCache's introspection routes ``/env``, ``/loglevel``, ``/threads`` are not served (404): they
expose the process's environment and threads, which this API does not publish; ``/metrics``
(Prometheus text) and ``/health`` are.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
from flask import Blueprint, current_app, jsonify

from kvlookup.app.control import (
    CheckFinishRequest,
    ClearRequest,
    CompressRequest,
    HealthRequest,
    MoveRequest,
    PinRequest,
)
from kvlookup.app.lookup import LookupRequest
from kvlookup.app.registry import QueryInstanceRequest, QueryWorkerInfoRequest
from kvlookup.app.tokenizer import TokenizeRequest
from kvlookup.wire.lmcache_mp import (
    BlendLookupRequest,
    CacheEventsRequest,
    ChunkSizeRequest,
    DirectoryLookupRequest,
    RegisterRequest,
)

bp = Blueprint("openapi", __name__)

Match = tuple[str, int]  # [location, matched_prefix_length]


class Error(msgspec.Struct):
    """Every 4xx/5xx answer: one line naming the field or the cause."""
    error: str


class MatchDetail(msgspec.Struct, omit_defaults=True):
    location: str
    matched_prefix_length: int
    locations: dict[str, int]
    ranks: dict[str, int] | None = None


class LookupLayoutInfo(msgspec.Struct, omit_defaults=True):
    """``lookup_response: layout_info`` or ``?format=layout_info``: LMCache 0.5.6's shape."""
    event_id: str
    layout_info: dict[str, Match]
    detail: dict[str, MatchDetail] | None = None


#: ``lookup_response: flat`` (the default): ``event_id`` and one ``[location, length]`` per
#: instance, longest match first; ``?detail=1`` adds ``detail``.
LookupFlat = dict[str, str | Match | dict[str, MatchDetail]]


class Explain(msgspec.Struct):
    """Why a prompt matches what it matches (docs/operations.md, "Explain a lookup")."""
    answer: dict[str, Any]
    profile: dict[str, Any]
    tokens: int
    chunks: int
    hashed_tokens: int
    instances: list[dict[str, Any]]
    profiles: list[dict[str, Any]]
    namespaces: list[Any]
    diagnosis: list[str]
    cause: str | None = None


class Component(msgspec.Struct, omit_defaults=True):
    state: str
    ms: float | None = None


class Health(msgspec.Struct, omit_defaults=True):
    """``GET /health``: 200 when Redis answers, 503 otherwise."""
    status: str
    redis: str
    components: dict[str, dict[str, Any]]
    redis_ms: float | None = None


class NumTokens(msgspec.Struct):
    event_id: str
    num_tokens: int


class InstanceHealth(msgspec.Struct):
    event_id: str
    error_codes: dict[str, int]


class CheckFinish(msgspec.Struct):
    status: str


class QueryInstance(msgspec.Struct, omit_defaults=True):
    event_id: str
    res: str | None
    error: str | None = None


class WorkerInfo(msgspec.Struct):
    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None
    registration_time: float
    last_heartbeat_time: float


class QueryWorkerInfo(msgspec.Struct):
    event_id: str
    worker_infos: list[WorkerInfo]


class Workers(msgspec.Struct):
    workers: list[dict[str, Any]]
    total_count: int


class InstanceKeys(msgspec.Struct):
    instance_id: str
    key_count: int
    worker_count: int


class KeyStats(msgspec.Struct):
    total_key_count: int
    total_instance_count: int
    total_worker_count: int
    instances: list[InstanceKeys]


class Overview(msgspec.Struct):
    """The dashboard's data: instances, totals, sidecars, the index, settings."""
    generated_at: float
    instances: list[dict[str, Any]]
    totals: dict[str, int]
    sidecars: list[dict[str, Any]]
    index: dict[str, Any]
    settings: dict[str, Any]
    features: dict[str, bool]


class Tokenized(msgspec.Struct):
    tokens: list[int]
    count: int
    tokenizer: str


class MPError(msgspec.Struct, omit_defaults=True):
    """The LMCache MP coordinator paths' errors (422 naming the field, 404, 409, 413)."""
    error: str
    detail: str | None = None


class MPRegistered(msgspec.Struct):
    instance_id: str
    re_registered: bool


class MPInstanceId(msgspec.Struct):
    instance_id: str


class MPChunkSize(msgspec.Struct):
    chunk_size: int


class MPHealthz(msgspec.Struct):
    """``GET /healthz``: the coordinator process is up (``{"status": "healthy"}``)."""
    status: str


class MPApplied(msgspec.Struct):
    """``POST /events``: batches applied, duplicates (seq already seen) and stale (an older
    incarnation, or a departed one's L1)."""
    applied: int
    duplicates: int
    stale: int


#: directory answers are the coordinator's JSON shapes (docs/lmcache-mp.md)
_ANY_OBJECT = {"type": "object"}


def _mp(method: str, summary: str, request: Any, response: Any, codes: tuple[int, ...] = (422,)) -> dict:
    op: dict = {"summary": f"LMCache MP coordinator: {summary}",
                "responses": {"200": _json("OK", response), **{str(c): _json("error", MPError) for c in codes}}}
    if request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
    return {method: op}


def _mp_paths() -> dict:
    """The LMCache MP coordinator's paths (app/coordinator.py), same bodies as lmcache.v1.mp_coordinator."""
    iid = [{"name": "instance_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    keys_params = [{"name": n, "in": "query", "schema": s} for n, s in (
        ("tier", {"enum": ["l1", "l2", "all"]}), ("instance_id", {"type": "string"}),
        ("backend", {"type": "string"}), ("offset", {"type": "integer", "minimum": 0}),
        ("limit", {"type": "integer", "minimum": 1, "maximum": 10000}))]
    return {
        "/healthz": _mp("get", "liveness of this process", None, MPHealthz, ()),
        "/instances": {**_mp("post", "register an MP server", RegisterRequest, MPRegistered, (409, 422)),
                       **_mp("get", "registered MP servers", None, _ANY_OBJECT, ())},
        "/instances/{instance_id}/heartbeat": {"put": {**_mp("put", "heartbeat (404: re-register)", None,
                                                             MPInstanceId, (404,))["put"], "parameters": iid}},
        "/instances/{instance_id}": {"delete": {**_mp("delete", "deregister", None, _ANY_OBJECT, (404,))["delete"],
                                                "parameters": iid}},
        "/config/chunk-size": _mp("put", "bind the fleet's chunk size (409 on a conflict)", ChunkSizeRequest,
                                  MPChunkSize, (409, 422)),
        "/events": _mp("post", "cache event batches (nothing of a rejected request is applied)",
                       CacheEventsRequest, MPApplied, (413, 422)),
        "/directory/lookup": _mp("post", "placements of keys, or of a prompt's chunks", DirectoryLookupRequest,
                                 _ANY_OBJECT, (400, 422)),
        "/directory/keys": {"get": {**_mp("get", "stored keys, paged", None, _ANY_OBJECT)["get"],
                                    "parameters": keys_params}},
        "/directory/stats": _mp("get", "directory counts", None, _ANY_OBJECT, ()),
        "/directory/blend-lookup": _mp("post", "stored chunks anywhere in a prompt (non-prefix)", BlendLookupRequest,
                                       _ANY_OBJECT),
    }


def _post(summary: str, request: Any, response: Any, *, codes: tuple[int, ...] = (400,), **extra) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": request}, **extra.get("content", {})}},
        "responses": {"200": _json("OK", response), **{str(c): _json("error", Error) for c in codes}}}}


def _json(description: str, schema: Any) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _paths() -> tuple[dict, list]:
    """The paths, with the Python types their schemas are generated from in place (replaced by
    ``$ref``s by :func:`document`), and that list of types."""
    lookup = {"post": {
        "summary": "Which instances hold the longest prefix of a prompt, and where (LMCache's contract)",
        "parameters": [
            {"name": "format", "in": "query", "schema": {"enum": ["flat", "layout_info"]},
             "description": "answer shape (default: the lookup_response setting)"},
            {"name": "detail", "in": "query", "schema": {"type": "string"}, "description": "1: per-tier detail"},
            {"name": "lora_name", "in": "query", "schema": {"type": "string"},
             "description": "namespace of vLLM blocks, for an application/octet-stream body"},
            {"name": "cache_salt", "in": "query", "schema": {"type": "string"},
             "description": "vLLM's cache salt, for an application/octet-stream body"},
            {"name": "model_name", "in": "query", "schema": {"type": "string"},
             "description": "scope to one model, for an application/octet-stream body"},
            {"name": "world_size", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 255},
             "description": "LMCache MP KV world size, for an application/octet-stream body"}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": LookupRequest},
            "application/msgpack": {"schema": LookupRequest},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                    "description": "token ids packed as little-endian uint32"}}}},
        "responses": {"200": {"description": "the matches, longest first (none: only event_id)", "content": {
            "application/json": {"schema": {"oneOf": [LookupFlat, LookupLayoutInfo]}}}},
            "400": _json("a bad body, naming the field", Error), "413": _json("too many tokens", Error),
            "503": _json("Redis does not answer", Error)}}}
    paths = {
        "/lookup": lookup,
        "/lookup/explain": _post("Why a prompt matches what it matches", LookupRequest, Explain),
        "/health": {"get": {"summary": "The controller and its Redis",
                            "responses": {"200": _json("up", Health), "503": _json("Redis down", Health)}},
                    **_post("LMCache's health of one instance's workers", HealthRequest, InstanceHealth,
                            codes=(400, 404))},
        "/clear": _post("Clear an instance's tier (every worker)", ClearRequest, NumTokens, codes=(400, 404, 502)),
        "/pin": _post("Pin tokens in an instance's tier", PinRequest, NumTokens, codes=(400, 404, 502)),
        "/compress": _post("Compress tokens in an instance's tier", CompressRequest, NumTokens,
                           codes=(400, 404, 502)),
        "/decompress": _post("Decompress tokens in an instance's tier", CompressRequest, NumTokens,
                             codes=(400, 404, 502)),
        "/move": _post("Move tokens between instances", MoveRequest, NumTokens, codes=(400, 404, 502)),
        "/check_finish": _post("LMCache's check_finish (not implemented there either)", CheckFinishRequest,
                               CheckFinish, codes=(400, 501)),
        "/query_instance": _post("The instance registered from an IP (and port)", QueryInstanceRequest,
                                 QueryInstance, codes=(400, 404, 409)),
        "/query_worker_info": _post("Registered workers of an instance, or all", QueryWorkerInfoRequest,
                                    QueryWorkerInfo),
        "/controller/workers": {"get": {"summary": "Registered workers with their key counts", "parameters": [
            {"name": "instance_id", "in": "query", "schema": {"type": "string"}},
            {"name": "worker_id", "in": "query", "schema": {"type": "integer"}}],
            "responses": {"200": _json("OK", Workers), "404": _json("unknown instance or worker", Error)}}},
        "/controller/key-stats": {"get": {"summary": "Key counts per instance",
                                          "responses": {"200": _json("OK", KeyStats)}}},
        "/controller/overview": {"get": {"summary": "The dashboard's data",
                                         "responses": {"200": _json("OK", Overview)}}},
        "/tokenize": _post("Text to Llama-3 token ids (with the demo extra)", TokenizeRequest, Tokenized,
                           codes=(400, 413)),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        **_mp_paths(),
    }
    types = [LookupRequest, LookupFlat, LookupLayoutInfo, Explain, Health, HealthRequest, InstanceHealth,
             ClearRequest, PinRequest, CompressRequest, MoveRequest, NumTokens, CheckFinishRequest, CheckFinish,
             QueryInstanceRequest, QueryInstance, QueryWorkerInfoRequest, QueryWorkerInfo, Workers, KeyStats,
             Overview, TokenizeRequest, Tokenized, Error, RegisterRequest, ChunkSizeRequest, CacheEventsRequest,
             DirectoryLookupRequest, BlendLookupRequest, MPError, MPRegistered, MPInstanceId, MPChunkSize, MPApplied,
             MPHealthz]
    return paths, types


def _name(tp: Any) -> str:
    return {id(LookupFlat): "LookupFlat"}.get(id(tp), getattr(tp, "__name__", None) or repr(tp))


@cache
def document() -> dict:
    """The OpenAPI 3.1 document (a fresh copy is not needed: callers only serialise it)."""
    paths, types = _paths()
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    refs = {id(tp): schema for tp, schema in zip(types, schemas, strict=True)}
    components["LookupFlat"] = refs[id(LookupFlat)]
    refs[id(LookupFlat)] = {"$ref": "#/components/schemas/LookupFlat"}

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        if id(node) in refs:
            return refs[id(node)]
        return node

    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("kvlookup")
    except PackageNotFoundError:
        release = "0"
    return {"openapi": "3.1.0",
            "info": {"title": "kvlookup", "version": release, "license": {"name": "Apache-2.0",
                                                                        "identifier": "Apache-2.0"},
                     "description": "Cluster-wide index of where LLM KV-cache chunks live; LMCache "
                                    "lmcache_controller compatible. docs/operations.md describes every route."},
            "paths": resolve(paths), "components": {"schemas": components}}


@bp.get("/openapi.json")
def openapi_json():
    return jsonify(document())


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvlookup API</title>
<link rel="stylesheet" href="/static/swagger-ui/swagger-ui.css">
<link rel="icon" href="/static/swagger-ui/favicon-32x32.png"></head>
<body><div id="swagger-ui"></div>
<script src="/static/swagger-ui/swagger-ui-bundle.js"></script>
<script src="/static/swagger-ui/docs.js"></script>
</body></html>
"""


@bp.get("/docs")
def docs():
    return current_app.response_class(DOCS_PAGE, mimetype="text/html")
