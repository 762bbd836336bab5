"""Every Redis key kvlookup reads or writes, built in this one module.

The schema is a persisted public API: the prefix carries its version (``kvl:v1:``) so a
future layout can live beside this one. docs/redis-schema.md lists each key with its type,
writer, reader and lifetime; tests/test_keys.py pins the exact strings.

Lua scripts never invent key names: they receive full keys through KEYS, or (for keys found
while walking, such as holder hashes) a prefix from this module through ARGV.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
PREFIX = f"kvl:v{SCHEMA_VERSION}:"

#: Prefix of per-chunk sorted sets; the full key is ``PREFIX + "chunk:" + [space ":"] + hash``.
CHUNK_PREFIX = PREFIX + "chunk:"
#: Prefix of holder hashes (``holder:<id>``) and their reverse-index sets (``holder:<id>:chunks``).
HOLDER_PREFIX = PREFIX + "holder:"
#: Prefix of worker hashes (``worker:<instance_id>:<worker_id>``).
WORKER_PREFIX = PREFIX + "worker:"
#: Prefix of instance hashes and their companion keys (``instance:<instance_id>[:facet]``).
INSTANCE_PREFIX = PREFIX + "instance:"


def key_name(instance_id: str) -> str:
    """An instance_id as it appears inside keys: ``%`` and ``:`` percent-encoded.

    Keys put facets after the instance id (``instance:<id>:workers``), so an id such as
    ``a:workers`` must not read as instance ``a``'s facet. Ids without ``%`` or ``:`` (the usual
    case) appear unchanged.
    """
    return instance_id.replace("%", "%25").replace(":", "%3A")


def chunk_prefix(space: str = "") -> str:
    """Prefix of chunk keys in one hash space.

    space: "" for LMCache chunk hashes (the engines' own keys); a short tag such as
    ``"v16"`` for hash chains kvlookup computes itself (vLLM blocks of 16 tokens).
    """
    return CHUNK_PREFIX + (f"{space}:" if space else "")


def chunk_key(chunk_hash: int | str, space: str = "") -> str:
    """Sorted set of the holders of one chunk: member holder id, score admit time (unix ms)."""
    return f"{chunk_prefix(space)}{chunk_hash}"


def holder_key(holder_id: int | str) -> str:
    """Hash describing one holder: instance, worker, location, space, dead flag."""
    return f"{HOLDER_PREFIX}{holder_id}"


#: Buckets of a holder's reverse index. Each bucket is a small set of integer chunk hashes,
#: which Redis stores as an intset (8 bytes a member) while it holds at most
#: ``set-max-intset-entries`` members (512 by default; the embedded server allows 4096). So a
#: holder keeps about 1M records (8M embedded) at ~8 bytes each instead of ~50 in one big set.
HOLDER_CHUNK_BUCKETS = 2048


def chunk_bucket(chunk_hash: int | str) -> int:
    """Reverse-index bucket of a chunk hash, from the last 4 bytes of its decimal (or hex) text.

    Must equal the Lua in kvlookup.scripts (``bucket()``); tests check both agree.
    """
    tail = str(chunk_hash).encode()[-4:].rjust(4, b"\0")
    return (tail[0] * 1000003 + tail[1] * 1009 + tail[2] * 31 + tail[3]) % HOLDER_CHUNK_BUCKETS


def holder_chunks_key(holder_id: int | str, bucket: int) -> str:
    """Set of the chunk hashes of one holder in one bucket (reverse index; purge never scans)."""
    return f"{HOLDER_PREFIX}{holder_id}:chunks:{bucket}"


def holder_seq_key() -> str:
    """Counter that allocates holder ids (INCR)."""
    return PREFIX + "holders:seq"


def dead_holders_key() -> str:
    """Set of retired holder ids whose records still wait to be purged."""
    return PREFIX + "holders:dead"


def instances_key() -> str:
    """Set of every known instance_id."""
    return PREFIX + "instances"


def instance_key(instance_id: str) -> str:
    """Hash of instance facts: kind (lmcache|vllm), worker_rule (all|any), block_size."""
    return f"{INSTANCE_PREFIX}{key_name(instance_id)}"


def instance_workers_key(instance_id: str) -> str:
    """Set of the registered worker ids (TP ranks, or DP ranks for vLLM) of one instance."""
    return f"{INSTANCE_PREFIX}{key_name(instance_id)}:workers"


def instance_alive_key(instance_id: str) -> str:
    """String with a TTL, refreshed by the instance's sidecar; absent means the instance is silent."""
    return f"{INSTANCE_PREFIX}{key_name(instance_id)}:alive"


def worker_key(instance_id: str, worker_id: int | str) -> str:
    """Hash of one worker: ip, port, peer_init_url, registered_at, last_heartbeat, epoch, loc:<location>."""
    return f"{WORKER_PREFIX}{key_name(instance_id)}:{worker_id}"


def ip_index_key(ip: str) -> str:
    """Set of ``instance_id|port`` registered from one IP (serves /query_instance without scanning)."""
    return f"{PREFIX}ip:{ip}"


def block_sizes_key() -> str:
    """Set of the block sizes (tokens) of vLLM instances, so lookups know which chains to compute."""
    return PREFIX + "vllm:block_sizes"


def engine_map_key(instance_id: str, rank: int | str = 0) -> str:
    """Hash engine block hash (u64 decimal) -> ``"<kvlookup chunk hash>|<medium>[,<medium>]"``,
    per vLLM instance and data-parallel rank. Resolves BlockRemoved and token-less BlockStored;
    a field goes when no medium holds the block any more; the key goes when the rank is cleared.
    """
    return f"{INSTANCE_PREFIX}{key_name(instance_id)}:blocks:{rank}"


def vllm_space(block_size: int) -> str:
    """Hash space (chunk key tag) of kvlookup's own chains over vLLM blocks of ``block_size`` tokens."""
    return f"v{int(block_size)}"


def rank_field(name: str, rank: int | str) -> str:
    """Per-rank field of a vLLM instance hash: ``seq:<rank>`` (last applied seq), ``digest:<rank>``
    (blake2b of that batch's payload), ``resync:<rank>`` (why its records are incomplete)."""
    return f"{name}:{rank}"


#: The field of a worker hash that names the current holder id of one location.
LOCATION_FIELD_PREFIX = "loc:"


def location_field(location: str) -> str:
    """Field of the worker hash holding the current holder id for ``location``."""
    return LOCATION_FIELD_PREFIX + location


def event_key(event_id: str) -> str:
    """String (JSON, TTL one hour) recording the outcome of one control call, for /check_finish."""
    return f"{PREFIX}event:{event_id}"
