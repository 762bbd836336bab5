"""The controller's default gunicorn worker: uvicorn (libuv loop, C HTTP parser) serving
:func:`app.create_asgi_app`; gunicorn's master still forks, restarts and signals the workers.

Measured side by side with wrk (docs/benchmarks-notes.md "Per-request cost"): an empty app
answers in ~0.18 ms under this worker and ~0.33 ms under gunicorn's gevent worker, and a
12-token lookup ~0.40 ms against ~0.60 ms. A request uvicorn cannot parse gets a JSON 400,
like every other error of the API.
"""

from __future__ import annotations

import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker as _UvicornWorker

from kvlookup.app.errors import json_bytes

#: The body of the 400 sent for a request that is not HTTP/1.1 (a bad request line, header or
#: chunk size).
MALFORMED = {"error": "malformed HTTP request (bad request line, header or chunked encoding)"}
#: A request's line and headers must arrive within this many seconds of its first byte (or of
#: the connection, for a client that sends nothing): then 408 and the connection closes. The
#: controller's app (app.asgi) has its own ``timeout_s`` (``body_timeout_s``), used instead.
HEAD_TIMEOUT_S = 10.0
#: Header limits, as gunicorn's defaults (limit_request_fields, limit_request_field_size): 431.
MAX_HEADER_FIELDS = 100
MAX_HEADER_BYTES = 8190


class JsonErrorsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering unparsable requests with the API's JSON error and
    bounding what a request head may cost: its time (:data:`HEAD_TIMEOUT_S`, so connections that
    stall before their headers are closed instead of piling up) and its size (431)."""

    _head_timer = None
    _fields = 0
    _refused = False

    def connection_made(self, transport) -> None:
        if os.environ.get("KVLOOKUP_COALESCE_WRITES", "1") != "0":
            transport = _Coalescing(transport, self.loop)
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._fields = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > MAX_HEADER_FIELDS or len(name) + len(value) > MAX_HEADER_BYTES:
            self._refuse(431, {"error": f"request header fields too large (at most {MAX_HEADER_FIELDS} "
                                        f"fields of {MAX_HEADER_BYTES} bytes)"})
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, MALFORMED)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._head_timeout_s(), self._head_too_slow)

    def _head_timeout_s(self) -> float:
        return getattr(self.app, "timeout_s", HEAD_TIMEOUT_S)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:  # not while a request is being answered
            self._refuse(408, {"error": f"request headers not received within {self._head_timeout_s():g} s"})

    def _refuse(self, status: int, body: dict) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._disarm_head_timer()
        data = json_bytes(body)
        phrase = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        self.transport.write(b"".join([
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, phrase),
            b"content-length: ", str(len(data)).encode(), b"\r\nconnection: close\r\n\r\n", data]))
        self.transport.close()


class _Coalescing:
    """A connection's transport that holds a write back until the next write or the end of the
    loop's turn: uvicorn writes a response's head and its body separately, and here they leave
    in one ``write`` (one syscall, one wakeup of the client instead of two; a 12-token lookup's
    whole cost is a few of those, docs/benchmarks-notes.md "Fresh prompts"). Everything else is
    the transport's own; close and write_eof send what is held first, abort drops it."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: Any, loop: Any):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            held, self._held = self._held, None
            self._transport.write(held + data)

    def writelines(self, lines) -> None:
        self.write(b"".join(lines))

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class UvicornWorker(_UvicornWorker):
    """``worker_class = "kvlookup.app.asgi_worker.UvicornWorker"``: uvloop, httptools, no access
    log, no lifespan, no ``server`` header, no proxy headers (the API never uses the client's
    address). No connection limit: stalled heads (:data:`HEAD_TIMEOUT_S`), bodies
    (``body_timeout_s``) and idle keep-alive connections (5 s) are closed instead, so a flood of
    silent connections cannot lock out the others (a limit answered them all 503)."""

    CONFIG_KWARGS = {"loop": "uvloop", "http": JsonErrorsProtocol, "lifespan": "off", "access_log": False,
                     "server_header": False, "ws": "none", "proxy_headers": False}

    async def _serve(self) -> None:
        listeners: list[Any] = self.sockets  # type: ignore[has-type]
        self.sockets = [_UvloopOwned(s) for s in listeners]
        await super()._serve()


class _UvloopOwned:
    """One of gunicorn's listening sockets as uvicorn sees it. uvloop closes the file descriptor
    itself when the server stops serving; uvicorn then closes the socket object too, which
    failed with EBADF ("Error while closing socket [Errno 9] Bad file descriptor", once per
    worker at every stop). Here that second close forgets the descriptor (``detach``) instead:
    closing it again could close a descriptor the process reused meanwhile."""

    def __init__(self, listener: Any):
        self._listener = listener

    def __getattr__(self, name: str) -> Any:
        return getattr(self._listener, name)

    def close(self) -> None:
        sock = getattr(self._listener, "sock", None)
        if sock is not None:
            sock.detach()
            self._listener.sock = None
