"""The controller as an ASGI app (served by uvicorn workers under gunicorn, the default).

``/lookup`` and ``/lookup/explain`` are answered here, in the worker's event loop, by the same
:class:`app.lookup.LookupRoute` as under WSGI; the LMCache MP coordinator's two traffic paths,
``POST /events`` and ``POST /directory/lookup``, are answered here too, in the thread pool, by the
functions the Flask routes call (:class:`app.coordinator.FastPaths`: the WSGI bridge cost ~1.5 ms
a request, more than a 256-token directory lookup); every other path goes to the Flask app through
a2wsgi (a thread pool), so the control API, the dashboard and /health behave as under
gunicorn's WSGI workers. Why: uvicorn's C HTTP parser and libuv loop answer a request in
~0.18 ms where gunicorn's gevent worker takes ~0.33 ms on this machine (an empty app, wrk c=1),
and a lookup costs less than either (docs/benchmarks-notes.md "Per-request cost").

Every request body is read here first, within ``max_body_bytes`` (413) and ``body_timeout_s``
(408), as :class:`app.body.RequestBody` does for WSGI. A lookup answered from the controller's
cached reads does no I/O, so it runs in the loop; one that must ask Redis (``lookup_cache:
off`` on one Redis or a Cluster, Sentinel, or a chunk or holder not in the copies: kvlookup.index.tracking's
``LOCAL_ONLY`` / ``NeedsRedis``) runs in the thread pool, so a slow round trip never holds
the other connections; one whose missing chunks were all missed for the first time (a fresh
prompt) is read there by digest, untracked (:data:`FIRST_MISS`), or with :data:`MISS_LOOP` on
(not the default) from the loop itself without blocking it (kvlookup.index.loop_reads); while most
of a worker's recent attempts in the loop missed, it skips them and sends lookups there at once
(:class:`LoopOdds`, :data:`LOOP_SKIP`). Every explain and every
lookup with a large body (decoded and hashed off the loop) runs in a small bounded pool of its
own (HEAVY_THREADS), so they never delay /health or ordinary lookups; when it is full they are
answered 503. An explain is answered by a child process of the worker (:mod:`app.explain_pool`),
so its CPU-bound walk and reply parsing do not hold this process's GIL while /health waits for
it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import msgspec
from a2wsgi import WSGIMiddleware, asgi_typing, wsgi_typing
from flask import Flask

from kvlookup.app import fleet_metrics
from kvlookup.app.auth import host_allowed
from kvlookup.app.body import declared_length
from kvlookup.app.errors import ApiError, json_bytes
from kvlookup.app.explain_pool import ExplainPool
from kvlookup.app.lookup import EXPLAIN_PATH, LookupRoute
from kvlookup.index import staged
from kvlookup.index.loop_reads import LoopRedis, run_in_loop
from kvlookup.index.mp_copies import NO_COPY
from kvlookup.index.tracking import LOCAL_ONLY, UNTRACKED, NeedsRedis

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

#: Threads per worker process for the Flask app (control calls may wait on a slow LMCache
#: worker for ``control_timeout_s``) and for lookups that need Redis round trips.
THREADS = 16
#: Heavy requests (every explain, and a lookup whose body is over BIG_BODY_BYTES: decoding and
#: hashing 1M tokens takes ~1 s) run in a pool of their own, HEAVY_THREADS wide, with at most
#: HEAVY_WAITING more waiting; beyond that they are answered 503 at once (Retry-After: 1). So
#: /health, the control API and ordinary lookups never wait behind them (issue 20 item 8).
HEAVY_THREADS = 1
HEAVY_WAITING = 16
BIG_BODY_BYTES = 64 * 1024
#: How long a thread holds the GIL before it must hand it over (CPython's default is 5 ms): a
#: request waiting behind a CPU-bound explain gets it back within this.
SWITCH_INTERVAL_S = 0.0005
#: How a lookup the copies could not answer, all of whose missing chunks were missed for the
#: first time (a fresh prompt's new chunk), is read: ``digest`` (the default: by digest, as
#: ``lookup_cache: off`` reads, untracked; a chunk missed again is read tracked and kept) or
#: ``tracked`` (through the copies, ``CLIENT CACHING YES`` + ``ZRANGE``; 0.92x the throughput
#: and 1.15x the CPU on fresh prompts, docs/benchmarks-notes.md "Fresh prompts, third pass").
FIRST_MISS = os.environ.get("KVLOOKUP_FIRST_MISS", "digest")
#: ``digest-all``: the digest read of a first miss reads every chunk's head from Redis, not only
#: those the copies lack (kvlookup.index.staged.MISS_COPIES; docs/benchmarks-notes.md, fresh18e)
if FIRST_MISS == "digest-all":
    staged.MISS_COPIES = False
#: ``on``: the event loop skips its attempt from the copies while its recent attempts mostly
#: missed (:class:`LoopOdds`; a fresh workload), sending the lookup to a thread at once, read by
#: digest; ``off``: it always tries (docs/benchmarks-notes.md "Fresh prompts, fourth pass").
LOOP_SKIP = os.environ.get("KVLOOKUP_LOOP_SKIP", "on")
#: ``off``: /directory/lookup never tries the event loop (from the MP bucket copies), always a thread
#: (a bench's design knob: docs/benchmarks-notes.md "MP /directory/lookup from whole-bucket copies")
MP_LOOP = os.environ.get("KVLOOKUP_MP_LOOP", "on")
#: ``on``: a lookup read by digest (a first miss, or one :class:`LoopOdds` skipped) is read in the event
#: loop on the worker's own asyncio connection, the lookup suspended in a greenlet meanwhile
#: (kvlookup.index.loop_reads; no thread hop, the loop serves others while it waits); ``off``: in a
#: pool thread (the default); ``auto``: on while the worker is not busy (LOOP_READ_BUSY). Where the
#: store has no such connection (Cluster, Sentinel, TLS) or the read fails, the pool thread answers.
#: Not the default: over HTTP on the 2-core box, alternating with the thread read in one run, ``on``
#: gave 0.53-0.63x and ``auto`` 0.90x its req/s (medians of 32 cells), for 3-10% less CPU a lookup
#: (docs/benchmarks-notes.md "Fresh prompts, sixth pass").
MISS_LOOP = os.environ.get("KVLOOKUP_MISS_LOOP", "off")
#: ``auto``: read in the loop only while this worker has at most this many lookups in flight (this
#: one included); busier, in a pool thread.
LOOP_READ_BUSY = 1
#: Where the event-loop attempt leaves, in the request's ``keep``, that the thread reads by digest.
FIRST_MISS_KEY = "kvlookup.first_miss"
#: Where :meth:`AsgiController._respond_here` leaves whether it tried the loop (LOOP_ATTEMPTS).
LOOP_KEY = "kvlookup.loop_attempt"
#: Where :meth:`AsgiController._respond_in_loop` leaves how its read went (LOOP_READS).
LOOP_READ_KEY = "kvlookup.loop_read"


class LoopOdds:
    """Whether the event loop should try a lookup from the copies first (the event-loop thread only).

    ``rate``: the tries' hit rate, decaying by ``weight`` a try (a hit: answered in the loop). While
    it is below ``below``, :meth:`try_loop` says no, except for every ``probe_every``-th lookup, so
    a workload that turns hot (its chunks read tracked once lacked twice) brings the rate back up.
    ``tried`` / ``skipped``: counts since start (kvlookup_lookup_loop_attempts_total counts the same).
    """

    def __init__(self, weight: float = 1 / 16, below: float = 0.25, probe_every: int = 8):
        self.weight, self.below, self.probe_every = weight, below, probe_every
        self.rate = 1.0
        self.tried = self.skipped = 0

    def try_loop(self) -> bool:
        """True: try the copies in the loop (then :meth:`note` the outcome); False: skip them."""
        if self.rate >= self.below or (self.tried + self.skipped) % self.probe_every == 0:
            self.tried += 1
            return True
        self.skipped += 1
        return False

    def note(self, hit: bool) -> None:
        self.rate += self.weight * (hit - self.rate)


class AsgiController:
    """ASGI app around ``flask_app`` (built by :func:`app.create_app`, which holds the route).

    max_bytes / timeout_s: body limits (``max_body_bytes``, ``body_timeout_s``). Lifespan
    events are acknowledged; websockets are refused.
    """

    def __init__(self, flask_app: Flask, route: LookupRoute, max_bytes: int, timeout_s: float,
                 bind_host: str = "0.0.0.0", explains: ExplainPool | None = None):
        self.route = route
        #: POST /events and /directory/lookup (kvlookup.app.coordinator.FastPaths), answered
        #: in the thread pool without the WSGI bridge
        self.mp = flask_app.extensions.get("kvlookup", {}).get("mp_fast")
        self.bind_host = bind_host  # the Flask app checks Host itself (app.create_app)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        # cast: a2wsgi types the WSGI environ and the ASGI messages as TypedDicts, Flask and this
        # module as plain dicts (the same values)
        self.wsgi = WSGIMiddleware(cast(wsgi_typing.WSGIApp, flask_app.wsgi_app), workers=THREADS)
        self.heavy = ThreadPoolExecutor(HEAVY_THREADS, thread_name_prefix="kvlookup-heavy")
        #: explains in a child process (app.explain_pool); None: in ``heavy`` like large lookups
        self.explains = explains
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # a CPU-bound explain hands the GIL over sooner
        self._heavy_now = 0  # heavy requests running or waiting (the event loop's thread only)
        self.odds = LoopOdds() if LOOP_SKIP == "on" else None
        #: the same for /directory/lookup from the MP bucket copies (kvlookup.index.mp_copies): under
        #: ingest churn few lookups find every bucket copied, and copying them again is wasted
        self.mp_odds = LoopOdds()
        #: the same for large lookups, tried in the heavy pool (HEAVY_THREADS is 1: its thread only)
        self.heavy_odds = LoopOdds() if LOOP_SKIP == "on" else None
        self._conn: LoopRedis | bool | None = None  # _loop_conn: None not made yet, False none here
        self._lookups = 0  # lookups and explains in flight (the event loop's thread only)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return None
        try:
            data = await self.read(scope, receive)
        except ApiError as exc:  # the rest of the body is never read: the connection closes
            return await send_json(send, exc.status, {"error": exc.message}, [("Connection", "close")])
        path = scope["path"]
        mp = self.mp is not None and self.mp.serves(scope["method"], path)
        if (mp or self.route.serves(path)) and not host_allowed(_text(_header(scope, b"host")), self.bind_host):
            return await send_json(send, 421, {"error": "Host is not this controller's (bound to loopback)"})
        if mp:
            memo: dict = {}  # decoded and hashed once, in the loop or the thread
            here = None
            if MP_LOOP == "on" and self.mp.local_now(path):
                if self.mp_odds.try_loop():
                    here = self.mp.respond_here(path, data, memo)
                    self.mp_odds.note(here is not None)
                else:  # most recent tries missed (ingest churn): no try, and no copying for this one
                    memo[NO_COPY] = True
            status, raw = here if here is not None else await asyncio.get_running_loop().run_in_executor(
                self.wsgi.executor, self.mp.respond, path, data, memo)
            return await send_bytes(send, status, raw)
        if not self.route.serves(path):
            return await self.wsgi(cast(asgi_typing.HTTPScope, _with_length(scope, len(data))),
                                   cast(asgi_typing.Receive, _replay(data)), cast(asgi_typing.Send, send))
        keep: dict = {}
        ctype = _header(scope, b"content-type")
        args = (path, scope["method"], scope["query_string"].decode("latin-1"), data, keep,
                ctype.decode("latin-1") if ctype else "")
        heavy = path == EXPLAIN_PATH or len(data) > BIG_BODY_BYTES
        self._lookups += 1
        try:
            status, body, headers = await self._answer(path, args, keep, heavy)
        finally:
            self._lookups -= 1
        await send_json(send, status, body, headers)
        self.route.count(keep)  # counted, and the decoded request freed, after the answer is out
        if (attempt := keep.get(LOOP_KEY)) is not None:
            _attempts(attempt).inc()
        if (read := keep.get(LOOP_READ_KEY)) is not None:
            _loop_reads(read).inc()
        keep.clear()

    async def _answer(self, path: str, args: tuple, keep: dict, heavy: bool) -> tuple:
        """The answer of a lookup or explain: in the loop, from its copies or (a first miss) its
        own read; else in a pool thread or the heavy pool."""
        answer = None if heavy else self._respond_here(path, args)
        if heavy:
            answer = await self._heavy(args, path == EXPLAIN_PATH)
        else:  # the request decoded in the loop (in ``keep``) is not decoded again
            untracked = keep.pop(FIRST_MISS_KEY, False)
            if answer is None and untracked and (conn := self._loop_conn()) is not None \
                    and (MISS_LOOP == "on" or self._lookups <= LOOP_READ_BUSY):
                answer = await self._respond_in_loop(args, conn)
            if answer is None:
                answer = await asyncio.get_running_loop().run_in_executor(self.wsgi.executor, self._respond_there,
                                                                          args, untracked)
        return answer

    async def _heavy(self, args: tuple, explain: bool) -> tuple:
        """Answer in the heavy pool (an explain: in the explain process when there is one);
        (503, busy) when HEAVY_THREADS + HEAVY_WAITING are taken."""
        if self._heavy_now >= HEAVY_THREADS + HEAVY_WAITING:
            return 503, {"error": "busy: too many explains or large lookups at once; retry"}, [("Retry-After", "1")]
        self._heavy_now += 1
        loop = asyncio.get_running_loop()
        try:
            if explain and self.explains is not None:
                return await loop.run_in_executor(self.heavy, self.explains.respond, args, self.route.respond)
            return await loop.run_in_executor(self.heavy, self._respond_heavy, args)
        finally:
            self._heavy_now -= 1

    def _respond_heavy(self, args: tuple) -> tuple:
        """A large lookup in a heavy thread, read as the loop reads a small one: from the copies
        when they have it all (a kept answer), else a first miss by digest, taking from the copies
        what they hold (kvlookup.index.staged ``peek``: a 32k-token prompt with a new last block
        reads one chunk); the odds of the heavy threads' own tries (:attr:`heavy_odds`) skip the
        try while it keeps missing."""
        if args[0] == EXPLAIN_PATH or not self.route.client.store.reads_locally():
            return self.route.respond(*args)
        odds = self.heavy_odds
        untracked = True
        if odds is None or odds.try_loop():
            token = LOCAL_ONLY.set(True)
            try:
                answer = self.route.respond(*args)
            except NeedsRedis as exc:
                answer, untracked = None, exc.first_miss and FIRST_MISS in ("digest", "digest-all")
            finally:
                LOCAL_ONLY.reset(token)
            if odds is not None:
                odds.note(answer is not None)
            if answer is not None:
                return answer
        return self._respond_there(args, untracked)

    def _respond_here(self, path: str, args: tuple) -> tuple | None:
        """The answer from the event loop when it needs nothing from Redis (the chunk sets and
        holders are in the process's copies); None when it must be asked in a thread."""
        if path == EXPLAIN_PATH or not self.route.client.store.reads_locally():
            return None
        odds = self.odds
        if odds is not None and not odds.try_loop():
            args[4][FIRST_MISS_KEY] = True  # the thread reads by digest, as for a first miss
            args[4][LOOP_KEY] = "skipped"
            return None
        token = LOCAL_ONLY.set(True)
        try:
            answer = self.route.respond(*args)
        except NeedsRedis as exc:
            if exc.first_miss and FIRST_MISS in ("digest", "digest-all"):
                args[4][FIRST_MISS_KEY] = True
            answer = None
        finally:
            LOCAL_ONLY.reset(token)
        if odds is not None:
            odds.note(answer is not None)
            args[4][LOOP_KEY] = "tried"
        return answer

    def _loop_conn(self) -> LoopRedis | None:
        """This worker's connection for reads by digest from the loop (made on first use, after the
        fork); None when MISS_LOOP is off or the store has none."""
        conn = self._conn
        if conn is None:
            made = self.route.client.store.loop_redis() if MISS_LOOP != "off" else None
            conn = self._conn = made if made is not None else False
        return conn if isinstance(conn, LoopRedis) else None

    async def _respond_in_loop(self, args: tuple, conn: LoopRedis) -> tuple | None:
        """The answer read by digest in the loop (kvlookup.index.loop_reads); None when something
        there needs a thread after all (a read failed, the clock is due a measurement, ...)."""
        try:
            answer = cast(tuple, await run_in_loop(functools.partial(_untracked_here, self.route, args), conn))
        except NeedsRedis:
            args[4][LOOP_READ_KEY] = "thread"
            return None
        args[4][LOOP_READ_KEY] = "answered"
        return answer

    def _respond_there(self, args: tuple, untracked: bool) -> tuple:
        """The answer from a pool thread (may wait on Redis); ``untracked``: read by digest,
        not through the copies (a fresh prompt's new chunk, :data:`FIRST_MISS`)."""
        if not untracked:
            return self.route.respond(*args)
        token = UNTRACKED.set(True)
        try:
            return self.route.respond(*args)
        finally:
            UNTRACKED.reset(token)

    async def read(self, scope: dict, receive: Receive) -> bytes:
        """The whole body; ApiError 400 (bad Content-Length), 408 (too slow), 413 (too large)."""
        length = _header(scope, b"content-length")
        if length is not None:
            declared_length(length, self.max_bytes)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        break
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ApiError(413, "request body too large")
                    chunks.append(chunk)
                    if not msg.get("more_body"):
                        break
        except TimeoutError:
            raise ApiError(408, f"request body not received within {self.timeout_s:g} s") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_json(send: Send, status: int, body: dict | msgspec.Raw | None,
                    headers: list[tuple[str, str]] | None = None) -> None:
    """Answer with ``body`` as JSON (``None``: no body, the headers given name its length)."""
    await send_bytes(send, status, None if body is None else json_bytes(body), headers)


async def send_bytes(send: Send, status: int, data: bytes | None,
                     headers: list[tuple[str, str]] | None = None) -> None:
    """Answer with ``data``, already JSON (``None``: no body, the headers given name its length)."""
    head = [] if data is None else [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode())]
    head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers or ()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data or b""})


def _untracked_here(route: LookupRoute, args: tuple) -> tuple:
    """``route.respond(*args)`` read by digest, never waiting on Redis (in run_in_loop's greenlet,
    whose context vars are its own)."""
    LOCAL_ONLY.set(True)
    UNTRACKED.set(True)
    return route.respond(*args)


@functools.cache
def _loop_reads(outcome: str):
    """``LOOP_READS.labels(outcome)``, kept (answered | thread)."""
    return fleet_metrics.LOOP_READS.labels(outcome)


@functools.cache
def _attempts(attempt: str):
    """``LOOP_ATTEMPTS.labels(attempt)``, kept (two label values)."""
    return fleet_metrics.LOOP_ATTEMPTS.labels(attempt)


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _with_length(scope: dict, length: int) -> dict:
    """``scope`` with its body's length declared (a chunked body was read whole already)."""
    headers = [h for h in scope["headers"] if h[0] not in (b"content-length", b"transfer-encoding")]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _replay(data: bytes) -> Receive:
    """A ``receive`` that hands ``data`` (the body already read) to the WSGI bridge at once."""
    pending = [data]

    async def receive() -> dict:
        return {"type": "http.request", "body": pending.pop() if pending else b"", "more_body": False}

    return receive


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
