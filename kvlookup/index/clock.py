"""Redis server time, as every liveness judgement uses it (issue 20: clock skew changes nothing).

Leases, heartbeats, suspicion deadlines and retirements are written on one host and judged on
another; judged on each host's own wall clock, a sidecar 40 s behind never shows its instances
and one 60 s ahead reaps others. So every liveness time kvlookup writes or compares is Redis
server time: the scripts that decide (renewal, reaping) call ``TIME`` themselves, and a process
that needs "now" for a lookup or a view estimates it with :class:`ServerClock` (its own clock
plus the offset to Redis, measured with ``TIME`` every ``refresh_s``; error: half a round trip).

On Redis Cluster the time is the registry's master's (``TIME`` inside a script given a registry
key, so it is routed to that slot).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from kvlookup.index import keys
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis

log = logging.getLogger(__name__)

#: ``{seconds, microseconds}`` of the server that holds the registry slot.
SERVER_TIME = "return redis.call('TIME')"


class ServerClock:
    """``now()`` / ``now_ms()``: Redis server time (unix s / ms), estimated locally.

    client: a redis-py client (single or cluster). refresh_s: how often the offset to the
    server is measured again (one round trip). The first call measures it (raises
    redis.RedisError when Redis does not answer; under :data:`LOCAL_ONLY` it raises
    :class:`NeedsRedis` instead); later, a failed measurement keeps the last offset, and under
    ``LOCAL_ONLY`` it is measured in a background thread (the caller never waits on Redis).
    """

    def __init__(self, client, refresh_s: float = 5.0):
        self._time = client.register_script(SERVER_TIME)
        self.refresh_s = refresh_s
        self.offset_s: float | None = None
        self._synced_at = float("-inf")
        self._refreshing = threading.Lock()

    def sync(self) -> float:
        """Measure the offset now (server minus local, seconds); raises redis.RedisError."""
        before = time.time()
        sec, usec = self._time(keys=[keys.registry_version_key()])
        after = time.time()
        self.offset_s = int(sec) + int(usec) / 1e6 - (before + after) / 2
        self._synced_at = time.monotonic()
        return self.offset_s

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
