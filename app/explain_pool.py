"""``/lookup/explain`` answered in a child process of the controller worker (issue 20 item 8).

An explain is CPU-bound Python (0.04 s at 2k holders, 0.26 s at 20k) plus hundreds of Redis
round trips whose reply parsing holds the GIL too. Run in a thread of the worker (as before),
32 concurrent explains left ``/health`` p99 at 77-130 ms on an idle 2-core host and ~260 ms at
load 4 (each of its ~20 GIL hand-offs waited behind the explain); the same explains run by
another process left it at 20-30 ms. So each worker starts one child at its first explain
(spawned, not forked: the worker has threads) running the controller's own app
(:func:`kvlookup.app.create_app` of the same settings, its lookup cache included: without
it an explain at 2k holders costs Redis 8x the CPU), at a lower CPU priority (:data:`NICE`),
and hands it each explain's request over a pipe, one at a time (from the caller's one heavy
thread); the child answers with the encoded JSON (a ~100-200 KB answer is sent as bytes, not
pickled as a dict). How many may wait is the caller's bound
(:class:`kvlookup.app.asgi.AsgiController`). ``/health`` lists it as the component
``explain process`` (:meth:`ExplainPool.health`).

The child exits with the worker: its end of the pipe reads EOF when the worker is gone (a
clean stop or a kill -9), and a SIGTERM to the controller's group stops it at once. Until it
is ready, and while one that died is replaced, the worker answers explains itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from kvlookup import config as kvconfig

#: The child's niceness: an explain is a diagnosis, and on a busy host the CPU goes first to
#: /health, lookups and Redis (which the explain itself waits on).
NICE = 10
#: A child that died is started again at most this often (seconds).
RESTART_S = 5.0
READY = "ready"

_encoder = msgspec.json.Encoder()


def _serve(conn: Connection, create_app: Callable[[kvconfig.Settings], Any], settings: kvconfig.Settings) -> None:
    """The child: build the controller app once (``create_app(settings)``, a Flask app), then
    answer requests from ``conn`` until EOF."""
    os.nice(NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker; it ends this by EOF
    route = create_app(settings).extensions["kvlookup"]["lookup_route"]
    conn.send(READY)
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
    """One child answering one worker's explains (``respond`` is called from a thread).

    create_app: :func:`kvlookup.app.create_app` (passed in: this module does not import the
    package it is part of); settings: the worker's. The child is started by the first explain;
    until it has built its app (about a second, several on a busy host), and while one that died
    is being replaced (at most every RESTART_S), explains are answered in the calling thread."""

    def __init__(self, create_app: Callable[[kvconfig.Settings], Any], settings: kvconfig.Settings):
        self.create_app, self.settings = create_app, settings
        self._ready = threading.Event()
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._next_start = 0.0  # started by the first explain (most controllers never get one)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, self.create_app, self.settings), name="kvlookup-explain",
                           daemon=True)
        proc.start()
        theirs.close()
        self._ready.clear()
        self._conn, self._proc, self._next_start = ours, proc, time.monotonic() + RESTART_S
        threading.Thread(target=self._await_ready, args=(ours,), name="kvlookup-explain-start", daemon=True).start()

    def _await_ready(self, conn: Connection) -> None:
        try:
            if conn.recv() == READY:
                self._ready.set()
        except (EOFError, OSError):
            pass  # it died starting: ready() starts another

    def _answering(self) -> bool:
        return self._ready.is_set() and self._proc is not None and self._proc.is_alive()

    def ready(self) -> bool:
        """Is a child ready to answer? One that died is started again (not waited for)."""
        if self._answering():
            return True
        if (self._proc is None or not self._proc.is_alive()) and time.monotonic() >= self._next_start:
            self._start()
        return False

    def health(self, _app) -> list[tuple[str, dict, bool]]:
        """An app.health check: ``("explain process", {"state": "up", "ready": bool, "pid": ...},
        True)``; always up (until the child is ready the worker answers explains itself)."""
        return [("explain process", {"state": "up", "ready": self._answering(),
                                     "pid": self._proc.pid if self._proc is not None else None}, True)]

    def respond(self, args: tuple, here: Callable[..., tuple]) -> tuple:
        """:meth:`kvlookup.app.lookup.LookupRoute.respond`'s answer to ``args`` (its arguments)
        from the child (``keep`` is not used: the child counts the request), or ``here(*args)``
        when no child is ready or it dies answering; blocks."""
        if not self.ready() or self._conn is None:
            return here(*args)
        path, method, query, data, _keep, ctype = args
        try:
            self._conn.send((path, method, query, data, ctype))
            status, body, headers = self._conn.recv()
        except (EOFError, OSError):
            self._ready.clear()
            return here(*args)
        return status, None if body is None else msgspec.Raw(body), headers
