"""Every request body is read up front, within a size and a time limit, before any handler runs.

A client that declares too much gets 413 without being read; one that sends a malformed
chunked body gets 400; one that does not finish its body within ``body_timeout_s`` gets 408
(the deadline needs gevent, the controller's default worker; under gthread/sync a slow body
holds its thread, see docs/operations.md). Handlers then read ``wsgi.input`` from memory.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

from gevent import Timeout

from kvlookup.app.errors import ApiError, send_json
from kvlookup.proc.green import patched

try:  # the errors gunicorn raises while decoding a chunked body
    from gunicorn.http.errors import NoMoreData, ParseException
    MALFORMED: tuple[type[BaseException], ...] = (ParseException, NoMoreData)
except ImportError:  # another WSGI server
    MALFORMED = ()


class RequestBody:
    """WSGI middleware: ``wsgi.input`` becomes the whole body (bytes in memory).

    max_bytes: larger bodies get 413 (declared or actual). timeout_s: the whole body must
    arrive within this many seconds (408), enforced when gevent has patched the process.
    """

    def __init__(self, app: Callable, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            body = self.read(environ)
        except ApiError as exc:
            return send_json(environ, start_response, exc.status, {"error": exc.message})
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)

    def read(self, environ: dict) -> bytes:
        """The body; ApiError 400 (bad length, malformed chunks), 408 (too slow), 413 (too large)."""
        length = environ.get("CONTENT_LENGTH")
        if length:
            size = declared_length(length, self.max_bytes)
        elif environ.get("wsgi.input_terminated"):
            size = self.max_bytes + 1  # chunked: the server ends the stream (gunicorn sets the flag)
        else:
            size = 0  # PEP 3333: no length, no promise of an end: no body
        with _deadline(self.timeout_s):
            try:
                data = environ["wsgi.input"].read(size) if size else b""
            except MALFORMED as exc:
                raise ApiError(400, f"malformed request body: {type(exc).__name__}") from None
        if len(data) > self.max_bytes:
            raise ApiError(413, "request body too large")
        return data


def declared_length(length: str | bytes, max_bytes: int) -> int:
    """A Content-Length value as bytes to read (negative: 0); ApiError 400 when it is not a
    number, 413 when it is over ``max_bytes``."""
    try:
        n = int(length)
    except ValueError:
        raise ApiError(400, "Content-Length is not a number") from None
    if n > max_bytes:
        raise ApiError(413, "request body too large")
    return max(n, 0)


def _deadline(seconds: float) -> AbstractContextManager:
    """A gevent.Timeout that raises ApiError 408, or nothing when gevent is not patched in."""
    if not patched():
        return nullcontext()
    return Timeout(seconds, ApiError(408, f"request body not received within {seconds:g} s"))
