"""Instance kinds: what kind of engine an instance is, and what that implies, in one table.

An instance's kind is written at registration (the ``kind`` field of ``keys.instance_key``).
Every decision that depends on it reads this table, never a string comparison, so a new kind
(LMCache MP servers, say) is one row here. An unknown or missing kind fails closed: not probed,
no control calls.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how a chunk counts across an instance's workers: held by every registered rank (LMCache TP
#: ranks: one group per instance) or by any one of them (vLLM DP ranks: one group per rank).
RULE_ALL, RULE_ANY = "all", "any"


@dataclass(frozen=True)
class Kind:
    """name: the registry's ``kind`` value. probed: a sidecar asks its workers' control ports
    for evidence of life when their connections close. control: it takes LMCache control calls
    (``/clear``, ``/pin``, ``POST /health``, ...). worker_rule: RULE_ALL or RULE_ANY.
    replays: what a killed sidecar missed comes back by the engine's replay (vLLM's replay
    endpoint, or a clear when it has none); otherwise its instances are marked possibly stale
    (kvlookup.index.staleness)."""

    name: str
    probed: bool
    control: bool
    worker_rule: str
    replays: bool


LMCACHE = Kind("lmcache", probed=True, control=True, worker_rule=RULE_ALL, replays=False)
VLLM = Kind("vllm", probed=False, control=False, worker_rule=RULE_ANY, replays=True)
#: a kind this build does not know (written by a newer kvlookup): nothing is assumed
UNKNOWN = Kind("unknown", probed=False, control=False, worker_rule=RULE_ALL, replays=False)
KINDS = {k.name: k for k in (LMCACHE, VLLM)}


def of(name: str | None) -> Kind:
    """The Kind registered as ``name``; an instance registered before kinds existed (no field)
    is LMCache's; an unknown name is :data:`UNKNOWN`."""
    if name is None or name == "":
        return LMCACHE
    return KINDS.get(name, UNKNOWN)
