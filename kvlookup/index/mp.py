"""The LMCache multiprocess (MP) coordinator's directory, in Redis: registry, ingest gate,
placements, counters (docs/lmcache-mp.md; keys in keys.py under ``{mp}``; Lua in mp_scripts.py).

Semantics are ``lmcache.v1.mp_coordinator`` 0.5.6/0.5.7rc2's (``ingest/event_gate.py``,
``views/key_directory.py``): one cursor ``(incarnation, last seq, gap)`` per emitter; a lower
incarnation is stale, a higher one drops the emitter's L1 placements (L2 stays), ``seq <= last``
is a duplicate, a forward jump is admitted and flags a gap, as does a rise of ``dropped_events``;
after a departure (DELETE, timeout) L1 batches of the departed incarnation are stale until the
instance registers again. A placement's identity is ``(tier, backend, shared, instance)``, the
instance left out when ``shared``: the last reporter of a shared pool wins.

Storage (per object key, ~100-150 B; docs/redis-schema.md): a field ``<chunk b64>.<space id>``
in the chunk's bucket hash with value ``<key id>,<access count>|<tb>,<epoch>,<size>|...``
(tb, epoch and space are small interned ids), a field in one page of the insertion-ordered key
list, and for L1 a key id in the reporting instance's reverse-index bucket (an intset).

One class, :class:`MPDirectory`, built in layers, one Redis concept a module:
kvlookup.index.mp_registry (instances, heartbeats, departures, cursors, capacity, chunk size),
mp_records (interned names, records, token bindings), mp_queries (the key endpoints), mp_lookup
(prefix matches, explain), mp_blend (the blend index), and here the ingest of POST /events;
mp_values holds the value formats.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvlookup.index import keys as K
from kvlookup.index.mp_blend import MPBlend
from kvlookup.index.mp_registry import DEFAULT_CHUNK_SIZE, DEFAULT_INSTANCE_TIMEOUT_S, ChunkSizeConflict, HeldBySidecar
from kvlookup.index.mp_values import raw_b64, tokens_text
from kvlookup.wire import lmcache_mp as W

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_INSTANCE_TIMEOUT_S", "ChunkSizeConflict", "HeldBySidecar", "MPDirectory"]


class MPDirectory(MPBlend):
    """The MP directory on one Redis client (plain, Sentinel-managed or Cluster).

    chunk_size: used for token hashing until the fleet binds one (registration, PUT
    /config/chunk-size); instance_timeout_s: heartbeat silence before an instance departs.
    Errors: redis.RedisError passes through (the HTTP layer answers 503).
    """

    def apply(self, batches: Sequence[W.CacheEventBatch], now: float | None = None) -> dict[str, int]:
        """``POST /events``: gate and apply every batch in one atomic script; {applied, duplicates, stale}.
        HeldBySidecar (nothing applied) when a batch names an instance a live sidecar writes for."""
        now = time.time() if now is None else now
        self.check_writer(b.instance_id for b in batches)
        args: list = [int(now * 1000), len(batches)]
        known = self._names
        buckets: set[str] = set()
        spaces: dict[tuple, str] = {}  # (model, salt, kv_rank, group) -> ".<space id>", or "\t<text>" when new
        fresh: set[str] = set()  # space texts stored by this request and not interned yet
        bound = False  # any store entry with a token binding (the blend index wants it)
        for b in batches:
            args += [b.instance_id, b.incarnation, b.seq, b.event_type, b.tier, b.backend, int(b.shared),
                     b.dropped_events, int(b.ts * 1000), b.capacity_bytes, b.capacity_revision, len(b.entries)]
            store = b.event_type == "store"
            parts = []
            for e in b.entries:
                k = e.key
                raw = bytes.fromhex(k.chunk_hash_hex)
                sk = (k.model_name, k.cache_salt, k.kv_rank, k.object_group_id)
                space = spaces.get(sk)
                if space is None:
                    text = f"{sk[0]}\t{sk[1]}\t{sk[2]}\t{sk[3]}"  # mp_values.space_text
                    sid = known.get("n:s" + text)
                    space = spaces[sk] = "." + sid if sid else "\t" + text
                if store and space[0] == "\t":
                    fresh.add(space[1:])
                tokens = ""
                if store and e.token_ids:
                    tokens, bound = tokens_text(e.token_ids, e.token_offset), True
                bucket = K.mp_bucket(raw[:2].hex())
                buckets.add(bucket)
                parts.append(f"{bucket}{raw_b64(raw)}{space}\x1f{e.size_bytes}\x1f{tokens}\x1e")
            args.append("".join(parts))
        order = sorted(buckets)  # KEYS[11..]: the chunk bucket of every entry
        applied, dup, stale = self._apply(keys=K.mp_script_keys() + [K.mp_chunks_key(b) for b in order],
                                          args=[args[0], args[1], ",".join(order), *args[2:]])
        self._replicated()
        if bound:
            self._index_blend(batches)
        if fresh:
            self.space_ids(sorted(fresh))  # the next batches pass their ids
        return {"applied": int(applied), "duplicates": int(dup), "stale": int(stale)}
