"""``/lookup/explain`` answered in a child process of the controller worker (issue 20 item 8).

An explain is CPU-bound Python (0.04 s at 2k holders, 0.26 s at 20k) plus hundreds of Redis
round trips whose reply parsing holds the GIL too. Run in a thread of the worker (as before),
32 concurrent explains left ``/health`` p99 at 77-130 ms on an idle 2-core host and ~260 ms at
load 4 (each of its ~20 GIL hand-offs waited behind the explain); the same explains run by
another process left it at 20-30 ms. So each worker starts one child (spawned, not forked:
the worker has threads) running the controller's own app (:func:`kvlookup.app.create_app` of
the same settings, its lookup cache included: without it an explain at 2k holders costs Redis
8x the CPU), at a lower CPU priority (:data:`NICE`), and hands it each explain's request over
a pipe, one at a time; the child answers with the encoded JSON (a ~100-200 KB answer is sent
as bytes, not pickled as a dict). How many may wait is the caller's bound
(:class:`kvlookup.app.asgi.AsgiController`).

The child exits with the worker: its end of the pipe reads EOF when the worker is gone (a
clean stop or a kill -9), and a SIGTERM to the controller's group stops it at once. A child
that died is started again for the next explain (the one it was answering gets 503).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection

import msgspec

from kvlookup import config as kvconfig

#: The child's niceness: an explain is a diagnosis, and on a busy host the CPU goes first to
#: /health, lookups and Redis (which the explain itself waits on).
NICE = 10

_encoder = msgspec.json.Encoder()
Answer = tuple[int, "bytes | None", list[tuple[str, str]]]


def _serve(conn: Connection, settings: kvconfig.Settings) -> None:
    """The child: build the controller app once, then answer requests from ``conn`` until EOF."""
    from kvlookup.app import create_app

    os.nice(NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker; it ends this by EOF
    route = create_app(settings).extensions["kvlookup"]["lookup_route"]
    while True:
        try:
            path, method, query, data, ctype = conn.recv()
        except EOFError:
            return
        keep: dict = {}
        status, body, headers = route.respond(path, method, query, data, keep, ctype)
        route.count(keep)
        conn.send((status, None if body is None else _encoder.encode(body), headers))


class ExplainPool:
    """One child answering one worker's explains (``respond`` is called from a thread)."""

    def __init__(self, settings: kvconfig.Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        threading.Thread(target=self._started, name="kvlookup-explain-start", daemon=True).start()

    def _started(self) -> Connection:
        """The pipe to a running child (started now if there is none)."""
        with self._lock:
            if self._conn is None or self._proc is None or not self._proc.is_alive():
                ctx = multiprocessing.get_context("spawn")
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(theirs, self.settings), name="kvlookup-explain", daemon=True)
                proc.start()
                theirs.close()
                self._conn, self._proc = ours, proc
            return self._conn

    def respond(self, args: tuple) -> tuple[int, msgspec.Raw | dict | None, list[tuple[str, str]]]:
        """:meth:`kvlookup.app.lookup.LookupRoute.respond`'s answer to ``args`` (its arguments;
        ``keep`` is not used: the child counts the request), from the child; blocks."""
        path, method, query, data, _keep, ctype = args
        conn = self._started()
        with self._lock:
            try:
                conn.send((path, method, query, data, ctype))
                status, body, headers = conn.recv()
            except (EOFError, OSError):
                self._conn = None
                return 503, {"error": "the explain process stopped; retry"}, [("Retry-After", "1")]
        return status, None if body is None else msgspec.Raw(body), headers
