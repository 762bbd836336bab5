"""The controller's default gunicorn worker: uvicorn (libuv loop, C HTTP parser) serving
:func:`app.create_asgi_app`; gunicorn's master still forks, restarts and signals the workers.

Measured side by side with wrk (docs/benchmarks-notes.md "Per-request cost"): an empty app
answers in ~0.18 ms under this worker and ~0.33 ms under gunicorn's gevent worker, and a
12-token lookup ~0.40 ms against ~0.60 ms. A request uvicorn cannot parse gets a JSON 400,
like every other error of the API.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker as _UvicornWorker

from app.errors import json_bytes

#: The body of the 400 sent for a request that is not HTTP/1.1 (a bad request line, header or
#: chunk size).
MALFORMED = {"error": "malformed HTTP request (bad request line, header or chunked encoding)"}


class JsonErrorsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering unparsable requests with the API's JSON error."""

    def send_400_response(self, msg: str) -> None:
        data = json_bytes(MALFORMED)
        self.transport.write(b"".join([
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n",
            b"content-length: ", str(len(data)).encode(), b"\r\nconnection: close\r\n\r\n", data]))
        self.transport.close()


class UvicornWorker(_UvicornWorker):
    """``worker_class = "kvlookup.asgi_worker.UvicornWorker"``: uvloop, httptools, no access
    log, no lifespan, no ``server`` header, no proxy headers (the API never uses the client's
    address), gunicorn's ``worker_connections`` as the limit."""

    CONFIG_KWARGS = {"loop": "uvloop", "http": JsonErrorsProtocol, "lifespan": "off", "access_log": False,
                     "server_header": False, "ws": "none", "proxy_headers": False}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # at most gunicorn's worker_connections (1,000) connections and requests; uvicorn answers 503 beyond
        self.config.limit_concurrency = self.cfg.worker_connections
