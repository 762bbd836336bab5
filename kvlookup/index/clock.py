"""Redis server time, as every liveness judgement uses it (issue 20: clock skew changes nothing).

Leases, heartbeats, suspicion deadlines and retirements are written on one host and judged on
another; judged on each host's own wall clock, a sidecar 40 s behind never shows its instances
and one 60 s ahead reaps others. So every liveness time kvlookup writes or compares is Redis
server time: the scripts that decide (renewal, reaping) call ``TIME`` themselves, and a process
that needs "now" for a lookup or a view estimates it with :class:`ServerClock` (its own clock
plus the offset to Redis, measured with ``TIME`` every ``refresh_s``; error: half a round trip).

On Redis Cluster the time is the registry's master's (``TIME`` inside a script given a registry
key, so it is routed to that slot).

Leases and heartbeats are writes, so while Redis refuses writes (a full disk under the AOF:
``MISCONF``; ``maxmemory`` with ``noeviction``: ``OOM``) nobody can renew, and a lease that
lapses then is no evidence that its instance is gone (issue 20 item 11). Each measurement also
reads the lease clock's last renewal (keys.lease_clock_key); when renewals have stopped and a
write probe is refused, :meth:`ServerClock.lease_now_ms` judges liveness as of the last renewal
until writes work again: lookups keep answering from what is there.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from kvlookup.index import keys
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis

log = logging.getLogger(__name__)

#: ``{seconds, microseconds, last renewal}`` of the server that holds the registry slot (KEYS[1]
#: registry version, KEYS[2] lease clock; the renewal '' when none ran). ``no-writes``: it runs
#: while Redis refuses writes.
SERVER_TIME = """#!lua flags=no-writes
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGET', KEYS[2], 'tick') or ''}
"""
#: Renewals run every second at most (sidecars renew every min(1, TTL/3) s): a last renewal
#: older than this is a stop worth a write probe.
RENEWALS_STOPPED_MS = 1_500
#: Once writes work again, judging stays frozen this long (s): every sidecar renews within it
#: (they renew every second at most and retry a failed write within 1 s); a sidecar that died
#: while writes were refused then lapses as usual.
THAW_S = 3.0


def write_refusal(client) -> str | None:
    """Why Redis refuses a write now (one probe write, keys.health_probe_key): ``"OOM ..."``
    (``maxmemory`` with ``noeviction``), ``"MISCONF ..."`` (it cannot persist: a full disk),
    ``"READONLY ..."`` (a replica); None when the write is taken. Other errors (no connection)
    raise redis.RedisError."""
    try:
        client.set(keys.health_probe_key(), "1", px=10_000)
    except redis.ResponseError as exc:  # redis-py strips the OOM prefix (OutOfMemoryError)
        return ("OOM " if isinstance(exc, redis.exceptions.OutOfMemoryError) else "") + str(exc)
    return None


def writes_refused(client) -> bool:
    """Does Redis refuse a write now (:func:`write_refusal`)? No answer at all is not a refusal
    (False): that is an outage, which the lease clock judges. A refusal is logged."""
    try:
        refusal = write_refusal(client)
    except redis.RedisError:
        return False
    if refusal is not None:
        log.warning("Redis refuses writes (%s): liveness is judged as of the last lease renewal until it "
                    "writes again", refusal)
    return refusal is not None


class ServerClock:
    """``now()`` / ``now_ms()``: Redis server time (unix s / ms), estimated locally.

    client: a redis-py client (single or cluster). refresh_s: how often the offset to the
    server is measured again (one round trip). The first call measures it (raises
    redis.RedisError when Redis does not answer; under :data:`LOCAL_ONLY` it raises
    :class:`NeedsRedis` instead); later, a failed measurement keeps the last offset, and under
    ``LOCAL_ONLY`` it is measured in a background thread (the caller never waits on Redis).
    """

    def __init__(self, client, refresh_s: float = 1.0):
        self._client = client
        self._time = client.register_script(SERVER_TIME)
        self.refresh_s = refresh_s
        self.offset_s: float | None = None
        #: the last renewal (server ms) while renewals are stopped and writes refused, else None
        self.frozen_at_ms: int | None = None
        self._writes_back_at: float | None = None  # monotonic, while frozen after writes came back
        self._synced_at = float("-inf")
        self._refreshing = threading.Lock()

    def sync(self) -> float:
        """Measure the offset now (server minus local, seconds) and whether liveness is frozen
        (see the module docstring); raises redis.RedisError."""
        before = time.time()
        sec, usec, tick = self._time(keys=[keys.registry_version_key(), keys.lease_clock_key()])
        after = time.time()
        server_ms = int(sec) * 1000 + int(usec) // 1000
        self.offset_s = server_ms / 1000 - (before + after) / 2
        self._synced_at = time.monotonic()
        self._judge(int(tick) if tick and server_ms - int(tick) > RENEWALS_STOPPED_MS else None)
        return self.offset_s

    def _judge(self, stopped_at: int | None) -> None:
        """Freeze at the last renewal when renewals have stopped and a write is refused; thaw
        THAW_S after writes work again (a probe each measurement while frozen)."""
        if self.frozen_at_ms is None:
            if stopped_at is not None and writes_refused(self._client):
                self.frozen_at_ms = stopped_at
        elif writes_refused(self._client):
            self._writes_back_at = None
        elif self._writes_back_at is None:
            self._writes_back_at = time.monotonic()
        elif time.monotonic() - self._writes_back_at > THAW_S:
            self.frozen_at_ms = self._writes_back_at = None

    def lease_now_ms(self) -> int:
        """The time leases and heartbeats are judged at (unix ms): :meth:`now_ms`, or the last
        renewal while renewals are stopped because Redis refuses writes."""
        now = self.now_ms()
        return now if self.frozen_at_ms is None else min(now, self.frozen_at_ms)

    def now(self) -> float:
        """Server time, unix seconds."""
        if time.monotonic() - self._synced_at >= self.refresh_s:
            self._refresh()
        return time.time() + self.offset_s  # type: ignore[operator]

    def now_ms(self) -> int:
        """Server time, unix milliseconds."""
        return int(self.now() * 1000)

    def _refresh(self) -> None:
        if self.offset_s is None:
            if LOCAL_ONLY.get():
                raise NeedsRedis()
            self.sync()
        elif LOCAL_ONLY.get():
            if self._refreshing.acquire(blocking=False):
                threading.Thread(target=self._background, name="kvlookup-clock", daemon=True).start()
        else:
            self._try_sync()

    def _background(self) -> None:
        try:
            self._try_sync()
        finally:
            self._refreshing.release()

    def _try_sync(self) -> None:
        try:
            self.sync()
        except redis.RedisError as exc:  # keep the last offset: clocks do not drift in seconds
            self._synced_at = time.monotonic()
            log.debug("server clock not measured again: %s", exc)
