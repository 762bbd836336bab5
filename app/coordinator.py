"""LMCache's multiprocess (MP) coordinator API, served by the controller (and by
``kvlookup mp-ingest`` on its own port): MP servers point ``--coordinator-url`` here.

Paths, bodies and statuses are ``lmcache.v1.mp_coordinator``'s (0.5.6 and 0.5.7rc2; research
notes in docs/lmcache-mp.md):

- ``POST /instances`` -> ``{"instance_id", "re_registered"}``; 409 on a chunk-size conflict
- ``GET /instances`` -> ``{"instances": [...]}``
- ``PUT /instances/<id>/heartbeat`` -> ``{"instance_id"}``; 404 ``unknown instance <id>; re-register``
- ``DELETE /instances/<id>`` -> 204 (any id; only the MP directory's data goes)
- ``PUT /config/chunk-size`` ``{"chunk_size"}`` -> ``{"chunk_size"}``; 409 on a conflict
- ``POST /events`` ``{"batches": [...]}`` -> ``{"applied", "duplicates", "stale"}``; 413 over
  :data:`MAX_BATCHES` batches or :data:`MAX_ENTRIES` entries (nothing applied)
- ``POST /directory/lookup``, ``GET /directory/keys``, ``GET /directory/stats``,
  ``POST /directory/blend-lookup``, ``GET /healthz``

A bad body is 422 ``{"error": ..., "detail": ...}`` naming the field (FastAPI's status); Redis
down is 503. A registration, heartbeat or event batch naming an instance id a live sidecar
writes for (its claim or its first write; docs/operations.md "Security") is 409, and while an MP
instance is registered no sidecar writes for its id. Nothing of a rejected request is applied.
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import time
from array import array

import redis
from flask import Blueprint, Response, current_app, jsonify, request

from kvlookup.app import mp_metrics
from kvlookup.app.body import RequestBody
from kvlookup.app.errors import json_bytes
from kvlookup.index.mp import ChunkSizeConflict, HeldBySidecar, MPDirectory
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis
from kvlookup.wire import lmcache_mp as W
from kvlookup.wire.mp_tokens import decode_tokens_form

log = logging.getLogger(__name__)
bp = Blueprint("coordinator", __name__)

#: The most batches, and entries over all batches, one POST /events may carry (413 beyond).
MAX_BATCHES = 10_000
MAX_ENTRIES = 200_000
#: The coordinator's limit on token ids in a tokens-form directory lookup (400 beyond).
MAX_LOOKUP_TOKENS = 1_000_000


def directory() -> MPDirectory:
    return current_app.extensions["kvlookup"]["mp"]


def _json(body: dict, status: int = 200) -> Response:
    """``body`` as compact JSON (msgspec: large directory answers encode ~10x faster than jsonify)."""
    return Response(json_bytes(body), status=status, mimetype="application/json")


def _error(status: int, message: str):
    resp = jsonify(error=message, detail=message)
    resp.status_code = status
    return resp


def _decode(model: type):
    try:
        return W.decode(request.get_data(), model)
    except W.MPBodyError as exc:
        raise _Reject(422, f"invalid request: {exc}") from None


class _Reject(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


@bp.errorhandler(_Reject)
def _reject(exc: _Reject):
    return _error(exc.status, exc.message)


@bp.errorhandler(HeldBySidecar)
def _held(exc: HeldBySidecar):
    """An instance id a live sidecar writes for (issue 20 item 10): 409, nothing applied."""
    return _error(409, str(exc))


@bp.errorhandler(redis.RedisError)
def _redis_down(exc: redis.RedisError):
    return _error(503, f"index unavailable: {exc}")


@bp.get("/healthz")
def healthz():
    return jsonify(status="healthy")


@bp.post("/instances")
def register():
    req = _decode(W.RegisterRequest)
    try:
        instance_id, again = directory().register(req)
    except ChunkSizeConflict as exc:
        return _error(409, str(exc))
    mp_metrics.REGISTRATIONS.labels("re_registered" if again else "new").inc()
    return jsonify(instance_id=instance_id, re_registered=again)


@bp.get("/instances")
def instances():
    return jsonify(instances=directory().instances())


@bp.put("/instances/<path:instance_id>/heartbeat")
def heartbeat(instance_id: str):
    if not directory().heartbeat(instance_id):
        return jsonify(error=f"unknown instance {instance_id}; re-register"), 404
    return jsonify(instance_id=instance_id)


@bp.delete("/instances/<path:instance_id>")
def deregister(instance_id: str):
    directory().deregister(instance_id)
    return Response(status=204)


@bp.put("/config/chunk-size")
def bind_chunk_size():
    req = _decode(W.ChunkSizeRequest)
    try:
        return jsonify(chunk_size=directory().bind_chunk_size(req.chunk_size))
    except ChunkSizeConflict as exc:
        return _error(409, str(exc))


@bp.post("/events")
def events():
    status, body = apply_events(directory(), request.get_data())
    return Response(body, status=status, mimetype="application/json")


def apply_events(d: MPDirectory, data: bytes) -> tuple[int, bytes]:
    """``POST /events`` from the raw body to (status, JSON answer): ``{"applied", "duplicates",
    "stale"}``; 422 naming the field for a bad body, 413 over the limits, 409 for an instance id a
    live sidecar writes for (nothing applied in each case)."""
    try:
        req = W.decode(data, W.CacheEventsRequest)
    except W.MPBodyError as exc:
        return _fail(422, f"invalid request: {exc}")
    entries = sum(len(b.entries) for b in req.batches)
    if len(req.batches) > MAX_BATCHES or entries > MAX_ENTRIES:
        return _fail(413, f"{len(req.batches)} batches with {entries} entries: more than the limits "
                          f"({MAX_BATCHES} batches, {MAX_ENTRIES} entries) of one request; send fewer at a time")
    start = time.time()
    try:
        out = d.apply(req.batches, now=start)
    except HeldBySidecar as exc:  # an instance id a live sidecar writes for (issue 20 item 10)
        return _fail(409, str(exc))
    mp_metrics.observe_events(req.batches, out, start)
    return 200, json_bytes(out)


@bp.post("/directory/lookup")
def lookup():
    status, body = directory_lookup(directory(), request.get_data())
    return Response(body, status=status, mimetype="application/json")


def directory_lookup(d: MPDirectory, data: bytes, memo: dict | None = None) -> tuple[int, bytes]:
    """``POST /directory/lookup`` from the raw body to (status, JSON answer): the keys form, or
    the tokens form (``model_name`` required; 400 over :data:`MAX_LOOKUP_TOKENS` ids or a bad
    salt); 422 ``{"error", "detail"}`` naming the field for a bad body. memo: kept between two
    tries of one request (app.asgi: the event loop's, then a thread's), so it is decoded and
    hashed once."""
    form = memo.get("form") if memo is not None else None
    if form is None:
        form = decode_tokens_form(data)  # the plain tokens form, ids packed for the hash (no int objects)
        if memo is not None:
            memo["form"] = form
    if form is not None:
        return _tokens_lookup(d, form.packed, form.n_ids, form.model_name, form.world_size, form.cache_salt, memo)
    try:
        req = W.decode(data, W.DirectoryLookupRequest)
    except W.MPBodyError as exc:
        return _fail(422, f"invalid request: {exc}")
    if bool(req.keys) == bool(req.token_ids):
        return _fail(422, "invalid request: supply exactly one of 'keys' or 'token_ids'")
    if req.keys:
        return 200, json_bytes({"chunks": len(req.keys), "results": d.lookup_keys(req.keys)})
    if req.model_name is None:
        return _fail(422, "invalid request: 'model_name' is required with 'token_ids'")
    return _tokens_lookup(d, req.token_ids, len(req.token_ids), req.model_name, req.world_size, req.cache_salt, memo)


def _tokens_lookup(d: MPDirectory, ids: list[int] | memoryview, count: int, model_name: str, world_size: int,
                   cache_salt: str, memo: dict | None = None) -> tuple[int, bytes]:
    """The tokens form's answer; 400 over :data:`MAX_LOOKUP_TOKENS` ids, for a bad salt or an id MP cannot hash."""
    if count > MAX_LOOKUP_TOKENS:
        return _fail(400, f"'token_ids' has {count} ids, more than {MAX_LOOKUP_TOKENS}")
    try:
        W.check_salt(cache_salt, "$.cache_salt")
        return 200, d.lookup_tokens_json(ids, model_name, world_size, cache_salt, memo)
    except (W.MPBodyError, ValueError) as exc:
        return _fail(400, str(exc))


def _fail(status: int, message: str) -> tuple[int, bytes]:
    return status, json_bytes({"error": message, "detail": message})


#: The MP paths the ASGI front answers itself (:class:`FastPaths`): the two that carry traffic.
FAST_PATHS = {"/events": apply_events, "/directory/lookup": directory_lookup}


class FastPaths:
    """``POST /events`` and ``POST /directory/lookup`` without the Flask app (kvlookup.app.asgi
    calls :meth:`respond` in a worker thread): the same functions as the Flask routes, the same
    answers, minus ~1.5 ms of WSGI bridging per request on this machine."""

    def __init__(self, d: MPDirectory, reaper: Reaper):
        self.d, self.reaper = d, reaper

    @staticmethod
    def serves(method: str, path: str) -> bool:
        return method == "POST" and path in FAST_PATHS

    def local_now(self, path: str) -> bool:
        """Is ``path`` worth trying in the event loop now (:meth:`respond_here`): a directory
        lookup while the bucket copies are answered locally (kvlookup.index.mp_copies)?"""
        return path == "/directory/lookup" and self.d.reads_locally()

    def respond_here(self, path: str, data: bytes, memo: dict) -> tuple[int, bytes] | None:
        """The answer with nothing read from Redis (kvlookup.index.tracking's LOCAL_ONLY: every
        bucket copied, every name known), for app.asgi's event loop; None when Redis must be asked
        (then :meth:`respond` in a thread, with the same ``memo``: decoded and hashed once)."""
        token = LOCAL_ONLY.set(True)
        try:
            return self.respond(path, data, memo)
        except NeedsRedis:
            return None
        finally:
            LOCAL_ONLY.reset(token)

    def respond(self, path: str, data: bytes, memo: dict | None = None) -> tuple[int, bytes]:
        """(status, JSON body); 503 when Redis is down, as the Flask routes answer. memo: as
        :func:`directory_lookup`'s."""
        self.reaper.start_once()
        try:
            if path == "/directory/lookup":
                return directory_lookup(self.d, data, memo)
            return FAST_PATHS[path](self.d, data)
        except redis.RedisError as exc:
            return _fail(503, f"index unavailable: {exc}")
        except NeedsRedis:
            raise
        except Exception as exc:  # as the Flask app's handler (kvlookup.app.errors) answers
            log.exception("unhandled error")
            return 500, json_bytes({"error": f"internal error: {type(exc).__name__}"})


@bp.get("/directory/keys")
def keys():
    args = request.args
    tier = args.get("tier", "all")
    if tier not in ("l1", "l2", "all"):
        return _error(422, "invalid request: query parameter 'tier' must be 'l1', 'l2' or 'all'")
    try:
        offset = int(args.get("offset", "0"))
        limit = int(args.get("limit", "1000"))
    except ValueError:
        return _error(422, "invalid request: query parameters 'offset' and 'limit' must be integers")
    if offset < 0 or not 1 <= limit <= 10_000:
        return _error(422, "invalid request: 'offset' must be >= 0 and 'limit' 1..10000")
    return _json(directory().list_keys(tier, args.get("instance_id", ""), args.get("backend", ""), offset, limit))


@bp.get("/directory/stats")
def stats():
    return jsonify(directory().stats())


@bp.post("/directory/blend-lookup")
def blend_lookup():
    req = _decode(W.BlendLookupRequest)
    try:
        raw = base64.b64decode(req.tokens_b64, validate=True)
    except (binascii.Error, ValueError):
        return _error(422, "invalid request: 'tokens_b64' is not valid base64 - at `$.tokens_b64`")
    if len(raw) % 4:
        return _error(422, "invalid request: 'tokens_b64' decodes to a length that is not a multiple of 4")
    if raw and req.model_name is None:
        return _error(422, "invalid request: 'model_name' is required with tokens")
    tokens = array("I")
    tokens.frombytes(raw)
    if array("I").itemsize == 4 and __import__("sys").byteorder == "big":  # pragma: no cover
        tokens.byteswap()
    matches = directory().blend_matches(tokens.tolist(), req.model_name or "", req.world_size, req.cache_salt) \
        if raw else []
    return jsonify(matches=matches)


_START = threading.Lock()


@bp.before_request
def _reaper():
    current_app.extensions["kvlookup"]["mp_reaper"].start_once()


class Reaper:
    """Departs MP instances silent for the timeout, every ``interval_s`` (a daemon thread per
    process; the departure script is idempotent, so several controllers reaping is harmless)."""

    def __init__(self, d: MPDirectory, interval_s: float):
        self.d, self.interval_s = d, interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mp-reaper", daemon=True)

    def stop(self) -> None:
        self._stop.set()

    def start_once(self) -> None:
        """Start the thread unless it runs already (the first MP request starts it)."""
        if not self.thread.is_alive() and not self._stop.is_set():
            with _START:
                if not self.thread.is_alive():
                    self.thread.start()

    def _run(self) -> None:
        down = False
        while not self._stop.wait(self.interval_s):
            try:
                for inst in self.d.reap():
                    log.info("MP instance %s timed out; evicted", inst)
                    mp_metrics.TIMEOUTS.inc()
                down = False
            except redis.RedisError as exc:
                if not down:  # once per outage
                    log.warning("MP reaper: index unavailable: %s", exc)
                down = True
            except Exception:  # the loop never stops
                log.exception("MP reaper failed")


def init_app(app, redis_client, settings) -> MPDirectory:
    """Attach the MP directory to ``app`` (``extensions["kvlookup"]["mp"]``), register the
    blueprint and the reaper (every third of the timeout, at most 10 s; started by the first
    request to an MP path, so a controller no MP server talks to runs no thread)."""
    cache = settings.cache_reads()
    d = MPDirectory(redis_client, chunk_size=settings.mp_chunk_size,
                    instance_timeout_s=settings.mp_instance_timeout_s, replica_acks=settings.mp_replica_acks,
                    copy_fields=settings.mp_copy_fields if cache else 0, copy_keys=settings.lookup_cache_keys,
                    copy_fence=cache == "fenced")
    app.extensions["kvlookup"]["mp"] = d
    app.register_blueprint(bp)
    registries = app.extensions["kvlookup"].get("metrics_registries") or []
    if len(registries) > 1:  # the fleet registry: gauges read from Redis at scrape time
        registries[1].register(mp_metrics.MPCollector(d))
    reaper = Reaper(d, min(10.0, settings.mp_instance_timeout_s / 3))
    app.extensions["kvlookup"]["mp_reaper"] = reaper
    app.extensions["kvlookup"]["mp_fast"] = FastPaths(d, reaper)
    return d


class Scoper:
    """``POST /lookup`` with ``model_name``: the classic and vLLM matches (already scoped to
    instances whose model is that one or undeclared: kvlookup.client.Client.matches), plus the
    LMCache MP instances holding a prefix for that model, world size and cache salt; longest first."""

    def __init__(self, d: MPDirectory):
        self.d = d

    def __call__(self, matches: list, req) -> list:
        from kvlookup.client import InstanceMatch, pick_location
        from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis

        if LOCAL_ONLY.get():  # the ASGI loop never waits on Redis: answered again in a thread
            raise NeedsRedis("model-scoped lookup")
        matches = list(matches)  # a kept answer's list is shared between lookups: never extend it
        try:
            mp = self.d.prefix_matches(req.tokens, req.model_name, req.world_size, req.cache_salt or "")
        except ValueError:
            mp = []
        seen = {m.instance_id for m in matches}
        matches += [InstanceMatch(inst, pick_location(locs), n, locs) for inst, n, locs in mp if inst not in seen]
        return sorted(matches, key=lambda im: (-im.matched_prefix_length, im.instance_id))

    def explain(self, req) -> dict:
        """The MP part of ``/lookup/explain`` (:meth:`kvlookup.index.mp.MPDirectory.explain`)."""
        try:
            return self.d.explain(req.tokens, req.model_name, req.world_size, req.cache_salt or "")
        except ValueError as exc:
            return {"error": str(exc)}


def standalone_app(redis_client, settings):
    """A Flask app serving only the MP coordinator paths (``kvlookup sidecar --mp-listen``)."""
    from flask import Flask

    from kvlookup.app import errors

    app = Flask("kvlookup-mp")
    app.json.sort_keys = False
    app.extensions["kvlookup"] = {"settings": settings, "redis": redis_client}
    errors.init_app(app)
    init_app(app, redis_client, settings)
    # the controller's body limits (413 over max_body_bytes, unread): without them a 64 MiB
    # POST /events was read and decoded whole
    app.wsgi_app = RequestBody(app.wsgi_app, settings.max_body_bytes, settings.body_timeout_s)
    return app


def serve_standalone(settings):
    """Serve :func:`standalone_app` on ``settings.mp_listen`` (host:port) in a daemon thread
    (werkzeug's threaded server, which logs no line a request: an MP server posts a batch every
    few ms; /metrics counts them); returns the server (``shutdown()`` stops it)."""
    from werkzeug.serving import WSGIRequestHandler, make_server

    from kvlookup.proc.redis_server import connect

    class Handler(WSGIRequestHandler):
        timeout = settings.body_timeout_s  # a client silent this long mid-request (or idle) is dropped

        def log_request(self, code="-", size="-") -> None:
            pass

    host, _, port = settings.mp_listen.rpartition(":")
    client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=10)
    server = make_server(host or "127.0.0.1", int(port), standalone_app(client, settings), threaded=True,
                         request_handler=Handler)
    threading.Thread(target=server.serve_forever, name="mp-http", daemon=True).start()
    log.info("MP coordinator paths on http://%s:%s", host, port)
    return server
