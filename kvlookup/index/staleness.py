"""Instances whose records may be missing ops: marked, shown, cleared (issue 20 item 5).

A sidecar that stops on purpose drains what it received and signs off (``Store.sign_off``
deletes its status hash). One killed (``kill -9``, the OOM killer, a host crash) leaves its
status hash behind, and the ops it had received but not written are gone. Started again, it
finds that hash (:func:`unclean_stop`) and, for every LMCache instance it owns, either the
engine heals it (a heartbeating 0.5-era worker is asked for a full sync at its next heartbeat)
or nothing will: so every such instance is marked *possibly stale* (:func:`mark`) until one of
its workers registers again or starts a full sync (:func:`clear`). Lookups still answer it (what
is there is most likely right); ``/lookup/explain`` and the dashboard say it may be stale and
why, so it is never silently wrong. vLLM instances heal by replay, so they are not marked.

Fields: keys.STALE_SINCE_FIELD / keys.STALE_REASON_FIELD of keys.instance_key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvlookup import kinds
from kvlookup.index import instances, keys


def unclean_stop(r, sidecar_id: str) -> dict | None:
    """The status a sidecar last published if it never signed off (it was killed), else None.
    Call before the sidecar publishes its own status."""
    status = r.hgetall(keys.sidecar_status_key(sidecar_id))
    return dict(status) if status else None


def mark(r, instance_ids: Iterable[str], since_ms: int, reason: str) -> list[str]:
    """Mark instances possibly stale (an instance already marked keeps its first mark);
    returns the ids marked now."""
    ids = sorted(instance_ids)
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for inst in ids:
        pipe.hsetnx(keys.instance_key(inst), keys.STALE_SINCE_FIELD, str(since_ms))
    fresh = [inst for inst, new in zip(ids, pipe.execute(), strict=True) if new]
    for inst in fresh:
        pipe.hset(keys.instance_key(inst), keys.STALE_REASON_FIELD, reason)
    pipe.execute()
    return fresh


def mark_unhealed(r, instance_ids: Iterable[str], since_ms: int, reason: str) -> list[str]:
    """:func:`mark` the instances whose kind does not heal by replay (``Kind.replays``)."""
    ids = sorted(instance_ids)
    unhealed = [i for i, f in zip(ids, instances.facts(r, ids), strict=True) if not kinds.of(f.kind).replays]
    return mark(r, unhealed, since_ms, reason)


def clear(r, instance_id: str) -> bool:
    """The instance's records are whole again (a worker re-registered or began a full sync);
    returns whether it was marked."""
    return bool(r.hdel(keys.instance_key(instance_id), keys.STALE_SINCE_FIELD, keys.STALE_REASON_FIELD))


def marks(r, instance_ids: Sequence[str]) -> dict[str, dict]:
    """``{instance_id: {"since_ms": int, "reason": str}}`` for the marked ones among ``instance_ids``."""
    if not instance_ids:
        return {}
    pipe = r.pipeline(transaction=False)
    for inst in instance_ids:
        pipe.hmget(keys.instance_key(inst), keys.STALE_SINCE_FIELD, keys.STALE_REASON_FIELD)
    return {inst: {"since_ms": int(since), "reason": reason or ""}
            for inst, (since, reason) in zip(instance_ids, pipe.execute(), strict=True) if since}
