"""Every error leaves the API as JSON: ``{"error": "<what is wrong>"}`` with a 4xx/5xx status."""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

import msgspec
import redis
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error to send to the client. status: HTTP status; message names the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def decode_body(body: bytes, model: type, codec: str = "JSON"):
    """A request body decoded and validated as ``model`` (a msgspec Struct); codec: ``JSON`` or
    ``MessagePack``.

    Raises ApiError 400 naming the bad field (msgspec's ``$.field`` path), the decode error, or
    a nesting too deep to decode.
    """
    if not body.strip():
        raise ApiError(400, f"body is not valid {codec}: the body is empty (expected a {codec} object)")
    decode = msgspec.msgpack.decode if codec == "MessagePack" else msgspec.json.decode
    try:
        return decode(body, type=model)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"body is not valid {codec}: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"body is not valid {codec}: nested too deeply") from None


_encoder = msgspec.json.Encoder()


def json_bytes(body: dict | msgspec.Raw) -> bytes:
    """``body`` as the API sends it: compact JSON, keys in insertion order, a newline."""
    return _encoder.encode(body) + b"\n"


def send_json(environ: dict, start_response: Callable, status: int, body: dict | msgspec.Raw,
              headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    """Answer a WSGI request with ``body`` as JSON (no body bytes for HEAD)."""
    data = json_bytes(body)
    start_response(f"{status} {HTTPStatus(status).phrase}",
                   [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *(headers or [])])
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]


def init_app(app: Flask) -> None:
    """Register the JSON error handlers (Redis errors: 503 ``index unavailable``)."""

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        return jsonify(error=exc.message), exc.status

    @app.errorhandler(redis.RedisError)
    def _redis_error(exc: redis.RedisError):
        return jsonify(error=f"index unavailable: {exc}"), 503

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = exc.description or exc.name
        allow = [(k, v) for k, v in exc.get_headers() if k == "Allow"]  # 405 names the methods
        return jsonify(error=message), exc.code, allow

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return jsonify(error=f"internal error: {type(exc).__name__}"), 500
