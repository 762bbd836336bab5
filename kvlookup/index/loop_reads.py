"""Reads sent from an asyncio event loop without blocking it (app.asgi: a fresh prompt's first miss).

A lookup is synchronous code (kvlookup.client -> kvlookup.index.staged) that calls ``execute(commands)``.
:func:`run_in_loop` runs it in a greenlet: where it reads by digest (kvlookup.index.single, under
:data:`LOOP_EXECUTE`) the greenlet hands the commands to the loop's coroutine, which sends them on
:class:`LoopRedis` (one asyncio connection a worker, commands packed and replies parsed by hiredis,
pipelined: many lookups' reads in flight on it at once) and switches back with the replies. The loop
serves other connections meanwhile, so one slow read stalls nobody but its own request.

Only a whole, error-free reply is handed back: an error reply (NOSCRIPT after a restart, a script
error), a broken or slow connection raise :class:`kvlookup.index.tracking.NeedsRedis` in the lookup,
and the caller asks again in a thread on the ordinary path, which loads scripts and reports errors
as it always did. :func:`loop_redis_for` says whether a client's connection can be opened here (one
plain Redis over TCP or a Unix socket, RESP2); a Sentinel master, TLS or a credential provider keep
the thread path (docs/architecture.md "A lookup").
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Callable, Sequence

import greenlet
import hiredis
import redis
from redis.exceptions import ResponseError

from kvlookup.index.tracking import NeedsRedis

#: Set (to a function) inside :func:`run_in_loop`'s greenlet: ``execute(commands) -> replies`` that
#: suspends the lookup until the loop has the replies (kvlookup.index.single reads by digest with it).
LOOP_EXECUTE: contextvars.ContextVar[Callable[[Sequence[tuple]], list] | None] = contextvars.ContextVar(
    "kvlookup_loop_execute", default=None)

#: The name each worker's connection has in ``CLIENT LIST``.
CLIENT_NAME = "kvlookup-loop-reads"
#: Replies must be back within this long (s) when the client sets no socket_timeout.
DEFAULT_TIMEOUT_S = 5.0


class LoopRedis:
    """A pipelined asyncio connection to a Redis server (use from one event loop at a time).

    where: ``("tcp", host, port)`` or ``("unix", path)``; hello: commands sent first on every
    connection (AUTH, SELECT, CLIENT SETNAME); timeout_s: the longest wait for a call's replies
    (then that connection is closed: replies would no longer line up). :meth:`execute`
    connects on first use, and again after a loss or in another loop."""

    def __init__(self, where: tuple, hello: Sequence[tuple] = (), timeout_s: float = DEFAULT_TIMEOUT_S):
        self.where, self.hello, self.timeout_s = where, list(hello), timeout_s
        self._pipe: _Pipe | None = None
        self._connecting: asyncio.Future | None = None

    async def execute(self, commands: Sequence[tuple]) -> list:
        """The replies of ``commands`` (one write); command errors as ResponseError values.
        Raises redis.ConnectionError (connection refused or lost), redis.TimeoutError."""
        pipe = self._pipe
        if pipe is None or pipe.closed or pipe.loop is not asyncio.get_running_loop():
            pipe = await self._connect()
        fut = pipe.send(commands)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fut
        except TimeoutError:
            pipe.drop(redis.TimeoutError("no reply from Redis in time"))
            raise redis.TimeoutError("no reply from Redis in time") from None

    async def _connect(self) -> _Pipe:
        loop = asyncio.get_running_loop()
        if self._connecting is None or self._connecting.get_loop() is not loop:
            self._connecting = loop.create_task(self._open(loop))
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Pipe:
        pipe = _Pipe(loop)
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.where[0] == "unix":
                    await loop.create_unix_connection(lambda: pipe, self.where[1])
                else:
                    await loop.create_connection(lambda: pipe, self.where[1], self.where[2])
                if self.hello:
                    for reply in await pipe.send(self.hello):
                        if isinstance(reply, Exception):
                            raise redis.ConnectionError(f"Redis refused the connection's setup: {reply}")
        except (OSError, TimeoutError, redis.ConnectionError) as exc:
            pipe.drop(redis.ConnectionError(str(exc)))
            raise redis.ConnectionError(f"cannot connect to Redis: {exc}") from None
        old, self._pipe = self._pipe, pipe
        if old is not None and not old.closed:
            old.drop(redis.ConnectionError("replaced"))
        return pipe


class _Pipe(asyncio.Protocol):
    """One connection of a :class:`LoopRedis`: calls in flight, replies parsed by hiredis."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.closed = False
        self._transport: asyncio.Transport | None = None
        self._reader = hiredis.Reader(encoding="utf-8", replyError=ResponseError)
        #: calls in flight, oldest first: [future, replies wanted, replies so far]
        self._pending: collections.deque[list] = collections.deque()

    def send(self, commands: Sequence[tuple]) -> asyncio.Future:
        """Write ``commands`` now; the future gets their replies."""
        fut = self.loop.create_future()
        if self.closed or self._transport is None:
            fut.set_exception(redis.ConnectionError("connection to Redis lost"))
            return fut
        self._pending.append([fut, len(commands), []])
        self._transport.write(b"".join([hiredis.pack_command(c) for c in commands]))
        return fut

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        reader, pending = self._reader, self._pending
        try:
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                call = pending[0]
                call[2].append(reply)
                if len(call[2]) == call[1]:
                    pending.popleft()
                    if not call[0].done():
                        call[0].set_result(call[2])
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.drop(redis.ConnectionError(f"bad reply from Redis: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        self._fail(redis.ConnectionError(f"connection to Redis lost: {exc}"))

    def drop(self, exc: Exception) -> None:
        """Close it now, failing every call in flight with ``exc``."""
        self.closed = True
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        while self._pending:
            fut = self._pending.popleft()[0]
            if not fut.done():
                fut.set_exception(exc)


def loop_redis_for(client: redis.Redis) -> LoopRedis | None:
    """A :class:`LoopRedis` to the server of ``client`` (a redis-py client, ``decode_responses``)
    with its password, username, db and socket_timeout; None where it does not apply: a Sentinel
    master (it moves: the pool finds it), TLS, RESP3, a credential provider."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    cls = pool.connection_class
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool) or kw.get("credential_provider") \
            or kw.get("protocol") not in (None, 2, "2") or not kw.get("decode_responses"):
        return None
    if cls is redis.UnixDomainSocketConnection:
        where: tuple = ("unix", kw["path"])
    elif cls is redis.Connection:
        where = ("tcp", kw.get("host", "localhost"), int(kw.get("port", 6379)))
    else:  # TLS, or a connection class of the caller's
        return None
    hello: list[tuple] = [("CLIENT", "SETNAME", CLIENT_NAME)]
    if kw.get("password") is not None:
        hello.append(("AUTH", *([kw["username"]] if kw.get("username") else []), kw["password"]))
    if int(kw.get("db") or 0):
        hello.append(("SELECT", int(kw["db"])))
    hello.append(hello.pop(0))  # named once authenticated
    return LoopRedis(where, hello, kw.get("socket_timeout") or DEFAULT_TIMEOUT_S)


async def run_in_loop(fn: Callable[[], object], conn: LoopRedis) -> object:
    """``fn()`` run in a greenlet of the calling coroutine, its :data:`LOOP_EXECUTE` reads sent on
    ``conn`` while the loop goes on; its answer, or what it raised. A read that fails (an error
    reply, the connection lost or too slow) raises NeedsRedis in ``fn``."""
    g = greenlet.greenlet(_in_green)
    g.gr_context = contextvars.copy_context()  # the caller's context vars (LOCAL_ONLY ...), its own copy
    try:
        msg = g.switch(fn)
        while not g.dead:
            try:
                got = await conn.execute(msg)
            except redis.RedisError:
                msg = g.throw(NeedsRedis())
                continue
            if any(isinstance(r, Exception) for r in got):
                msg = g.throw(NeedsRedis())
            else:
                msg = g.switch(got)
        return msg
    finally:
        if not g.dead:  # cancelled while it waited: unwind it here, not in a later garbage collection
            g.throw()


def _in_green(fn: Callable[[], object]) -> object:
    LOOP_EXECUTE.set(_switch_out)
    return fn()


def _switch_out(commands: Sequence[tuple]) -> list:
    parent = greenlet.getcurrent().parent
    assert parent is not None
    return parent.switch(list(commands))
