"""``POST /lookup``: which instance holds the longest prefix of a prompt, and where.

Request ``{"tokens": [int, ...], "lora_name"?: str, "cache_salt"?: str, "model_name"?: str}``
(lora_name and cache_salt select the namespace of vLLM blocks: a LoRA adapter, vLLM's per-request
cache salt; model_name skips discovered vLLM servers serving another model), as JSON (LMCache's
contract), MessagePack (``application/msgpack``) or, for routers that tokenize anyway, the token
ids packed as little-endian uint32 (``application/octet-stream``; the namespace in the query).
Response (``lookup_response: flat``, the default)::

    {"event_id": "Lookup<uuid4>", "<instance_id>": ["<location>", <matched_prefix_length>], ...}

or LMCache's own wire shape with ``lookup_response: layout_info`` / ``?format=layout_info``::

    {"event_id": "Lookup<uuid4>", "layout_info": {"<instance_id>": ["<location>", <length>]}}

Instances are listed longest match first. ``?detail=1`` adds ``"detail": {instance_id:
{location, matched_prefix_length, locations, ranks?, reusable_prefix_length?}}`` (the last for
vLLM instances: the hit vLLM's own coordinator would take, kvlookup.index.vllm_groups). No match: only ``event_id``
(and an empty ``layout_info``).

/lookup is the hot path, so it is served by :class:`LookupRoute` in front of Flask (Flask's
request and response machinery cost ~0.15 ms a call, measured in docs/benchmarks-notes.md):
:meth:`LookupRoute.respond` is called by the ASGI front (app.asgi, the default uvicorn workers)
and by the route's own WSGI layer (gunicorn's WSGI workers); every other path goes on to Flask.
Errors keep the API's JSON shape.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Annotated, cast
from urllib.parse import parse_qs

import msgspec
import redis

from kvlookup import native
from kvlookup.app import fleet_metrics
from kvlookup.app.errors import ApiError, decode_body, send_json
from kvlookup.client import Client, InstanceMatch, TokenId, new_event_id
from kvlookup.hashing.namespace import Namespace
from kvlookup.index.tracking import NeedsRedis

log = logging.getLogger(__name__)

PATH = "/lookup"
EXPLAIN_PATH = "/lookup/explain"
ALLOW = "OPTIONS, POST"
FORMATS = ("flat", "layout_info")
REQUEST_KEY = "kvlookup.request"
COUNT_KEY = "kvlookup.count"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


_ENCODER = msgspec.json.Encoder()


class LookupRequest(msgspec.Struct):
    tokens: list[TokenId]
    lora_name: str | None = None
    cache_salt: str | None = None
    #: scope the answer to one model (LMCache MP instances are found only with it); world_size:
    #: the MP KV world size (a chunk counts when all its ranks hold it)
    model_name: str | None = None
    world_size: Annotated[int, msgspec.Meta(ge=1, le=255)] = 1


#: Body types /lookup reads (``Content-Type``; anything else is read as JSON, LMCache's contract).
MSGPACK = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
RAW_UINT32 = "application/octet-stream"


def parse_request(body: bytes, max_tokens: int, content_type: str = "",
                  query: dict[str, list[str]] | None = None) -> LookupRequest:
    """Validate a /lookup body; raises ApiError 400 naming the problem, 413 when too long.

    content_type: ``application/json`` (or none: LMCache's JSON object), ``application/msgpack``
    (the same object in MessagePack), ``application/octet-stream`` (the token ids as packed
    little-endian uint32, 4 bytes each, for routers that tokenize anyway: no per-id parsing;
    ``lora_name`` / ``cache_salt`` then come from the query string).
    """
    kind = content_type.partition(";")[0].strip().lower()
    if kind == RAW_UINT32:
        req = _raw_uint32(body, query or {})
    elif kind in MSGPACK:
        req = decode_body(body, LookupRequest, "MessagePack")
    else:
        req = _plain_json(body) or decode_body(body, LookupRequest)
    if len(req.tokens) > max_tokens:
        raise ApiError(413, f"'tokens' has {len(req.tokens)} ids, more than the maximum {max_tokens}")
    return req


def _plain_json(body: bytes) -> LookupRequest | None:
    """The C fast path (kvlookup.native) for LMCache's plain body ``{"tokens": [ids]}``: the ids
    as an ``array('I')`` (no int objects; the hashes read it as a buffer). None for any other body
    (other fields, a bad id, not JSON) and without the extension: :func:`decode_body` decodes it,
    with its errors."""
    ext = native.ext
    if ext is None:
        return None
    packed = ext.decode_tokens(body)
    if packed is None:
        return None
    ids = array("I")
    ids.frombytes(packed)
    return LookupRequest(cast(list, ids))  # a sequence of the same ids: len, index, slice, buffer


def _raw_uint32(body: bytes, query: dict[str, list[str]]) -> LookupRequest:
    if len(body) % 4:
        raise ApiError(400, f"an application/octet-stream body is packed uint32 token ids: {len(body)} bytes "
                            "is not a multiple of 4")
    ids = array("I")
    ids.frombytes(body)
    if sys.byteorder == "big":
        ids.byteswap()
    try:
        world_size = int(query.get("world_size", ["1"])[0])
    except ValueError:
        raise ApiError(400, "query parameter 'world_size' must be an integer 1..255") from None
    if not 1 <= world_size <= 255:
        raise ApiError(400, "query parameter 'world_size' must be an integer 1..255")
    tokens = ids if native.ext is not None else ids.tolist()  # the extension hashes the buffer itself
    return LookupRequest(cast(list, tokens), query.get("lora_name", [None])[0] or None,
                         query.get("cache_salt", [None])[0] or None, query.get("model_name", [None])[0] or None,
                         world_size)


def response_body(matches: list[InstanceMatch], fmt: str, detail: bool) -> dict | msgspec.Raw:
    """The JSON answer for ``matches`` (longest first) in shape ``fmt`` (flat | layout_info).

    For a kept answer (kvlookup.client.SharedAnswer) the layout is encoded once and kept with it:
    a prefix held by a thousand instances is not built and encoded again for every lookup."""
    shared = getattr(matches, "shared", None)
    if shared is not None and not detail:
        frag = shared.get(fmt)
        if frag is None:
            layout = {m.instance_id: [m.location, m.matched_prefix_length] for m in matches}
            if fmt != "layout_info":
                layout.pop("event_id", None)
            frag = shared[fmt] = _ENCODER.encode(layout)
        event = _ENCODER.encode(new_event_id("Lookup"))
        if fmt == "layout_info":
            return {"event_id": msgspec.Raw(event), "layout_info": msgspec.Raw(frag)}
        return msgspec.Raw(b'{"event_id":' + event + (b"," + frag[1:] if len(frag) > 2 else b"}"))
    layout = {m.instance_id: [m.location, m.matched_prefix_length] for m in matches}
    body: dict = {"event_id": new_event_id("Lookup")}
    if fmt == "layout_info":
        body["layout_info"] = layout
    else:
        body.update({k: v for k, v in layout.items() if k != "event_id"})
    if detail:
        body["detail"] = {m.instance_id: m.detail() for m in matches}
    return body


class LookupRoute:
    """WSGI middleware answering ``/lookup`` itself and passing every other path to ``app``.

    client: the lookup :class:`Client`; default_format: ``lookup_response``; max_tokens:
    longer prompts get 413. The body was read by :class:`app.body.RequestBody` in front.
    OPTIONS answers the allowed methods; other methods get 405.
    """

    def __init__(self, app: Callable, client: Client, default_format: str, max_tokens: int, explainer=None,
                 mp=None):
        self.app = app
        #: ``mp(matches, request) -> matches``: scopes the answer to ``model_name`` and adds the
        #: LMCache MP instances (kvlookup.app.coordinator.scoped_matches); None: no MP directory
        self.mp = mp
        self.client = client
        self.default_format = default_format
        self.max_tokens = max_tokens
        self.explainer = explainer

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not self.serves(path):
            return self.app(environ, start_response)
        status, body, headers = self.respond(path, environ.get("REQUEST_METHOD", ""),
                                             environ.get("QUERY_STRING", ""), environ["wsgi.input"].read(), environ,
                                             environ.get("CONTENT_TYPE", ""))
        self.count(environ)
        if body is None:
            start_response("200 OK", headers)
            return []
        return send_json(environ, start_response, status, body, headers)

    def serves(self, path: str) -> bool:
        """Is ``path`` answered here (not by the Flask app)?"""
        return path == PATH or (path == EXPLAIN_PATH and self.explainer is not None)

    def respond(self, path: str, method: str, query_string: str, data: bytes, keep: dict,
                content_type: str = "") -> tuple[int, dict | msgspec.Raw | None, list[tuple[str, str]]]:
        """One request to ``path`` (PATH or EXPLAIN_PATH): ``(status, JSON body or None, extra
        headers)``, errors in the API's JSON shape. ``keep`` gets the decoded request under
        :data:`REQUEST_KEY` and its hashed chains (kvlookup.client.CHAINS_KEY: a retry after NeedsRedis
        neither decodes nor hashes again), for the caller to free after the answer is sent (a
        32k-token list takes ~0.3 ms to free), and what :meth:`count` counts. OPTIONS answers the allowed
        methods; other methods get 405."""
        if method == "OPTIONS":
            return 200, None, [("Allow", ALLOW), ("Content-Length", "0")]
        if method != "POST":
            return 405, {"error": "The method is not allowed for the requested URL."}, [("Allow", ALLOW)]
        try:
            body, req = self._lookup(query_string, data, keep, content_type)
            if path == EXPLAIN_PATH:
                if isinstance(body, msgspec.Raw):  # a kept answer's encoded layout: explain reads the dict
                    body = msgspec.json.decode(body)
                body = self.explain(req, body)
            return 200, body, []
        except ApiError as exc:
            return exc.status, {"error": exc.message}, []
        except NeedsRedis:
            raise  # the caller asks again where waiting on Redis is allowed (app.asgi)
        except Exception as exc:  # the API never answers with an HTML page
            log.exception("unhandled error in %s", path)
            return 500, {"error": f"internal error: {type(exc).__name__}"}, []

    def explain(self, req: LookupRequest, body: dict) -> dict:
        """``POST /lookup/explain``: the same body, query and errors as /lookup; the answer is
        :meth:`kvlookup.index.explain.Explainer.explain` of the /lookup answer ``body``."""
        try:
            out = self.explainer.explain(list(req.tokens), body, Namespace(req.lora_name, req.cache_salt))
            if req.model_name is not None and self.mp is not None:
                out["mp"] = self.mp.explain(req)  # LMCache MP instances (app.coordinator.Scoper.explain)
        except redis.RedisError as exc:
            raise ApiError(503, f"index unavailable: {exc}") from None
        fleet_metrics.EXPLAINED.labels(out["cause"]).inc()
        return out

    def _lookup(self, query_string: str, data: bytes, keep: dict,
                content_type: str) -> tuple[dict | msgspec.Raw, LookupRequest]:
        query = parse_qs(query_string, keep_blank_values=True) if query_string else {}
        fmt = query.get("format", [self.default_format])[0]
        if fmt not in FORMATS:
            raise ApiError(400, "query parameter 'format' must be 'flat' or 'layout_info'")
        detail_arg = query.get("detail", ["0"])[0].lower()
        if detail_arg not in TRUE + FALSE:
            raise ApiError(400, "query parameter 'detail' must be 1/true/yes/on or 0/false/no/off")
        req = keep.get(REQUEST_KEY)  # decoded already when a first try needed Redis (app.asgi)
        if req is None:
            req = parse_request(data, self.max_tokens, content_type, query)
            keep[REQUEST_KEY] = req  # freed by the caller once the answer is sent
        start = time.perf_counter()
        causes: list[str] = []
        try:
            matches = self.client.matches(req.tokens, validate=False,
                                          namespace=Namespace(req.lora_name, req.cache_salt), causes=causes,
                                          model_name=req.model_name, scratch=keep)
            if req.model_name is not None and self.mp is not None:
                matches = self.mp(matches, req)
        except redis.RedisError as exc:
            _child(fleet_metrics.LOOKUPS, "redis_error").inc()
            raise ApiError(503, f"index unavailable: {exc}") from None
        if detail_arg in TRUE:
            try:
                matches = self.client.add_reusable(req.tokens, matches, Namespace(req.lora_name, req.cache_salt))
            except redis.RedisError as exc:
                raise ApiError(503, f"index unavailable: {exc}") from None
        body = response_body(matches, fmt, detail_arg in TRUE)
        keep[COUNT_KEY] = (matches[0].matched_prefix_length if matches else -1, causes[0],
                           time.perf_counter() - start)
        return body, req

    @staticmethod
    def count(keep: dict) -> None:
        """Count the lookup :meth:`respond` answered (the caller does it once the answer is sent,
        so the metrics' shared-memory writes are not in the lookup's latency)."""
        outcome = keep.pop(COUNT_KEY, None)
        if outcome is None:
            return
        matched, cause, seconds = outcome
        if matched >= 0:
            _child(fleet_metrics.LOOKUPS, "hit").inc()
            _child(fleet_metrics.OUTCOMES, "hit", "hit").inc()
        else:
            _child(fleet_metrics.LOOKUPS, "miss").inc()
            _child(fleet_metrics.OUTCOMES, "miss", cause or "unclassified").inc()
        fleet_metrics.LOOKUP_SECONDS.observe(seconds)
        fleet_metrics.LOOKUP_MATCHED_TOKENS.observe(max(matched, 0))


@functools.cache
def _child(metric, *labels: str):
    """``metric.labels(*labels)``, kept (a lookup counts twice; the label sets are few)."""
    return metric.labels(*labels)
