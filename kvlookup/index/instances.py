"""Facts of registered instances that readers outside the registry need, in pipelined round
trips: each instance's kind and owning sidecar with its liveness lease (the dashboard), the
model a discovered vLLM server serves (lookups naming a ``model_name``), and the prefix chains
of the registered vLLM ranks (the chains a lookup walks).

Keys: ``keys.instance_key`` (fields ``kind``, ``model``), ``keys.owners_key``,
``keys.alive_key``, ``keys.block_sizes_key``. Errors: redis.RedisError passes through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from kvlookup.index import keys


@dataclass(frozen=True)
class InstanceFacts:
    """kind: the instance hash's ``kind`` (None when unset); owner: the id of the sidecar that
    ingests it (None: none); lease_ms: its liveness lease expiry (Redis server time, unix ms;
    None: no lease)."""

    kind: str | None
    owner: str | None
    lease_ms: float | None


def facts(r, instance_ids: Sequence[str]) -> list[InstanceFacts]:
    """The :class:`InstanceFacts` of each instance, in order: two round trips (none for no ids)."""
    if not instance_ids:
        return []
    pipe = r.pipeline(transaction=False)
    for inst in instance_ids:
        pipe.hget(keys.instance_key(inst), "kind")
        pipe.hget(keys.owners_key(), inst)
    got = pipe.execute()
    leases = r.zmscore(keys.alive_key(), list(instance_ids))
    return [InstanceFacts(got[2 * i], got[2 * i + 1], leases[i]) for i in range(len(instance_ids))]


def models(r, instance_ids: Sequence[str]) -> list[str | None]:
    """The ``model`` each instance serves (a discovered vLLM server), None where it names none;
    one pipelined round trip."""
    pipe = r.pipeline(transaction=False)
    for inst in instance_ids:
        pipe.hget(keys.instance_key(inst), "model")
    return pipe.execute() if instance_ids else []


def vllm_chains(r, live_at_ms: Callable[[], int] | None = None) -> list[tuple[int, int]]:
    """The distinct (block size, lookahead) prefix chains of every registered vLLM rank, sorted;
    with ``live_at_ms`` (the lease clock, ``ServerClock.lease_now_ms``: unix ms), only those of instances whose
    liveness lease has not expired then (the clock is read only when some rank is registered)."""
    # "<rank>\t<instance>" -> "16,256,16+1"; str: redis-py's types cannot follow decode_responses=True
    per_rank = cast(dict[str, str], r.hgetall(keys.block_sizes_key()))
    if live_at_ms is not None and per_rank:
        insts = sorted({m.split(keys.SEP, 1)[1] for m in per_rank})
        now_ms = live_at_ms()
        live = {i for i, s in zip(insts, r.zmscore(keys.alive_key(), insts), strict=True)
                if s is not None and s >= now_ms}
        per_rank = {m: bs for m, bs in per_rank.items() if m.split(keys.SEP, 1)[1] in live}
    return sorted({c for text in per_rank.values() for c in keys.parse_vllm_chains(str(text))})
