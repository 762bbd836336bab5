"""Every Redis key kvlookup reads or writes, built in this one module.

The schema is a persisted public API: the prefix carries its version (``kvl:v2:``) so a
future layout can live beside this one. docs/redis-schema.md lists each key with its type,
writer, reader and lifetime; tests/index/test_keys.py pins the exact strings.

Two families, so that the index works on one Redis and on Redis Cluster alike:

- **Records** (chunk sorted sets and the holders' reverse-index buckets) carry no hash tag:
  Redis Cluster spreads them over every slot, so records balance across masters.
- **The registry** (instances, workers, holders, liveness, ownership) carries the hash tag
  ``{r}``: every registry key lives in one slot, so each registry script receives all the
  keys it touches through ``KEYS`` and runs atomically on a cluster too.

Lua scripts never build key names: callers pass every key through KEYS.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

SCHEMA_VERSION = 2
PREFIX = f"kvl:v{SCHEMA_VERSION}:"
#: Every registry key starts with this; ``{r}`` is its Redis Cluster hash tag (one slot).
REGISTRY = PREFIX + "{r}:"

#: Separates the fields of packed registry values (holder descriptions, worker members).
#: Instance ids, locations, media and worker ids are printable (:func:`printable_name`, checked
#: where engines send them and again in :func:`holder_value`), so a tab never occurs inside them.
SEP = "\t"
#: The longest engine-controlled name (instance id, location, medium) the index stores.
MAX_NAME = 256


def printable_name(value: str, max_len: int = MAX_NAME) -> bool:
    """1..``max_len`` characters, none a control character (TAB, newline, DEL, C1 ...) or
    another non-printable one: the charset of every engine-controlled name kvlookup stores."""
    return 0 < len(value) <= max_len and value.isprintable()


def key_name(name: str) -> str:
    """A name (instance id, sidecar id) as it appears inside keys: ``%`` and ``:`` percent-encoded.

    Keys put facets after the name (``instance:<id>:workers``), so an id such as ``a:workers``
    must not read as instance ``a``'s facet. Ids without ``%`` or ``:`` appear unchanged.
    """
    return name.replace("%", "%25").replace(":", "%3A")


# -- records (no hash tag: spread over the cluster) ------------------------------------------


def chunk_prefix(space: str = "") -> str:
    """Prefix of chunk keys in one hash space.

    space: "" for LMCache chunk hashes (the engines' own keys); a short tag such as
    ``"v16"`` for hash chains kvlookup computes itself (vLLM blocks of 16 tokens).
    """
    return PREFIX + "chunk:" + (f"{space}:" if space else "")


def chunk_key(chunk_hash: int | str, space: str = "") -> str:
    """Sorted set of the holders of one chunk: member holder id, score admit time (unix ms)."""
    return f"{chunk_prefix(space)}{chunk_hash}"


#: The member of a chunk's sorted set that carries the digest of its holder set, present while
#: the set has two holders or more: score ``-1 - D`` where ``D`` is the sum of
#: :func:`holder_digest` of its holder ids mod :data:`DIGEST_MOD` (kept by every write of the
#: set: ``APPLY_OPS``, ``CHUNK_OP``). The score is below every admit time, so it is always the
#: set's first member (``ZRANGE key 0 1 WITHSCORES`` reads it, or the set's only holder). Two
#: chunks with equal digests hold the same holders (but for a 2**-48 chance), so a lookup reads
#: a chunk's members only where the digest changes. Never a holder id (those are integers).
CHUNK_DIGEST_MEMBER = "#"
DIGEST_MOD = 2**48


def holder_digest(holder_id: str) -> int:
    """What a holder adds to a chunk's digest: the first 48 bits of SHA-1 of its id (as the
    scripts compute it with ``redis.sha1hex``)."""
    return int(hashlib.sha1(holder_id.encode()).hexdigest()[:12], 16)


def set_digest(members: Iterable[str]) -> int:
    """The digest ``D`` of a chunk's holder ids (:data:`CHUNK_DIGEST_MEMBER` skipped)."""
    return sum(holder_digest(m) for m in members if m != CHUNK_DIGEST_MEMBER) % DIGEST_MOD


def holders_of(members: Sequence[str]) -> list[str]:
    """A chunk set's members (as ``ZRANGE key 0 -1`` returns them) without its digest member."""
    return list(members[1:]) if members and members[0] == CHUNK_DIGEST_MEMBER else list(members)


#: Buckets of a holder's reverse index. Each bucket is a small set of integer chunk hashes,
#: which Redis stores as an intset (8 bytes a member) while it holds at most
#: ``set-max-intset-entries`` members (512 by default; the embedded server allows 4096). So a
#: holder keeps about 1M records (8M embedded) at ~8 bytes each instead of ~50 in one big set.
HOLDER_CHUNK_BUCKETS = 2048


def _bucket_of(tail: bytes) -> int:
    tail = tail[-4:].rjust(4, b"\0")
    return (tail[0] * 1000003 + tail[1] * 1009 + tail[2] * 31 + tail[3]) % HOLDER_CHUNK_BUCKETS


#: The bucket of every 4-digit decimal tail: the hot path (admits and evicts) looks it up.
DECIMAL_TAILS = {f"{i:04d}": _bucket_of(f"{i:04d}".encode()) for i in range(10_000)}


def chunk_bucket(chunk_hash: int | str) -> int:
    """Reverse-index bucket of a chunk hash, from the last 4 bytes of its decimal (or hex) text."""
    text = chunk_hash if isinstance(chunk_hash, str) else str(chunk_hash)
    found = DECIMAL_TAILS.get(text[-4:])
    return found if found is not None else _bucket_of(text.encode())


def holder_chunks_key(holder_id: int | str, bucket: int) -> str:
    """Set of the chunk hashes of one holder in one bucket (reverse index; purge never scans).

    Invariant: it holds at least every chunk whose sorted set names the holder (it is written
    before the record on admit and cleaned after it on evict), so purge finds every record.
    """
    return f"{PREFIX}holder:{holder_id}:chunks:{bucket}"


def holder_buckets_key(holder_id: int | str) -> str:
    """Set of the reverse-index bucket numbers a holder ever wrote (``b`` added with or before
    the first member of ``holder_chunks_key(holder_id, b)``; an intset of at most 2048 small
    integers): purge reads only those buckets, so a holder of one record costs a few commands,
    not 2048 (issue 20 item 9). Deleted when its holder is purged."""
    return f"{PREFIX}holder:{holder_id}:buckets"


#: Evictions each holder's log keeps (the newest), and how long a log lives after its last
#: eviction (ms): explain tells "evicted at T" from "never stored" with them.
EVICTED_MAX = 1024
EVICTED_TTL_MS = 3_600_000


def holder_evicted_key(holder_id: int | str) -> str:
    """Sorted set of a holder's recent evictions: member chunk hash (text), score evict time (unix
    ms); the newest :data:`EVICTED_MAX`, expiring :data:`EVICTED_TTL_MS` after the last one.
    Deleted with the holder (purge)."""
    return f"{PREFIX}holder:{holder_id}:evicted"


@functools.lru_cache(maxsize=256)
def holder_bucket_keys(holder_id: int | str) -> tuple[str, ...]:
    """Every reverse-index bucket key of a holder, by bucket (``holder_chunks_key`` for each)."""
    return tuple(holder_chunks_key(holder_id, b) for b in range(HOLDER_CHUNK_BUCKETS))


# -- holders (registry) ----------------------------------------------------------------------


def holders_key() -> str:
    """Hash holder id -> ``<instance_id>\\t<worker_id>\\t<location>\\t<space>`` (never changes)."""
    return REGISTRY + "holders"


def holder_seq_key() -> str:
    """Counter that allocates holder ids (INCR)."""
    return REGISTRY + "holders:seq"


def holder_gen_key() -> str:
    """String: the ``run_id`` of the Redis master that last allocated a holder id. A different
    master (failed over, restarted) first moves the counter on by a gap, so an id that a lost
    write had handed out is never handed out again (scripts.HOLDER)."""
    return REGISTRY + "holders:gen"


def registry_version_key() -> str:
    """String ``<run_id>:<n>``, moved by every registry change that can change whether a holder
    counts in a lookup (a retirement, a registration, a deregistration); lookups that keep
    holder answers (the cluster backend) start over when it moves."""
    return REGISTRY + "version"


def records_key() -> str:
    """Hash holder id -> number of records the holder has (its reverse-index size)."""
    return REGISTRY + "records"


def dead_holders_key() -> str:
    """Sorted set of retired holder ids (score: retire time, unix ms) whose records wait for purge."""
    return REGISTRY + "dead"


#: Departures the registry remembers (the newest), and for how long (ms).
DEPARTURES_MAX = 1024
DEPARTURES_KEEP_MS = 3_600_000


def departures_key() -> str:
    """Sorted set ``<worker member>\t<deregistered|reaped>`` -> time (unix ms) of each worker that
    left, the newest :data:`DEPARTURES_MAX` of the last :data:`DEPARTURES_KEEP_MS` (explain names
    a gone holder of a prompt's chunks with it)."""
    return REGISTRY + "departures"


def purge_key() -> str:
    """Hash holder id -> next reverse-index bucket to purge (progress of a dead holder's purge)."""
    return REGISTRY + "purge"


def holder_value(instance_id: str, worker_id: int | str, location: str, space: str = "") -> str:
    """The packed description of a holder in :func:`holders_key`. Raises ValueError when a
    field is not a :func:`printable_name` (space may be ''): the description stays unambiguous."""
    fields = (instance_id, str(worker_id), location)
    if not all(printable_name(f) for f in fields) or (space and not printable_name(space)):
        raise ValueError(f"holder fields must be 1..{MAX_NAME} printable characters: {fields!r:.200}")
    return SEP.join((*fields, space))


def parse_holder(value: str) -> tuple[str, str, str, str]:
    """(instance_id, worker_id, location, space) from :func:`holder_value`'s text. Raises
    ValueError for any other text (one written by a version that did not check its fields)."""
    parts = value.split(SEP)
    if len(parts) != 4:
        raise ValueError(f"unparsable holder description ({len(parts)} fields): {value!r:.120}")
    inst, wid, loc, space = parts
    return inst, wid, loc, space


def holder_space(value: str) -> str:
    """The hash space of a holder description, even an unparsable one: kvlookup writes the space
    (never an engine), last, so purge can still find the records of a corrupt description."""
    return value.rsplit(SEP, 1)[-1] if SEP in value else ""


# -- instances and workers (registry) --------------------------------------------------------


def instances_key() -> str:
    """Set of every instance_id with a registered worker."""
    return REGISTRY + "instances"


def instance_key(instance_id: str) -> str:
    """Hash of instance facts: kind (lmcache|vllm), worker_rule (all|any), vLLM rank fields
    (:func:`rank_field`, :func:`group_field`), ``model`` (a discovered vLLM server's model:
    lookups naming another ``model_name`` skip the instance)."""
    return f"{REGISTRY}instance:{key_name(instance_id)}"


#: Fields of :func:`instance_key` set while the instance may be missing ops (kvlookup.index.staleness):
#: when (server ms) and why; cleared by a re-registration or a full sync of one of its workers.
STALE_SINCE_FIELD, STALE_REASON_FIELD = "stale_since", "stale_reason"


def instance_workers_key(instance_id: str) -> str:
    """Set of the registered worker ids (TP ranks, or DP ranks for vLLM) of one instance."""
    return f"{REGISTRY}instance:{key_name(instance_id)}:workers"


def worker_key(instance_id: str, worker_id: int | str) -> str:
    """Hash of one worker: ip, port, peer_init_url, registered_at, last_heartbeat, heartbeats,
    epoch, loc:<location> (its current holder id there)."""
    return f"{REGISTRY}worker:{key_name(instance_id)}:{worker_id}"


def worker_member(instance_id: str, worker_id: int | str) -> str:
    """A worker as a member of the registry's per-worker sets: ``<worker_id>\\t<instance_id>``."""
    return f"{worker_id}{SEP}{instance_id}"


def rules_key() -> str:
    """Hash instance_id -> ``<worker_rule>\\t<registered workers>`` (what the lookup walk needs)."""
    return REGISTRY + "rules"


def alive_key() -> str:
    """Sorted set instance_id -> liveness lease expiry (Redis server time, unix ms), renewed by
    the owning sidecar."""
    return REGISTRY + "alive"


def lease_clock_key() -> str:
    """Hash ``tick`` -> the last sidecar renewal (server time, unix ms), ``since`` -> when
    the current unbroken run of renewals began: a gap longer than the outage gap (Redis did not
    answer, or nobody renewed) starts a new run, and a deadline that passed before ``since`` is
    not evidence until a grace after it (kvlookup.index.scripts.TOUCH)."""
    return REGISTRY + "leases:clock"


def heartbeats_key() -> str:
    """Sorted set worker member -> last heartbeat (server time, unix ms), for workers that send heartbeats."""
    return REGISTRY + "heartbeats"


def suspects_key() -> str:
    """Sorted set worker member -> deadline (unix ms): the worker's connection closed (socket
    monitor evidence) or a health call failed; it is reaped at the deadline unless it speaks."""
    return REGISTRY + "suspects"


def ip_index_key(ip: str) -> str:
    """Set of ``<port>:<instance_id>`` registered from one IP (serves /query_instance without scanning)."""
    return f"{REGISTRY}ip:{ip}"


def block_sizes_key() -> str:
    """Hash worker member -> the prefix chains of each registered vLLM rank, comma-separated
    :func:`vllm_chain` descriptors (``"16"``, ``"16,256"``, ``"16+1"``); lookups walk the chains of
    live ranks only, and a rank's field goes with its registration."""
    return REGISTRY + "block_sizes"


# -- sidecars (registry) ---------------------------------------------------------------------


def owners_key() -> str:
    """Hash instance_id -> id of the sidecar that ingests the instance's traffic."""
    return REGISTRY + "owners"


def sidecar_instances_key(sidecar_id: str) -> str:
    """Set of the instance ids one sidecar owns (a restarted sidecar resumes from it)."""
    return f"{REGISTRY}sidecar:{key_name(sidecar_id)}:instances"


def claims_key() -> str:
    """Hash instance_id -> id of the sidecar whose ``allowed_instance_ids`` names it: while that
    sidecar's lease holds, no other sidecar writes for the instance (issue 20 item 10)."""
    return REGISTRY + "claims"


def mp_held_key() -> str:
    """Sorted set instance_id -> expiry (Redis server time, unix ms) of the instances registered
    through the LMCache MP coordinator (renewed by their registration and heartbeats, removed by
    DELETE): while it holds, no sidecar writes for that instance id (issue 20 item 10)."""
    return REGISTRY + "mp_held"


def sidecars_key() -> str:
    """Sorted set sidecar id -> lease expiry (unix ms) of every sidecar that owns instances."""
    return REGISTRY + "sidecars"


def health_probe_key() -> str:
    """String written (10 s TTL) by each controller /health: whether Redis accepts writes
    (OOM under maxmemory, MISCONF on a full disk) is reported there."""
    return REGISTRY + "health:probe"


def sidecar_status_key(sidecar_id: str) -> str:
    """Hash of a sidecar's last reported state (pid, host, endpoints, pending ops, lag)."""
    return f"{REGISTRY}sidecar:{key_name(sidecar_id)}:status"


# -- vLLM ------------------------------------------------------------------------------------


def engine_map_key(instance_id: str, rank: int | str = 0) -> str:
    """Hash :func:`engine_field` -> ``"<kvlookup chunk hash>|<residency>[,<residency>]|<block size>"``,
    per vLLM instance and data-parallel rank; a residency is ``<medium>`` or
    ``<medium>~<ownership>`` (entries written before block sizes were kept have no third part).
    Resolves BlockRemoved and token-less BlockStored; a field goes when no residency holds the
    block any more; the key goes when the rank is cleared. No hash tag: as large as the rank's
    records, so it spreads over the cluster.
    """
    return f"{PREFIX}blocks:{key_name(instance_id)}:{rank}"


def engine_field(engine_hash: int, group_idx: int | None = None) -> str:
    """Field of :func:`engine_map_key` for one engine block hash in one KV cache group: the hash
    (u64 decimal) for group None or 0, ``<hash>@<group>`` for the others (vLLM keys blocks by
    ``BlockHashWithGroupId``: one hash can live in several groups)."""
    return str(engine_hash) if not group_idx else f"{engine_hash}@{group_idx}"


def vllm_space(block_size: int) -> str:
    """Hash space (chunk key tag) of kvlookup's own chains over vLLM blocks of ``block_size`` tokens
    (the prefix chain: full, MLA and sink-full attention groups, and streams without groups)."""
    return f"v{int(block_size)}"


def vllm_group_space(block_size: int, group_idx: int) -> str:
    """Hash space of a hybrid model's other groups (sliding window, Mamba, ...): ``v<bs>g<group>``.
    Never walked for matched_prefix_length; read for ``reusable_prefix_length`` only."""
    return f"v{int(block_size)}g{int(group_idx)}"


def vllm_chain(block_size: int, lookahead: int = 0) -> str:
    """Descriptor of a prefix chain in :func:`block_sizes_key`: ``"<bs>"`` or ``"<bs>+<L>"`` for
    blocks hashed with L lookahead tokens (EAGLE block drop)."""
    return f"{int(block_size)}+{int(lookahead)}" if lookahead else str(int(block_size))


def parse_vllm_chains(text: str) -> list[tuple[int, int]]:
    """(block size, lookahead) pairs from a comma-separated :func:`vllm_chain` list; bad parts skipped."""
    out = []
    for part in str(text).split(","):
        bs, _, la = part.strip().partition("+")
        if bs.isdigit() and (not la or la.isdigit()) and int(bs) > 0:
            out.append((int(bs), int(la or 0)))
    return out


def rank_field(name: str, rank: int | str) -> str:
    """Per-rank field of a vLLM instance hash: ``seq:<rank>`` (last applied seq), ``digest:<rank>``
    (blake2b of that batch's payload), ``resync:<rank>`` (why its records are incomplete),
    ``block_size:<rank>`` (its prefix chains, as in :func:`block_sizes_key`), ``session:<rank>``
    (the session_id of the last store that named one)."""
    return f"{name}:{rank}"


def group_field(rank: int | str, group_idx: int) -> str:
    """Field of a vLLM instance hash describing one KV cache group of one rank, learned from its
    stores: ``group:<rank>:<group>`` -> ``"<kind>|<block size>|<sliding window or ''>"``."""
    return f"group:{rank}:{group_idx}"


#: The field of a worker hash that names the current holder id of one location.
LOCATION_FIELD_PREFIX = "loc:"


def location_field(location: str, space: str = "") -> str:
    """Field of the worker hash holding the current holder id for ``location`` in hash space
    ``space``: ``loc:<location>`` (LMCache, space "") or ``loc:<location>@<space>`` (a vLLM rank
    holds records in several spaces per medium: block sizes, hybrid groups; each has its holder)."""
    return LOCATION_FIELD_PREFIX + location + (f"@{space}" if space else "")


def event_key(event_id: str) -> str:
    """String (JSON, TTL one hour) recording the outcome of one control call, for /check_finish."""
    return f"{PREFIX}event:{event_id}"


# -- LMCache multiprocess (MP) coordinator directory (hash tag {mp}: one slot) ----------------
#
# Every MP key carries the hash tag ``{mp}``: the gate, the placements and the counters are
# changed together by one Lua script per POST /events (never half-applied), which needs one
# slot on Redis Cluster. kvlookup.index.mp documents the values,
# kvlookup.index.mp_scripts the three families whose names its scripts complete.

MP = PREFIX + "{mp}:"
#: Chunk buckets: the first 3 hex digits of a chunk hash pick one of 4,096 hashes, each small
#: enough to stay a listpack (compact, <= 128 fields) up to ~500k keys; few enough that the
#: per-key overhead of the buckets stays small from ~10k keys on.
MP_BUCKET_HEX = 3
#: Keys per page of the insertion-ordered key list (a listpack while <= 128 fields).
MP_PAGE = 128
#: Buckets of an instance's L1 reverse index (sets of key ids; intsets while small).
MP_L1_BUCKETS = 256
#: Consecutive key ids per run of one L1 bucket: a store batch allocates consecutive ids, so its
#: new L1 keys land in a few buckets (one SADD each) instead of one bucket per key.
MP_L1_RUN = 64


def mp_bucket(chunk_hash_hex: str) -> str:
    """The bucket of a chunk hash: its first :data:`MP_BUCKET_HEX` hex digits (zero-padded)."""
    return chunk_hash_hex[:MP_BUCKET_HEX].ljust(MP_BUCKET_HEX, "0")


def mp_chunks_prefix() -> str:
    """Prefix of :func:`mp_chunks_key`: ``mp_chunks_key(b) == mp_chunks_prefix() + b`` (the MP
    scripts append the bucket of a record a fence reaches; kvlookup.index.mp_scripts)."""
    return f"{MP}c:"


def mp_chunks_key(bucket: str) -> str:
    """Hash ``<chunk b64>.<space id>`` -> ``<key id>,<access count>|<tb>,<epoch>,<size>|...``:
    the placements of every MP object key whose chunk hash starts with ``bucket``; and
    ``<chunk b64>`` -> ``<token_offset>\t<base64 little-endian uint32 token ids>``, the chunk's
    token binding (deleted with the chunk's last key; beside the keys, so a lookup reads both
    with one HMGET)."""
    return f"{mp_chunks_prefix()}{bucket}"


def mp_page_prefix() -> str:
    """Prefix of :func:`mp_page_key`: ``mp_page_key(n) == mp_page_prefix() + str(n)`` (the MP
    scripts append the page of a key id they allocate or read)."""
    return f"{MP}k:"


def mp_page_key(page: int) -> str:
    """Hash ``<key id % MP_PAGE>`` -> ``<chunk b64>.<space id>``: key ids in insertion order
    (GET /directory/keys walks the pages 0 .. seq / MP_PAGE)."""
    return f"{mp_page_prefix()}{page}"


def mp_l1_prefix() -> str:
    """Prefix of :func:`mp_l1_key`: ``mp_l1_key(i, b) == mp_l1_prefix() + f"{i}:{b}"`` (the MP
    scripts append the instance number they intern and the bucket of a key id)."""
    return f"{MP}l1:"


def mp_l1_key(instance_num: int | str, bucket: int) -> str:
    """Set of the key ids holding an L1 placement last reported by instance number
    ``instance_num``, bucket :func:`mp_l1_bucket` of the key id (fencing never scans)."""
    return f"{MP}l1:{instance_num}:{bucket}"


def mp_l1_bucket(key_id: int) -> int:
    """The L1 bucket of a key id: ``key_id // MP_L1_RUN % MP_L1_BUCKETS`` (runs of ids share one)."""
    return key_id // MP_L1_RUN % MP_L1_BUCKETS


def mp_blend_key(namespace_id: int | str) -> str:
    """Hash ``<fingerprint>`` -> ``<chunk b64>,<token_offset>;...``: the blend index of one namespace
    (model, salt, world size; interned kind ``b``): every stored chunk whose token binding is one
    whole chunk, by a fingerprint of its tokens (blake3 of the little-endian uint32 ids, 8 bytes hex).
    Entries are checked against the bindings and keys when read; written by ingest, never pruned
    (bounded by the chunks ever bound)."""
    return f"{MP}b:{namespace_id}"


def mp_names_key() -> str:
    """Hash of interned names: ``n:<kind><text>`` -> id and ``r:<kind><id>`` -> text, kinds
    ``s`` space (model, salt, kv_rank, group), ``t`` tier/backend/shared, ``i`` instance id,
    ``e`` epoch (instance number, incarnation); ``seq:<kind>`` counters; ``sps`` every space id."""
    return MP + "names"


def mp_stats_key() -> str:
    """Hash of directory counters: keys, placements, l1_count, l1_bytes, l2_count, l2_bytes,
    ``l1k:<instance_id>`` (keys with an L1 placement of that instance), ``kseq`` (key ids),
    batches_applied, batches_duplicate, batches_stale, batches_missing, events_dropped."""
    return MP + "stats"


def mp_cursors_key() -> str:
    """Hash instance_id -> gate cursor ``<incarnation>\\t<last seq>\\t<gap 0|1>\\t<last dropped_events
    or ''>\\t<events dropped>\\t<missing batches>\\t<delay ms>``."""
    return MP + "cursors"


def mp_departed_key() -> str:
    """Hash instance_id -> ``<incarnation>\t<deregistered|timed_out>\t<unix ms>``: the incarnation it
    departed in (DELETE or timeout); its L1 batches of that incarnation or older are stale until it
    registers again (LMCache 0.5.7)."""
    return MP + "departed"


def mp_instances_key() -> str:
    """Hash instance_id -> JSON registration (ip, http_port, registration_time, metadata,
    p2p_advertised_url, mq_port) of every registered MP instance."""
    return MP + "instances"


def mp_heartbeats_key() -> str:
    """Sorted set instance_id -> last registration or heartbeat (unix ms)."""
    return MP + "heartbeats"


def mp_capacity_key() -> str:
    """Hash instance_id -> JSON capacity declaration ``{"incarnation", "revision", "modules":
    [[tier, backend, shared, capacity_bytes], ...]}`` from config batches."""
    return MP + "capacity"


def mp_config_key() -> str:
    """Hash of fleet settings: ``chunk_size`` once bound (registration or PUT /config/chunk-size)."""
    return MP + "config"


def mp_script_keys() -> list[str]:
    """KEYS[1..10] of the MP ingest and departure scripts (kvlookup.index.mp_scripts): names,
    stats, cursors, departed, capacity, instances, heartbeats, then the prefixes of the chunk
    buckets, key pages and L1 sets (families whose ids the scripts allocate or discover)."""
    return [mp_names_key(), mp_stats_key(), mp_cursors_key(), mp_departed_key(), mp_capacity_key(),
            mp_instances_key(), mp_heartbeats_key(), mp_chunks_prefix(), mp_page_prefix(), mp_l1_prefix()]


def mp_all_keys() -> list[str]:
    """The fixed MP registry keys (the cluster test and docs list them)."""
    return [mp_names_key(), mp_stats_key(), mp_cursors_key(), mp_departed_key(), mp_instances_key(),
            mp_heartbeats_key(), mp_capacity_key(), mp_config_key()]
