"""``POST /lookup``: which instance holds the longest prefix of a prompt, and where.

Request ``{"tokens": [int, ...], "lora_name"?: str, "cache_salt"?: str}`` (the last two select
the namespace of vLLM blocks: a LoRA adapter, vLLM's per-request cache salt).
Response (``lookup_response: flat``, the default)::

    {"event_id": "Lookup<uuid4>", "<instance_id>": ["<location>", <matched_prefix_length>], ...}

or LMCache's own wire shape with ``lookup_response: layout_info`` / ``?format=layout_info``::

    {"event_id": "Lookup<uuid4>", "layout_info": {"<instance_id>": ["<location>", <length>]}}

Instances are listed longest match first. ``?detail=1`` adds ``"detail": {instance_id:
{location, matched_prefix_length, locations, ranks?}}``. No match: only ``event_id``
(and an empty ``layout_info``).
"""

from __future__ import annotations

import time

import msgspec
import redis
from flask import Blueprint, Response, current_app, request

from app.errors import ApiError, decode_body
from kvlookup import metrics
from kvlookup.client import TokenId, new_event_id

bp = Blueprint("lookup", __name__)


class LookupRequest(msgspec.Struct):
    tokens: list[TokenId]
    lora_name: str | None = None
    cache_salt: str | None = None


_encoder = msgspec.json.Encoder()


def parse_request(body: bytes, max_tokens: int) -> LookupRequest:
    """Validate a /lookup body; raises ApiError 400 naming the problem, 413 when too long."""
    req = decode_body(body, LookupRequest)
    if len(req.tokens) > max_tokens:
        raise ApiError(413, f"'tokens' has {len(req.tokens)} ids, more than the maximum {max_tokens}")
    return req


@bp.post("/lookup")
def lookup() -> Response:
    ext = current_app.extensions["kvlookup"]
    settings, client = ext["settings"], ext["client"]
    fmt = request.args.get("format", settings.lookup_response)
    if fmt not in ("flat", "layout_info"):
        raise ApiError(400, "query parameter 'format' must be 'flat' or 'layout_info'")
    start = time.perf_counter()
    req = parse_request(request.get_data(cache=False), settings.max_tokens)
    try:
        matches = client.matches(req.tokens, validate=False, lora_name=req.lora_name,
                                 cache_salt=req.cache_salt)
    except redis.RedisError as exc:
        metrics.LOOKUPS.labels("redis_error").inc()
        raise ApiError(503, f"index unavailable: {exc}") from None
    layout = {m.instance_id: [m.location, m.matched_prefix_length] for m in matches}
    body: dict = {"event_id": new_event_id("Lookup")}
    if fmt == "layout_info":
        body["layout_info"] = layout
    else:
        body.update({k: v for k, v in layout.items() if k != "event_id"})
    if request.args.get("detail") in ("1", "true"):
        body["detail"] = {m.instance_id: m.detail() for m in matches}
    metrics.LOOKUPS.labels("hit" if matches else "miss").inc()
    metrics.LOOKUP_SECONDS.observe(time.perf_counter() - start)
    metrics.LOOKUP_MATCHED_TOKENS.observe(matches[0].matched_prefix_length if matches else 0)
    return Response(_encoder.encode(body) + b"\n", mimetype="application/json")
