"""Reads kept in the controller process and kept coherent by Redis (server-assisted client-side
caching: ``CLIENT TRACKING ... REDIRECT``).

A lookup reads the same keys again and again: the chunk sorted sets of a shared system prompt,
the registry version. :class:`CachedReads` answers ``ZRANGE`` of a chunk and ``GET`` of the
registry version from a process-local copy; every copy was read on a connection with tracking
on, so Redis sends the key's name to this process's invalidation connection
(``__redis__:invalidate``) as soon as anything changes it, and the copy is dropped. Each call
first takes every invalidation that has arrived, so a lookup never sees a key older than the
last change Redis had told about when the lookup began (on loopback that is microseconds after
the write). A copy read while an invalidation was being taken is not kept (it may be the old
value). If the invalidation connection breaks (Redis restarted, the connection dropped for
lagging), every copy goes and reads go to Redis, on connections without tracking, until it is
back: a lookup never fails for want of the cache. Redis keeps what a connection read only while
that connection lives: when it closes a tracked connection (``timeout``, ``CLIENT KILL``, an
output buffer limit) the keys it read are no longer watched. So each call looks, in one
``select`` (for a cluster, one for every master: :meth:`CachedReads.watched`), whether an idle
tracked connection was closed and whether the invalidation connection has something to read (it
is read only then, or after a fence), and every (re)connection of a tracked connection drops
every copy too. A hung or partitioned server closes nothing: copies are
trusted only while the invalidation connection answered a PING within :data:`LISTENER_TRUST_S`
(a cluster master frozen and failed over would otherwise keep answering from its copies).

Only plain commands are cached; everything else (RESOLVE, writes) passes through.
"""

from __future__ import annotations

import contextvars
import logging
import select
import threading
import time
from collections.abc import Sequence
from itertools import repeat
from typing import cast

import redis

from kvlookup.index import keys
from kvlookup.index.copies import MISS as _MISS
from kvlookup.index.copies import Copies
from kvlookup.index.io import SingleIO

log = logging.getLogger(__name__)

INVALIDATE = "__redis__:invalidate"
#: Commands whose replies are kept: ``(name, key)`` (``HGETALL``: an LMCache MP chunk bucket,
#: kept as a dict by kvlookup.index.mp_copies).
CACHED = ("ZRANGE", "GET", "HGETALL")
#: Chunk keys remembered as lacked once (NeedsRedis.first_miss), at most: ~7 MiB of key names;
#: all are forgotten when it is full (a hot prompt's chunk is then read by digest once more).
MISSED_MAX = 50_000
#: A broken invalidation connection is tried again after this long.
RECONNECT_S = 1.0

#: The longest wait for the rest of an invalidation message already arriving (seconds).
LISTENER_READ_S = 0.1
#: Unfenced, the invalidation connection is PINGed (without waiting) once it has been silent this
#: long (s), and copies are trusted only while it was heard from within :data:`LISTENER_TRUST_S`:
#: a hung or partitioned server (SIGSTOP, a cluster master failed over while frozen) closes no
#: socket, so silence is all there is to see. Past it a call waits for the PONG (at most
#: :data:`LISTENER_DEAD_S`, then the listener counts as lost); under LOCAL_ONLY it reads elsewhere.
LISTENER_PING_S = 0.5
LISTENER_TRUST_S = 1.0
LISTENER_DEAD_S = 1.0

#: Set (to True) where a read must not wait on Redis (app.asgi's event loop): a read that would
#: need a round trip raises :class:`NeedsRedis` instead, and the caller runs it elsewhere.
LOCAL_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("kvlookup_local_only", default=False)
#: Set (to True) for a lookup whose reads should bypass the copies and their tracking: one that
#: :class:`NeedsRedis` said ``first_miss`` for (kvlookup.index.single reads it by digest).
UNTRACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvlookup_untracked", default=False)


class NeedsRedis(Exception):
    """A read under :data:`LOCAL_ONLY` that only Redis can answer (nothing was sent).

    first_miss: every chunk set it lacked was missed for the first time (a fresh prompt's new
    chunk): probably never read again, so not worth a tracked read (see :data:`UNTRACKED`)."""

    first_miss = False


class MasterHung(redis.TimeoutError):
    """Raised by a :class:`CachedReads` made with ``hung_raises`` instead of reading plainly from a
    server that left a PING (or a tracked read) unanswered: a hung or partitioned master keeps its
    sockets open, so every read would wait out the socket timeout. A cluster caller reads the
    slot map again (a replica may have taken over) and sends the reads where it now points."""


class CachedReads:
    """A caching executor of commands for one Redis (see the module docstring).

    client: the redis-py client whose connection settings to use. max_keys: copies kept
    (kvlookup.index.copies: scan-resistant LRU; a chunk nobody holds is kept only once it was
    lacked or read empty before, so fresh prompts do not fill it: :meth:`_lacked_again`). fence:
    before each call, take every invalidation Redis has queued for this process (a PING on the
    invalidation connection, answered after them): a lookup then sees every write that
    completed before it began, at the cost of that round trip. shared:
    as :class:`kvlookup.index.copies.Copies` (one dict for every master of a cluster). Thread-
    and greenlet-safe.
    """

    def __init__(self, client: redis.Redis, max_keys: int = 200_000, fence: bool = False,
                 shared: dict | None = None, copies: Copies | None = None, hung_raises: bool = False):
        self.max_keys = max_keys
        self.fence = fence
        self.hung_raises = hung_raises
        self.hung = False  # the server left a round trip unanswered; cleared by a reconnection
        # RESP2: invalidations arrive as pub/sub messages on the listener (RESP3 pushes them in-band)
        kwargs = {**client.connection_pool.connection_kwargs, "protocol": 2}
        for resp3_only in ("redis_connect_func", "maint_notifications_config", "event_dispatcher"):
            kwargs.pop(resp3_only, None)
        self._kwargs = kwargs
        # the client's own kind of connection: TCP, TLS, a unix socket, or Sentinel-managed (it asks
        # the Sentinels where the master is on every connect, so a failover moves the listener too)
        self._connection_class = client.connection_pool.connection_class
        self._lock = threading.Lock()
        self._copies = Copies(max_keys, shared) if copies is None else copies
        self._missed: dict[str, None] = {}  # chunk keys a LOCAL_ONLY read lacked (first_miss)
        self._listener: redis.Connection | None = None
        self._gen = 0  # invalidation messages taken so far
        self._inv_at: dict[str, int] = {}  # key -> the message that last invalidated it
        self._floor = 0  # a read that began before this message may be stale (flush, pruning)
        self._retry_at = 0.0
        self._heard = 0.0  # when the listener last answered (monotonic s)
        self._buffered = False  # a message may wait in the listener's read buffer (its socket quiet)
        self._pings = 0  # PINGs sent on it whose PONG has not been read
        self.tracked = redis.Redis(connection_pool=redis.BlockingConnectionPool(
            connection_class=self._connection_class, max_connections=16, timeout=5,
            redis_connect_func=self._track, **kwargs))
        self.io = SingleIO(self.tracked)
        self.plain = SingleIO(client)  # reads while caching is off: no REDIRECT to a gone listener
        #: hits/misses: reads answered from copies / sent; kept: whole lookups vouched for by :meth:`unchanged`
        self.stats = {"hits": 0, "misses": 0, "invalidations": 0, "resets": 0, "kept": 0}
        self._plain_reads = 0  # reads sent untracked (caching off): no invalidation will tell of them

    def register(self, script: str) -> str:
        """A Lua script's sha for ``("EVALSHA", sha, ...)`` through :meth:`execute`."""
        self.plain.register(script)
        return self.io.register(script)

    # -- the invalidation connection ------------------------------------------------------

    def _connect_listener(self) -> bool:
        conn = self._connection_class(**self._kwargs)
        try:
            conn.connect()
            bound_tracking_table(conn, self.max_keys)
            conn.send_command("CLIENT", "ID")
            self._listener_id = int(conn.read_response())
            self._listener_run = _run_id(conn)
            conn.send_command("SUBSCRIBE", INVALIDATE)
            conn.read_response()
        except (redis.RedisError, OSError) as exc:
            conn.disconnect()
            log.debug("client-side caching off for now: %s", exc)
            self._unanswered(exc)
            return False
        self._listener = conn
        self.hung = False
        self._heard, self._pings, self._buffered = time.monotonic(), 0, False
        self._disconnect_tracked()  # every tracked connection must redirect here
        return True

    def _track(self, conn) -> None:
        conn.on_connect()
        if self._listener is None or _run_id(conn) != self._listener_run:
            # a restarted server: the listener's id may now name another client of it
            raise redis.ConnectionError("the invalidation connection is not on this server")
        if getattr(conn, "_kvl_tracked", False):  # a reconnection: what the old one read is unwatched
            with self._lock:
                self._reset("a tracked connection reconnected")
        conn._kvl_tracked = True
        # OPTIN: only the reads sent after CLIENT CACHING YES are tracked (not RESOLVE's)
        conn.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", self._listener_id, "OPTIN")
        if conn.read_response() not in (b"OK", "OK"):
            raise redis.ConnectionError("CLIENT TRACKING was refused")

    def close(self) -> None:
        """Drop every copy and disconnect the invalidation and tracked connections for good (a
        gone cluster master's copies: kvlookup.index.cluster_cache); a call after it reads
        plainly (caching off, never reconnected)."""
        with self._lock:
            self._retry_at = float("inf")
            if self._listener is not None:
                self._listener.disconnect()
                self._listener = None
            self._reset("closed")
            self._disconnect_tracked()

    def _reset(self, why: str) -> None:
        if self._copies:
            log.info("client-side cache dropped (%s)", why)
        self._copies.clear()
        self._gen += 1
        self._floor = self._gen
        self._inv_at.clear()
        self.stats["resets"] += 1

    def _disconnect_tracked(self) -> None:
        """Disconnect every tracked connection after the copies were dropped (so their next
        connection is a fresh start, not a loss)."""
        pool = self._tracked_pool()
        pool.disconnect()
        for c in list(pool._connections):
            c._kvl_tracked = False

    def _tracked_pool(self) -> redis.BlockingConnectionPool:
        # redis-py types Redis.connection_pool as ConnectionPool; __init__ gave it a BlockingConnectionPool
        return cast(redis.BlockingConnectionPool, self.tracked.connection_pool)

    def watched(self) -> list:
        """The sockets a call looks at, in one ``select``, before it reads copies: the invalidation
        connection's (readable: invalidations or a PONG arrived) and every idle tracked
        connection's (readable: the server closed it); [] without an invalidation connection. A
        caller that selects over several CachedReads at once (kvlookup.index.cluster_cache: one
        ``select`` a lookup for every master) passes what was readable to :meth:`execute`."""
        listener = self._listener
        if listener is None or listener._sock is None:
            return []
        return [listener._sock, *[c._sock for c in list(self._tracked_pool().pool.queue)
                                  if c is not None and c._sock is not None]]

    def _readable(self) -> set:
        socks = self.watched()
        if not socks:
            return set()
        try:
            return set(select.select(socks, [], [], 0)[0])
        except (OSError, ValueError):  # a socket closed under us: look at each
            return set(socks)

    def _tracked_lost(self, readable: set) -> bool:
        """Was an idle tracked connection closed by the server (its socket in ``readable``: EOF)?
        It is dropped."""
        lost = [c for c in list(self._tracked_pool().pool.queue)
                if c is not None and c._sock is not None and c._sock in readable]
        for c in lost:
            c.disconnect()
            c._kvl_tracked = False  # the caller drops every copy
        return bool(lost)

    def _drain(self, readable: set | None = None) -> bool:
        """Take every invalidation that arrived; False when caching is off (no listener).
        readable: the sockets of :meth:`watched` found readable by the caller's ``select`` (None:
        select here); the invalidation connection is read only when its socket was readable or
        a message may wait in its buffer (a fence stops reading at its PONG)."""
        if self._listener is not None:
            if readable is None:
                readable = self._readable()
            if readable and self._tracked_lost(readable):
                self._reset("a tracked connection was closed")
        if self._listener is None:
            if LOCAL_ONLY.get() or time.monotonic() < self._retry_at:  # (reconnecting waits on Redis)
                return False
            self._reset("no invalidation connection")
            if not self._connect_listener():
                self._retry_at = time.monotonic() + RECONNECT_S
                return False
        assert self._listener is not None  # it was there, or _connect_listener just made it
        silent = time.monotonic() - self._heard
        fence = self.fence or silent > LISTENER_TRUST_S
        if fence and not self.fence and LOCAL_ONLY.get():
            return False  # a round trip is due first (LISTENER_TRUST_S): not here
        waiting = readable is None or self._buffered or self._listener._sock in readable
        try:
            if fence or (silent > LISTENER_PING_S and not self._pings):
                self._listener.send_command("PING")
                self._pings += 1
            while fence or (waiting and self._listener.can_read(timeout=0)):
                # readable: the rest of a message is due at once; a server that stalls mid-message
                # (hung, SIGSTOP) drops the listener instead of holding the lock (and app.asgi's loop)
                msg = self._listener.read_response(
                    **({} if self.fence else {"timeout": LISTENER_DEAD_S if fence else LISTENER_READ_S}))
                if msg is None and fence:  # no PONG in time: a hung server
                    raise redis.TimeoutError("the invalidation connection did not answer PING")
                self._heard = time.monotonic()
                if isinstance(msg, list) and len(msg) == 3 and msg[0] in ("message", b"message"):
                    self._invalidate(msg[2])
                elif isinstance(msg, list) and msg and msg[0] in ("pong", b"pong"):
                    self._pings = max(0, self._pings - 1)
                    if fence and not self._pings:
                        self._buffered = True  # what came after the PONG may be read already
                        break  # every invalidation queued before the PING is taken
            else:
                self._buffered = False
        except (redis.RedisError, OSError) as exc:
            self._listener.disconnect()
            self._listener = None
            self._reset(f"invalidation connection lost: {exc}")
            self._unanswered(exc)
            return False
        return True

    def _unanswered(self, exc: Exception) -> None:
        """After a failed round trip: a timeout means a hung server (no EOF, so a reconnection
        would wait out the connect timeout too): reconnect no sooner than :data:`RECONNECT_S`."""
        if isinstance(exc, (redis.TimeoutError, TimeoutError)):
            self.hung = True
            self._retry_at = time.monotonic() + RECONNECT_S

    def _hung_check(self) -> None:
        if self.hung and self.hung_raises:
            raise MasterHung("the server left a round trip unanswered")

    def _take_arrived(self) -> bool:
        fence, self.fence = self.fence, False  # what arrived is enough here: no second fence
        try:
            return self._drain()
        finally:
            self.fence = fence

    def _invalidate(self, names) -> None:
        self._gen += 1
        self.stats["invalidations"] += 1
        if names is None or len(self._inv_at) > self.max_keys:  # FLUSHALL, a tracking table overflow
            self._copies.clear()
            self._inv_at.clear()
            self._floor = self._gen
            return
        for name in names:
            name = name.decode() if isinstance(name, bytes) else name
            self._inv_at[name] = self._gen
            for cmd in CACHED:
                self._copies.pop((cmd, name))

    def _fresh(self, key: str, since: int) -> bool:
        """No invalidation of ``key`` was taken after message ``since`` (when its read began)."""
        return self._floor <= since and self._inv_at.get(key, -1) <= since

    def local_now(self) -> bool:
        """Are reads answered from copies now (unfenced, the invalidation connection up)?"""
        return not self.fence and self._listener is not None

    # -- what changed since --------------------------------------------------------------

    def since(self) -> tuple[int, int]:
        """A mark for :meth:`unchanged`: taken before the reads it covers."""
        return self._gen, self._plain_reads

    def unchanged(self, names: Sequence[str], mark: tuple[int, int], readable: set | None = None) -> bool:
        """Is no key of ``names`` (each read through :meth:`execute` after ``mark`` was taken)
        known to have changed since? Takes every invalidation that has arrived first (with
        ``fence``, every one queued: a round trip). False, never a wrong True, when caching is
        off or was off meanwhile, a copy reset happened, or (under LOCAL_ONLY) the lock is busy.
        readable: as :meth:`execute`."""
        gen, plain = mark
        if not self._lock.acquire(blocking=not LOCAL_ONLY.get()):
            return False
        try:
            if not self._drain(readable) or self._floor > gen or self._plain_reads != plain:
                return False
            if self._gen != gen and max(map(self._inv_at.get, names, repeat(-1)), default=-1) > gen:
                return False
            self.stats["kept"] += 1
            return True
        finally:
            self._lock.release()

    # -- reads ------------------------------------------------------------------------------

    def execute(self, commands: Sequence[tuple], readable: set | None = None) -> list:
        """Results of ``commands`` in order, from copies where they are kept (a round trip only
        for the rest); errors as SingleIO.execute. Under :data:`LOCAL_ONLY` it never waits: not on
        Redis, not on another thread holding the copies (which may be waiting on Redis).
        readable: what the caller's ``select`` over :meth:`watched` found readable, just before
        (None: this call selects)."""
        local = LOCAL_ONLY.get()
        if not self._lock.acquire(blocking=not local):
            raise NeedsRedis()
        try:
            caching = self._drain(readable)
            gen = self._gen
            if caching or local:  # local and not caching: the copies still say which misses are first ones
                out = self._copies.get_many([(c[0], c[1]) if cacheable(c) else NOT_KEPT for c in commands])
                missing = [i for i, copy in enumerate(out) if copy is _MISS]
            else:
                out, missing = [None] * len(commands), list(range(len(commands)))
            if local and (missing or not caching):
                raise self._needs_redis(commands, missing)
            self.stats["hits"] += len(commands) - len(missing)
            self.stats["misses"] += len(missing)
        finally:
            self._lock.release()
        if not missing:
            return out
        sent, where = [], []
        for i in missing:
            if caching and cacheable(commands[i]):
                sent.append(("CLIENT", "CACHING", "YES"))  # track this read (OPTIN)
            sent.append(commands[i])
            where.append(len(sent) - 1)
        got = self._send(sent) if caching else None
        if got is None:  # caching is off, or the tracked connection failed: read plainly
            self._hung_check()
            self._plain_reads += 1
            return self._fill(out, missing, self.plain.execute([commands[i] for i in missing]))
        with self._lock:
            keep = self._take_arrived()
            for i, j in zip(missing, where, strict=True):
                res, cmd = got[j], commands[i]
                if cacheable(cmd) and not isinstance(res, Exception):
                    res = as_fields(res) if cmd[0] == "HGETALL" else self._copies.share(res)
                    empty_kept = not res and cmd[0] == "ZRANGE" and self._lacked_again(cmd[1])
                    if keep and self._fresh(cmd[1], gen) and (res or cmd[0] != "ZRANGE" or empty_kept):
                        self._copies.put((cmd[0], cmd[1]), res)
                out[i] = res
        return out

    def whole_hashes(self, names: Sequence[str], script: str, readable: set | None = None) -> list:
        """``HGETALL`` of each hash ``names`` (cacheable ones: kvlookup.index.mp_copies' buckets), as
        dicts: from copies where kept, the rest in one tracked call of ``script`` (Lua returning
        ``HGETALL`` of each of its KEYS, in order: one reply to parse, not one a hash) and kept.
        Under LOCAL_ONLY, NeedsRedis when one is not kept (nothing sent). Errors raised (a command
        error as its ResponseError, a lost server as redis.ConnectionError). readable: as
        :meth:`execute`."""
        local = LOCAL_ONLY.get()
        if not self._lock.acquire(blocking=not local):
            raise NeedsRedis()
        try:
            caching = self._drain(readable)
            gen = self._gen
            out = self._copies.get_many([("HGETALL", k) for k in names]) if caching or local else [_MISS] * len(names)
            missing = [i for i, copy in enumerate(out) if copy is _MISS]
            if local and (missing or not caching):
                raise NeedsRedis()
            self.stats["hits"] += len(names) - len(missing)
            self.stats["misses"] += len(missing)
        finally:
            self._lock.release()
        if not missing:
            return out
        want = [names[i] for i in missing]
        # EVAL, not EVALSHA: a NOSCRIPT answer would be sent again without CLIENT CACHING YES
        # (SingleIO), reading untracked; Redis caches the script by its sha either way
        call = ("EVAL", script, len(want), *want)
        got = self._send([("CLIENT", "CACHING", "YES"), call]) if caching else None
        if got is None:  # caching is off, or the tracked connection failed: read plainly
            self._hung_check()
            self._plain_reads += 1
            return self._fill(out, missing, [as_fields(v) for v in _raised(self.plain.execute([call]))[0]])
        replies = _raised(got)[1]
        with self._lock:
            keep = self._take_arrived()
            for i, name, reply in zip(missing, want, replies, strict=True):
                out[i] = fields = as_fields(reply)
                if keep and self._fresh(name, gen):
                    self._copies.put(("HGETALL", name), fields)
        return out

    def peek(self, reads: list[tuple[str, str]], readable: set | None = None) -> list:
        """The copy of each of ``reads`` (``(command name, key)`` of :func:`cacheable` reads:
        ``("ZRANGE", chunk key)``, ``("GET", key)``), or :data:`kvlookup.index.copies.MISS` where
        none is kept (every one while caching is off). Sends nothing and tracks nothing: a lookup
        read by digest (a fresh prompt's first miss, :data:`UNTRACKED`) takes the chunks it can
        from here and reads only the rest. Every invalidation that arrived is taken first, as
        :meth:`execute` does. Under :data:`LOCAL_ONLY` a busy lock gives every MISS. readable:
        as :meth:`execute`."""
        if not self._lock.acquire(blocking=not LOCAL_ONLY.get()):
            return [_MISS] * len(reads)
        try:
            if not self._drain(readable):
                return [_MISS] * len(reads)
            out = self._copies.peek_many(reads)
            self.stats["hits"] += len(out) - out.count(_MISS)  # (count: identity first, in C)
            return out
        finally:
            self._lock.release()

    def _needs_redis(self, commands: Sequence[tuple], missing: list[int]) -> NeedsRedis:
        """The NeedsRedis for a LOCAL_ONLY read lacking ``missing``: ``first_miss`` when none of
        the chunk sets lacked was lacked before (each is remembered, :data:`MISSED_MAX` at most)."""
        exc = NeedsRedis()
        lacked = [commands[i][1] for i in missing if commands[i][0] == "ZRANGE"]
        seen = self._missed
        exc.first_miss = bool(lacked) and not any(k in seen for k in lacked)
        if len(seen) + len(lacked) > min(self.max_keys, MISSED_MAX):
            seen.clear()
        seen.update(dict.fromkeys(lacked))
        return exc

    def _lacked_again(self, key: str) -> bool:
        """Was chunk ``key``, just read empty (tracked), lacked or read empty before? Then its empty
        copy is kept (a chunk nobody holds that lookups keep asking for: the LMCache chain of a
        vLLM-only fleet, a shared prefix's first unheld chunk), so it costs no read until Redis
        says it changed; a key read empty once is only remembered (the lacked keys,
        :data:`MISSED_MAX` at most), so a stream of fresh prompts keeps no empty copies."""
        seen = self._missed
        if key in seen:
            return True
        if len(seen) >= min(self.max_keys, MISSED_MAX):
            seen.clear()
        seen[key] = None
        return False

    def _send(self, sent: list) -> list | None:
        """``sent`` on a tracked connection; None when that fails (a reconnect whose REDIRECT
        names a listener of a Redis that restarted): caching goes off until the listener is back."""
        try:
            return self.io.execute(sent)
        except redis.RedisError as exc:
            with self._lock:
                if self._listener is not None:
                    self._listener.disconnect()
                    self._listener = None
                self._reset(f"tracked read failed: {exc}")
                self._retry_at = 0.0
                self._unanswered(exc)
                self._disconnect_tracked()
            return None

    @staticmethod
    def _fill(out: list, missing: list[int], got: list) -> list:
        for i, res in zip(missing, got, strict=True):
            out[i] = res
        return out


def _raised(results: list) -> list:
    for res in results:
        if isinstance(res, Exception):
            raise res
    return results


def _run_id(conn) -> str:
    """The server process's run_id (a restarted server has a new one)."""
    conn.send_command("INFO", "server")
    info = conn.read_response()
    info = info.decode() if isinstance(info, bytes) else info
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("run_id:")), "")


_VERSION_KEY = keys.registry_version_key()
#: The copy key of a command that is never kept (no copy has it).
NOT_KEPT = ("", "")


_MP_CHUNKS = keys.mp_chunks_prefix()


def cacheable(cmd: tuple) -> bool:
    """Is ``cmd`` a read whose reply is kept (a chunk set's ``ZRANGE``, the registry version's
    ``GET``, an LMCache MP chunk bucket's ``HGETALL``)?"""
    return cmd[0] == "ZRANGE" or (cmd[0] == "GET" and cmd[1] == _VERSION_KEY) \
        or (cmd[0] == "HGETALL" and cmd[1].startswith(_MP_CHUNKS))


def as_fields(reply) -> dict:
    """An ``HGETALL`` reply (RESP2: a flat list of field, value; already a dict: unchanged) as a dict."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[0::2], reply[1::2], strict=True))


def bound_tracking_table(conn, max_keys: int) -> None:
    """Make Redis keep at most ``max_keys`` keys in its tracking table (``tracking-table-max-keys``:
    valkey's default is 1,000,000, ~160 MiB; 0 is unlimited): every lookup of a new prompt tracks
    the chunk keys it read, which grew Redis by ~60 MiB per 3,000 random lookups (issue 20).
    Past the bound Redis invalidates the oldest tracked keys (their copies here go). A server
    that refuses CONFIG raises redis.ConnectionError: caching stays off there (reads go to Redis)."""
    conn.send_command("CONFIG", "GET", "tracking-table-max-keys")
    got = conn.read_response()
    values = dict(zip(got[0::2], got[1::2], strict=True)) if isinstance(got, list) else dict(got or {})
    current = int(next(iter(values.values()), 0) or 0)
    if 0 < current <= max_keys:
        return
    conn.send_command("CONFIG", "SET", "tracking-table-max-keys", str(max_keys))
    reply = conn.read_response()
    if isinstance(reply, Exception) or reply not in (b"OK", "OK"):
        raise redis.ConnectionError(f"cannot bound the tracking table: {reply}")
