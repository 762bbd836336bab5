"""The outcome of each control call the controller answers (``keys.event_key``), read back by
``/check_finish``. Errors: redis.RedisError passes through.
"""

from __future__ import annotations

import json

from kvlookup.index import keys


def record_event(r, event_id: str, status: str, ttl_s: int) -> None:
    """Keep a control call's outcome (``"finished"`` | ``"failed"``) for ``ttl_s`` seconds."""
    r.set(keys.event_key(event_id), json.dumps({"status": status}), ex=ttl_s)


def event_status(r, event_id: str) -> str | None:
    """The outcome :func:`record_event` kept for ``event_id``; None when unknown or expired."""
    raw = r.get(keys.event_key(event_id))
    return None if raw is None else json.loads(raw)["status"]

