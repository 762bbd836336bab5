"""The controller's own keys: the outcome of each control call (``keys.event_key``, read back
by ``/check_finish``) and the write probe of ``/health`` (``keys.health_probe_key``).

Errors: redis.RedisError (and its ResponseError refusals: OOM, MISCONF) pass through.
"""

from __future__ import annotations

import json

from kvlookup.index import keys

#: How long the write probe lives (ms): each /health writes it again.
PROBE_TTL_MS = 10_000


def record_event(r, event_id: str, status: str, ttl_s: int) -> None:
    """Keep a control call's outcome (``"finished"`` | ``"failed"``) for ``ttl_s`` seconds."""
    r.set(keys.event_key(event_id), json.dumps({"status": status}), ex=ttl_s)


def event_status(r, event_id: str) -> str | None:
    """The outcome :func:`record_event` kept for ``event_id``; None when unknown or expired."""
    raw = r.get(keys.event_key(event_id))
    return None if raw is None else json.loads(raw)["status"]


def probe_write(r) -> None:
    """Write the health probe key (TTL :data:`PROBE_TTL_MS`): raises what Redis answers to a
    refused write (OOM under ``maxmemory``, MISCONF on a full disk)."""
    r.set(keys.health_probe_key(), "1", px=PROBE_TTL_MS)
