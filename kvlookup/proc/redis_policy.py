"""Redis settings kvlookup refuses to run on (issue 20: an eviction policy that can evict index keys).

With ``maxmemory-policy allkeys-*`` Redis deletes any key under memory pressure: records and
registry keys alike, so the index silently forgets instances and chunks (an attack with 3,000
random lookups left ``dbsize`` 0). ``noeviction`` (the default) and the ``volatile-*`` policies
only ever delete keys with a TTL (kvlookup's are eviction logs and sidecar status), so they are
accepted; under ``noeviction`` a full Redis refuses writes, which ``/health`` reports.
"""

from __future__ import annotations

import redis

#: Policies that may evict keys without a TTL.
EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def eviction_refusal(client) -> str | None:
    """One line saying why ``client``'s Redis must not hold the index, or None. Every master of a
    cluster is asked. A server that does not answer INFO is not refused here (/health reports it)."""
    try:
        info = client.info("memory")
    except redis.RedisError:
        return None
    nodes = info.values() if info and all(isinstance(v, dict) for v in info.values()) else [info]
    for node in nodes:
        policy = node.get("maxmemory_policy")
        if policy in EVICTING:
            return (f"Redis maxmemory-policy is {policy}, which can evict index keys (records and the registry); "
                    "set maxmemory-policy noeviction (or a volatile-* policy)")
    return None
