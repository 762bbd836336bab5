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

import binascii
import time
from collections.abc import Sequence

from kvlookup.index import keys as K
from kvlookup.index.mp_blend import MPBlend
from kvlookup.index.mp_registry import DEFAULT_CHUNK_SIZE, DEFAULT_INSTANCE_TIMEOUT_S, ChunkSizeConflict, HeldBySidecar
from kvlookup.index.mp_values import raw_b64, space_text, tokens_text
from kvlookup.wire import lmcache_mp as W

try:  # the fixed-width form of MP_APPLY's entries is built with it (MPDirectory._uniform)
    import numpy as np
except ImportError:  # pragma: no cover - a dependency; without it every batch takes the general form
    np = None  # type: ignore[assignment]

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
        buckets: set[str] = set()
        fresh: set[str] = set()  # space texts stored by this request and not interned yet
        bound = False  # any store entry with a token binding (the blend index wants it)
        for b in batches:
            args += [b.instance_id, b.incarnation, b.seq, b.event_type, b.tier, b.backend, int(b.shared),
                     b.dropped_events, int(b.ts * 1000), b.capacity_bytes, b.capacity_revision, len(b.entries)]
            store = b.event_type == "store"
            packed = self._uniform(b.entries, store, buckets)
            args += self._general(b.entries, store, buckets, fresh) if packed is None else packed
            bound = bound or (store and any(e.token_ids for e in b.entries))
        order = sorted(buckets)  # KEYS[11..]: the chunk bucket of every entry (keys.mp_chunks_key)
        prefix = K.mp_chunks_prefix()
        applied, dup, stale = self._written(self._apply, K.mp_script_keys() + [prefix + b for b in order],
                                            [args[0], args[1], ",".join(order), *args[2:]])
        if bound:
            self._index_blend(batches)
        if fresh:
            self.space_ids(sorted(fresh))  # the next batches pass their ids
        return {"applied": int(applied), "duplicates": int(dup), "stale": int(stale)}

    def _uniform(self, entries: Sequence[W.CacheEventEntry], store: bool, buckets: set[str]) -> list | None:
        """MP_APPLY's fixed-width form of a batch's entries, ``[width, size_bytes, refs, bindings]``,
        when every entry has a 32-byte chunk hash written as 64 hex digits, one space whose id is
        known and one size_bytes: the refs ``<bucket><chunk b64>.<space id>`` are built for the
        whole batch at once (numpy), not entry by entry; ``bindings`` is '' when no store entry has
        a token binding, else each entry's (or '') followed by byte 30. None otherwise (or without
        numpy): the caller packs the general form. Adds the batch's buckets to ``buckets``."""
        if np is None or not entries:
            return None
        keys = [e.key for e in entries]
        if len({(k.model_name, k.cache_salt, k.kv_rank, k.object_group_id) for k in keys}) != 1:
            return None
        sid = self._names.get("n:s" + space_text(keys[0]))
        if sid is None:
            return None
        sizes = {e.size_bytes for e in entries} if store else {0}
        hexes = [k.chunk_hash_hex for k in keys]
        if len(sizes) != 1 or set(map(len, hexes)) != {64}:
            return None
        n = len(keys)
        try:
            raw = bytes.fromhex("".join(hexes))
        except ValueError:
            return None
        if len(raw) != 32 * n:  # whitespace somewhere: not 64 hex digits each
            return None
        bindings = "".join(f"{tokens_text(e.token_ids, e.token_offset) if e.token_ids else ''}\x1e"
                           for e in entries) if store and any(e.token_ids for e in entries) else ""
        return [_REF_W + len(sid), sizes.pop(), _refs(raw, n, sid, buckets), bindings]

    def _general(self, entries: Sequence[W.CacheEventEntry], store: bool, buckets: set[str],
                 fresh: set[str]) -> list:
        """MP_APPLY's general form of a batch's entries, ``[0, 0, packed, '']`` (mp_scripts.MP_APPLY):
        any hash length, spaces not interned yet (``fresh`` gets their texts), token bindings."""
        known = self._names
        spaces: dict[tuple, str] = {}  # (model, salt, kv_rank, group) -> ".<space id>", or "\t<text>" when new
        parts = []
        for e in entries:
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
            tokens = tokens_text(e.token_ids, e.token_offset) if store and e.token_ids else ""
            bucket = K.mp_bucket(raw[:2].hex())
            buckets.add(bucket)
            parts.append(f"{bucket}{raw_b64(raw)}{space}\x1f{e.size_bytes}\x1f{tokens}\x1e")
        return [0, 0, "".join(parts), ""]


#: Width of a fixed-width ref before its space id: bucket, 43 base64url characters, '.'.
_REF_W = K.MP_BUCKET_HEX + 44
_URLSAFE = bytes.maketrans(b"+/", b"-_")
#: keys.mp_bucket of every bucket number (the first MP_BUCKET_HEX hex digits of a hash, as a number)
_BUCKETS = [f"{i:0{K.MP_BUCKET_HEX}x}" for i in range(16 ** K.MP_BUCKET_HEX)]


def _refs(raw: bytes, n: int, sid: str, buckets: set[str]) -> str:
    """The refs ``<bucket><chunk b64>.<sid>`` of ``n`` 32-byte hashes ``raw`` (concatenated), one
    after another; their buckets go into ``buckets``. Base64 of each hash with a zero byte after it
    is 44 characters whose first 43 are the hash's unpadded base64 (33 bytes = 11 whole groups), so
    one b2a_base64 call encodes the batch."""
    bh = K.MP_BUCKET_HEX
    hashes = np.frombuffer(raw, dtype=np.uint8).reshape(n, 32)
    padded = np.zeros((n, 33), dtype=np.uint8)
    padded[:, :32] = hashes
    b64 = np.frombuffer(binascii.b2a_base64(padded.tobytes(), newline=False).translate(_URLSAFE),
                        dtype=np.uint8).reshape(n, 44)
    top = (hashes[:, 0].astype(np.uint16) << 8 | hashes[:, 1]) >> (16 - 4 * bh)  # keys.mp_bucket, as a number
    out = np.empty((n, _REF_W + len(sid)), dtype=np.uint8)
    out[:, :bh] = np.frombuffer(hashes[:, :2].tobytes().hex().encode(), dtype=np.uint8).reshape(n, 4)[:, :bh]
    out[:, bh:bh + 43] = b64[:, :43]
    out[:, bh + 43:] = np.frombuffer(("." + sid).encode(), dtype=np.uint8)
    buckets.update(_BUCKETS[b] for b in np.unique(top).tolist())
    return out.tobytes().decode("ascii")
