"""The LMCache multiprocess (MP) coordinator's directory, in Redis: registry, ingest gate,
placements, counters (docs/lmcache-mp.md; keys in keys.py under ``{mp}``; Lua in scripts.py).

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
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from blake3 import blake3

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index import scripts as S
from kvlookup.wire import lmcache_mp as W

#: How long an unbound chunk size, and the list of spaces, are trusted before Redis is asked again (s).
UNBOUND_RECHECK_S = 1.0
#: LMCache's coordinator defaults: --instance-timeout 30 s, --chunk-size 256.
DEFAULT_INSTANCE_TIMEOUT_S = 30.0
DEFAULT_CHUNK_SIZE = mphash.DEFAULT_CHUNK_SIZE


class ChunkSizeConflict(ValueError):
    """The fleet is bound to another chunk size (the coordinator answers 409)."""


def chunk_b64(chunk_hash_hex: str) -> str:
    """A chunk hash as it appears in MP fields: unpadded base64url of its bytes (43 chars for 32)."""
    return _b64(bytes.fromhex(chunk_hash_hex))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def canon(chunk_hash_hex: str) -> str:
    """A wire ``chunk_hash_hex`` as the coordinator reads it (``bytes.fromhex``), as lowercase hex."""
    return bytes.fromhex(chunk_hash_hex).hex()


def chunk_hex(b64: str) -> str:
    """Inverse of :func:`chunk_b64`."""
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def space_text(key: W.EncodedObjectKey) -> str:
    """The interned part of an object key besides its chunk: model, salt, kv_rank, group."""
    return f"{key.model_name}\t{key.cache_salt}\t{key.kv_rank}\t{key.object_group_id}"


def tokens_text(token_ids: list[int], offset: int) -> str:
    """A token binding as stored: ``<offset>\\t<base64 little-endian uint32>`` ('' when any id is outside uint32)."""
    try:
        packed = array("I", token_ids)
    except OverflowError:
        return ""
    if packed.itemsize != 4:  # pragma: no cover
        return ""
    return f"{offset}\t{base64.b64encode(packed.tobytes()).decode()}"


def parse_tokens(text: str | None) -> tuple[list[int], int]:
    """(token_ids, token_offset) from :func:`tokens_text`'s text; ([], -1) for none."""
    if not text:
        return [], -1
    off, _, b64 = text.partition("\t")
    ids = array("I")
    ids.frombytes(base64.b64decode(b64))
    return ids.tolist(), int(off)


@dataclass
class Record:
    """One object key's stored state: key id, access count, placements ``(tb, epoch, size)``."""

    kid: int
    access_count: int
    placements: list[tuple[str, str, int]] = field(default_factory=list)


def parse_record(value: str) -> Record:
    head, *rest = value.split("|")
    kid, acc = head.split(",")
    return Record(int(kid), int(acc), [(tb, ep, int(sz)) for tb, ep, sz in (p.split(",") for p in rest)])


class MPDirectory:
    """The MP directory on one Redis client (plain, Sentinel-managed or Cluster).

    chunk_size: used for token hashing until the fleet binds one (registration, PUT
    /config/chunk-size); instance_timeout_s: heartbeat silence before an instance departs.
    Errors: redis.RedisError passes through (the HTTP layer answers 503).
    """

    def __init__(self, redis, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 instance_timeout_s: float = DEFAULT_INSTANCE_TIMEOUT_S, replica_acks: int = 0,
                 replica_timeout_ms: int = 500):
        self.r = redis
        #: before a write is acknowledged, wait (WAIT) until this many replicas of the {mp} master
        #: have it (0: don't wait): a master killed right after an answer then loses nothing
        self.replica_acks = replica_acks
        self.replica_timeout_ms = replica_timeout_ms
        self.short_acks = 0
        self.configured_chunk_size = chunk_size
        self.instance_timeout_s = instance_timeout_s
        self._apply = redis.register_script(S.MP_APPLY)
        self._depart = redis.register_script(S.MP_DEPART)
        self._register = redis.register_script(S.MP_REGISTER)
        self._heartbeat = redis.register_script(S.MP_HEARTBEAT)
        self._bind = redis.register_script(S.MP_BIND_CHUNK)
        self._names: dict[str, str] = {}  # immutable interned names (ids never change)
        self._bound = 0
        self._unbound_at = -1e9
        self._spaces: tuple[float, dict[str, str]] = (-1e9, {})

    # -- registry ------------------------------------------------------------------------

    def _replicated(self) -> None:
        """WAIT for ``replica_acks`` replicas of the ``{mp}`` master (counted in ``short_acks`` when fewer answer)."""
        if not self.replica_acks:
            return
        args = ("WAIT", self.replica_acks, self.replica_timeout_ms)
        if hasattr(self.r, "get_node_from_key"):  # Redis Cluster: the master of the {mp} slot
            got = self.r.execute_command(*args, target_nodes=self.r.get_node_from_key(K.MP))
        else:
            got = self.r.execute_command(*args)
        if int(got) < self.replica_acks:
            self.short_acks += 1

    def chunk_size(self) -> int:
        """The bound chunk size (kept once read: a binding never changes), or the configured one
        while none is bound (asked again after :data:`UNBOUND_RECHECK_S`)."""
        if self._bound:
            return self._bound
        now = time.monotonic()
        if now - self._unbound_at < UNBOUND_RECHECK_S:
            return self.configured_chunk_size
        bound = self.r.hget(K.mp_config_key(), "chunk_size")
        if bound:
            self._bound = int(bound)
            return self._bound
        self._unbound_at = now
        return self.configured_chunk_size

    def bind_chunk_size(self, chunk_size: int) -> int:
        """Bind the fleet's chunk size once; ChunkSizeConflict for another size or one below the configured minimum."""
        bound = self.r.hget(K.mp_config_key(), "chunk_size")
        if bound is None and chunk_size < self.configured_chunk_size:
            raise ChunkSizeConflict(f"Chunk size {chunk_size} is smaller than the coordinator's configured "
                                    f"minimum {self.configured_chunk_size}")
        got = int(self._bind(keys=[K.mp_config_key()], args=[chunk_size]))
        self._bound = got
        if got != chunk_size:
            raise ChunkSizeConflict(f"Coordinator is already bound to chunk size {got}; use a separate "
                                    f"coordinator for a fleet requiring chunk size {chunk_size}")
        return got

    def register(self, req: W.RegisterRequest, now: float | None = None) -> tuple[str, bool]:
        """``POST /instances``: (instance_id, re_registered). ChunkSizeConflict from ``chunk_size``."""
        now = time.time() if now is None else now
        instance_id = req.instance_id or f"mp-{uuid.uuid4().hex}"
        if req.chunk_size is not None:
            self.bind_chunk_size(req.chunk_size)
        info = {"instance_id": instance_id, "ip": req.ip, "http_port": req.http_port, "registration_time": now,
                "metadata": req.metadata, "p2p_advertised_url": req.p2p_advertised_url, "mq_port": req.mq_port}
        existed = self._register(keys=[K.MP], args=[instance_id, json.dumps(info), int(now * 1000)])
        self._replicated()
        return instance_id, bool(existed)

    def heartbeat(self, instance_id: str, now: float | None = None) -> bool:
        """``PUT /instances/{id}/heartbeat``: False for an unknown id (404)."""
        now = time.time() if now is None else now
        return bool(self._heartbeat(keys=[K.mp_heartbeats_key(), K.mp_instances_key()],
                                    args=[instance_id, int(now * 1000)]))

    def deregister(self, instance_id: str, now: float | None = None) -> None:
        """``DELETE /instances/{id}``: registration, L1 placements, cursor and capacity go (any id)."""
        now = time.time() if now is None else now
        self._depart(keys=[K.MP], args=[instance_id, int(now * 1000), "1", ""])
        self._replicated()

    def reap(self, now: float | None = None) -> list[str]:
        """Depart every instance silent for ``instance_timeout_s`` (its capacity stays); the ids reaped."""
        now = time.time() if now is None else now
        cutoff = int((now - self.instance_timeout_s) * 1000)
        gone = []
        for inst in self.r.zrangebyscore(K.mp_heartbeats_key(), "-inf", f"({cutoff}"):
            if self._depart(keys=[K.MP], args=[inst, int(now * 1000), "0", cutoff]):
                gone.append(inst)
        return gone

    def instances(self) -> list[dict]:
        """``GET /instances``: every registration, as the coordinator lists it."""
        out = []
        for _, raw in sorted(self.r.hgetall(K.mp_instances_key()).items()):
            info = json.loads(raw)
            out.append({k: info[k] for k in ("instance_id", "ip", "http_port", "registration_time", "metadata",
                                              "p2p_advertised_url", "mq_port")})
        return out

    def live_instances(self, now: float | None = None) -> dict[str, float]:
        """instance_id -> last heartbeat (unix s) of instances heard within the timeout."""
        now = time.time() if now is None else now
        cutoff = (now - self.instance_timeout_s) * 1000
        return {m: s / 1000 for m, s in self.r.zrangebyscore(K.mp_heartbeats_key(), cutoff, "+inf", withscores=True)}

    def cursors(self) -> dict[str, dict]:
        """instance_id -> gate cursor {incarnation, last_seq, gap_detected, events_dropped, missing_batches,
        delivery_delay_s}."""
        out = {}
        for inst, raw in self.r.hgetall(K.mp_cursors_key()).items():
            f = raw.split("\t")
            out[inst] = {"incarnation": int(f[0]), "last_seq": int(f[1]), "gap_detected": f[2] == "1",
                         "events_dropped": int(f[4]), "missing_batches": int(f[5]),
                         "delivery_delay_s": int(f[6]) / 1000 if len(f) > 6 and f[6] else None}
        return out

    def departed(self) -> dict[str, dict]:
        """instance_id -> {incarnation, reason (deregistered | timed_out), at (unix s)} of departed instances."""
        out = {}
        for inst, raw in self.r.hgetall(K.mp_departed_key()).items():
            inc, reason, at = raw.split("\t")
            out[inst] = {"incarnation": int(inc), "reason": reason, "at": int(at) / 1000}
        return out

    def capacity(self) -> dict[str, dict]:
        """instance_id -> {incarnation, revision, modules: [{tier, backend, shared, capacity_bytes}]}."""
        out = {}
        for inst, raw in self.r.hgetall(K.mp_capacity_key()).items():
            inc, rev, mods = raw.split("\t", 2)
            modules = []
            for m in filter(None, mods.split(";")):
                tier, backend, shared, cap = m.split(",")
                modules.append({"tier": tier, "backend": backend, "shared": shared == "1", "capacity_bytes": int(cap)})
            out[inst] = {"incarnation": int(inc), "revision": int(rev), "modules": modules}
        return out

    # -- ingest --------------------------------------------------------------------------

    def apply(self, batches: Sequence[W.CacheEventBatch], now: float | None = None) -> dict[str, int]:
        """``POST /events``: gate and apply every batch in one atomic script; {applied, duplicates, stale}."""
        now = time.time() if now is None else now
        args: list = [int(now * 1000), len(batches)]
        known = self._names
        for b in batches:
            args += [b.instance_id, b.incarnation, b.seq, b.event_type, b.tier, b.backend, int(b.shared),
                     b.dropped_events, int(b.ts * 1000), b.capacity_bytes, b.capacity_revision, 0]
            store = b.event_type == "store"
            parts = []
            for e in b.entries:
                k = e.key
                raw = bytes.fromhex(k.chunk_hash_hex)
                tokens = tokens_text(e.token_ids, e.token_offset) if store and e.token_ids else ""
                space = f"{k.model_name}\t{k.cache_salt}\t{k.kv_rank}\t{k.object_group_id}"
                sid = known.get("n:s" + space)
                parts.append(f"{K.mp_bucket(raw.hex())}\x1f{_b64(raw)}\x1f{sid or space}\x1f{e.size_bytes}"
                             f"\x1f{tokens}")
            args[-1:] = [len(b.entries), "\x1e".join(parts)]
        applied, dup, stale = self._apply(keys=[K.MP], args=args)
        self._replicated()
        self._index_blend(batches)
        stored = {space_text(e.key) for b in batches if b.event_type == "store" for e in b.entries}
        fresh = [t for t in stored if "n:s" + t not in known]
        if fresh:
            self.space_ids(fresh)  # the next batches pass their ids
        return {"applied": int(applied), "duplicates": int(dup), "stale": int(stale)}

    # -- names ---------------------------------------------------------------------------

    def _reverse(self, kind: str, ids: Iterable[str]) -> dict[str, str]:
        want = {i for i in ids if f"r:{kind}{i}" not in self._names}
        if want:
            order = sorted(want)
            for i, text in zip(order, self.r.hmget(K.mp_names_key(), [f"r:{kind}{i}" for i in order]), strict=True):
                if text is not None:
                    self._names[f"r:{kind}{i}"] = text
        return {i: self._names.get(f"r:{kind}{i}", "") for i in ids}

    def space_ids(self, texts: Sequence[str]) -> list[str | None]:
        """Interned ids of space texts (None where never stored)."""
        missing = [t for t in texts if f"n:s{t}" not in self._names]
        if missing:
            for t, sid in zip(missing, self.r.hmget(K.mp_names_key(), [f"n:s{t}" for t in missing]), strict=True):
                if sid is not None:
                    self._names[f"n:s{t}"] = sid
        return [self._names.get(f"n:s{t}") for t in texts]

    def all_spaces(self, fresh: bool = True) -> dict[str, str]:
        """space id -> space text of every space ever stored (fresh=False: a list up to
        :data:`UNBOUND_RECHECK_S` old will do; spaces are only ever added)."""
        at, known = self._spaces
        if not fresh and time.monotonic() - at < UNBOUND_RECHECK_S:
            return known
        ids = (self.r.hget(K.mp_names_key(), "sps") or "").split(",")
        spaces = {i: t for i, t in self._reverse("s", [i for i in ids if i]).items()}
        self._spaces = (time.monotonic(), spaces)
        return spaces

    def placements(self, recs: Iterable[Record]) -> dict[tuple[str, str], dict]:
        """(tb, epoch) -> a placement dict skeleton (instance_id, incarnation, tier, backend, shared)."""
        pairs = {(tb, ep) for r in recs for tb, ep, _ in r.placements}
        tbs = self._reverse("t", {tb for tb, _ in pairs})
        eps = self._reverse("e", {ep for _, ep in pairs})
        iids = self._reverse("i", {eps[ep].split("\t")[0] for _, ep in pairs if eps[ep]})
        out = {}
        for tb, ep in pairs:
            tier, backend, shared = tbs[tb].split("\t")
            iid, inc = eps[ep].split("\t")
            out[(tb, ep)] = {"instance_id": iids[iid], "incarnation": int(inc), "tier": tier, "backend": backend,
                             "shared": shared == "1"}
        return out

    # -- queries -------------------------------------------------------------------------

    def records(self, refs: Sequence[tuple[str, str]]) -> list[Record | None]:
        """The records of (bucket, field) refs, in order (one pipelined HGET each)."""
        if not refs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for bucket, fld in refs:
            pipe.hget(K.mp_chunks_key(bucket), fld)
        return [parse_record(v) if v else None for v in pipe.execute()]

    def token_bindings(self, refs: Sequence[tuple[str, str]]) -> list[tuple[list[int], int]]:
        if not refs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for bucket, b64 in refs:
            pipe.hget(K.mp_chunks_key(bucket), b64)
        return [parse_tokens(v) for v in pipe.execute()]

    def lookup_keys(self, keys: Sequence[W.EncodedObjectKey]) -> list[dict]:
        """``POST /directory/lookup`` results for object keys (validated), in order: one pipelined
        read of every key's record and its chunk's token binding (shown for every key of a chunk,
        stored or not, as the coordinator does)."""
        sids = self.space_ids([space_text(k) for k in keys])
        refs = [(K.mp_bucket(canon(k.chunk_hash_hex)), chunk_b64(k.chunk_hash_hex)) for k in keys]
        pipe = self.r.pipeline(transaction=False)
        for (bucket, b64), sid in zip(refs, sids, strict=True):
            pipe.hmget(K.mp_chunks_key(bucket), [f"{b64}.{sid or 0}", b64])  # space 0 never exists
        got = pipe.execute()
        recs = [parse_record(v) if v else None for v, _ in got]
        tokens = [parse_tokens(t)[0] for _, t in got]
        pmap = self.placements(r for r in recs if r)
        out = []
        for key, rec, toks in zip(keys, recs, tokens, strict=True):
            if rec is None:
                out.append({"key": _key_dict(key), "placements": [], "token_ids": toks, "access_count": 0})
                continue
            pls = sorted((dict(pmap[(tb, ep)], size_bytes=sz) for tb, ep, sz in rec.placements),
                         key=lambda p: (p["instance_id"], p["tier"], p["backend"]))
            out.append({"key": _key_dict(key), "placements": [_placement(p) for p in pls],
                        "token_ids": toks, "access_count": rec.access_count})
        return out

    def keys_for_tokens(self, token_ids: Sequence[int], model_name: str, world_size: int = 1,
                        cache_salt: str = "") -> tuple[int, list[W.EncodedObjectKey]]:
        """(complete chunks, object keys) the coordinator resolves for a token sequence: chunk-major, then
        rank, in group 0; then stored keys of the same chunks in other groups."""
        hashes = mphash.chunk_hashes_hex(token_ids, self.chunk_size())
        ranks = [mphash.kv_rank(world_size, r) for r in range(world_size)]
        keys = [W.EncodedObjectKey(chunk_hash_hex=h, model_name=model_name, kv_rank=kr, cache_salt=cache_salt)
                for h in hashes for kr in ranks]
        extra = [(sid, int(g), int(kr)) for sid, text in self.all_spaces(fresh=False).items()
                 for m, s, kr, g in [text.split("\t")] if m == model_name and s == cache_salt and g != "0"
                 and int(kr) in ranks]
        if extra:
            refs = [(h, sid, g, kr) for h in hashes for sid, g, kr in extra]
            recs = self.records([(K.mp_bucket(h), f"{chunk_b64(h)}.{sid}") for h, sid, _, _ in refs])
            keys += [W.EncodedObjectKey(chunk_hash_hex=h, model_name=model_name, kv_rank=kr, object_group_id=g,
                                        cache_salt=cache_salt)
                     for (h, _, g, kr), rec in zip(refs, recs, strict=True) if rec]
        return len(hashes), keys

    def list_keys(self, tier: str = "all", instance_id: str = "", backend: str = "", offset: int = 0,
                  limit: int = 1000) -> dict:
        """``GET /directory/keys``: {total, keys: [{key, placements (matching), num_tokens, access_count}]},
        insertion order (walks the key pages: O(keys), like the coordinator)."""
        top = int(self.r.hget(K.mp_stats_key(), "kseq") or 0)
        pipe = self.r.pipeline(transaction=False)
        pages = range(top // K.MP_PAGE + 1)
        for p in pages:
            pipe.hgetall(K.mp_page_key(p))
        refs: list[tuple[int, str]] = []
        for p, page in zip(pages, pipe.execute(), strict=True):
            refs += sorted((p * K.MP_PAGE + int(slot), ref) for slot, ref in page.items())
        bh = K.MP_BUCKET_HEX
        recs = self.records([(ref[:bh], ref[bh:]) for _, ref in refs])
        pmap = self.placements(r for r in recs if r)
        spaces = self.all_spaces()
        rows = []
        for (_, ref), rec in zip(refs, recs, strict=True):
            if rec is None:
                continue
            pls = [dict(pmap[(tb, ep)], size_bytes=sz) for tb, ep, sz in rec.placements]
            pls = [p for p in pls if (tier == "all" or p["tier"] == tier)
                   and (not instance_id or p["instance_id"] == instance_id)
                   and (not backend or p["backend"] == backend)]
            if pls:
                rows.append((ref, rec, pls))
        page_rows = rows[offset:offset + limit]
        tokens = self.token_bindings([(ref[:bh], ref[bh:].rsplit(".", 1)[0]) for ref, _, _ in page_rows])
        out = []
        for (ref, rec, pls), (toks, _) in zip(page_rows, tokens, strict=True):
            b64, sid = ref[bh:].rsplit(".", 1)
            model, salt, kr, group = spaces[sid].split("\t")
            key = {"chunk_hash_hex": chunk_hex(b64), "model_name": model, "kv_rank": int(kr),
                   "object_group_id": int(group), "cache_salt": salt}
            out.append({"key": key, "placements": [_placement(p) for p in pls], "num_tokens": len(toks),
                        "access_count": rec.access_count})
        return {"total": len(rows), "keys": out}

    def stats(self) -> dict:
        """``GET /directory/stats`` (``blend`` counts what kvlookup's blend index holds)."""
        s = self.r.hgetall(K.mp_stats_key())
        n = {k: int(v) for k, v in s.items()}
        by_inst = {k[4:]: v for k, v in n.items() if k.startswith("l1k:") and v}
        return {"num_keys": n.get("keys", 0), "num_placements": n.get("placements", 0),
                "l1_keys_by_instance": dict(sorted(by_inst.items())),
                "blend": {"num_contents": 0, "num_chunks": 0, "num_claims": 0, "num_namespaces": 0, "table_size": 0},
                "l1_count": n.get("l1_count", 0), "l1_size_bytes": n.get("l1_bytes", 0),
                "l2_count": n.get("l2_count", 0), "l2_size_bytes": n.get("l2_bytes", 0)}

    def prefix_matches(self, tokens: Sequence[int], model_name: str, world_size: int = 1,
                       cache_salt: str = "", now: float | None = None) -> list[tuple[str, int, dict[str, int]]]:
        """For ``POST /lookup``: per live MP instance ``(instance_id, matched_prefix_length,
        tokens per location)`` where location is ``<tier>/<backend>``.

        A chunk counts for an instance when every rank ``0..world_size-1`` of it is placed by
        that instance (or in a shared pool the instance's config batches declared); the match
        is the longest run of counted chunks from token 0. Instances not heard within the
        timeout count for nothing. ValueError for token ids MP cannot hash.
        """
        cs = self.chunk_size()
        hashes = mphash.chunk_hashes_hex(tokens, cs)
        ranks = [mphash.kv_rank(world_size, r) for r in range(world_size)]
        sids = self.space_ids([f"{model_name}\t{cache_salt}\t{kr}\t0" for kr in ranks])
        live = self.live_instances(now)
        if not hashes or None in sids or not live:
            return []
        refs = [(K.mp_bucket(h), f"{chunk_b64(h)}.{sid}") for h in hashes for sid in sids]
        recs = self.records(refs)
        pmap = self.placements(r for r in recs if r)
        shared_by = self._shared_pools(live)
        n = len(ranks)
        # per instance: per chunk, the locations every rank holds (None: some rank lacks it)
        run: dict[str, int] = {inst: 0 for inst in live}
        locs: dict[str, dict[str, int]] = {inst: {} for inst in live}
        open_ = set(live)
        for c in range(len(hashes)):
            held: dict[str, list[set[str]]] = {}
            for r in range(n):
                rec = recs[c * n + r]
                for tb, ep, _ in rec.placements if rec else ():
                    p = pmap[(tb, ep)]
                    loc = f"{p['tier']}/{p['backend']}"
                    owners = shared_by.get((p["tier"], p["backend"]), ()) if p["shared"] else (p["instance_id"],)
                    for inst in owners:
                        if inst in open_:
                            held.setdefault(inst, [set() for _ in range(n)])[r].add(loc)
            for inst in list(open_):
                per_rank = held.get(inst)
                if not per_rank or not all(per_rank):
                    open_.discard(inst)
                    continue
                run[inst] = c + 1
                common = set.intersection(*per_rank) or per_rank[0]
                for loc in common:
                    locs[inst][loc] = locs[inst].get(loc, 0) + cs
            if not open_:
                break
        return [(inst, run[inst] * cs, locs[inst]) for inst in live if run[inst]]

    #: chunk sizes tried when explaining a miss (another fleet's size stored the prompt)
    OTHER_CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)

    def explain(self, tokens: Sequence[int], model_name: str, world_size: int = 1, cache_salt: str = "",
                now: float | None = None) -> dict:
        """``/lookup/explain`` for MP instances: per MP instance known to the directory (registered,
        with a cursor, or departed) its matched prefix and the causes that can shorten it:
        ``departed`` (deregistered or timed out), ``not_live`` (no heartbeat within the timeout),
        ``incarnation_changed`` (it restarted: its L1 placements were dropped), ``gap`` (a seq jump
        or dropped events: the index may be incomplete for it), ``other_namespace`` (chunk 0 of the
        prompt is stored by it under another model_name, cache_salt or world size) and
        ``other_chunk_size`` (stored at another chunk size)."""
        now = time.time() if now is None else now
        cs = self.chunk_size()
        found = {inst: n for inst, n, _ in self.prefix_matches(tokens, model_name, world_size, cache_salt, now)}
        live = self.live_instances(now)
        registered = {i["instance_id"] for i in self.instances()}
        cursors, departed = self.cursors(), self.departed()
        hashes = mphash.chunk_hashes_hex(tokens, cs)
        first = self._chunk0_placements(hashes[0]) if hashes else []
        out: dict[str, dict] = {}
        for inst in sorted(registered | set(cursors) | set(departed) | set(found)):
            causes: list[dict] = []
            if inst in departed:
                causes.append({"cause": "departed", **departed[inst]})
            elif inst not in live:
                causes.append({"cause": "not_live", "timeout_s": self.instance_timeout_s})
            cur = cursors.get(inst)
            if cur and cur["gap_detected"]:
                causes.append({"cause": "gap", "missing_batches": cur["missing_batches"],
                               "events_dropped": cur["events_dropped"], "incarnation": cur["incarnation"]})
            mine = [(space, p) for space, p in first if p["instance_id"] == inst]
            if cur and any(p["tier"] == "l2" and p["incarnation"] < cur["incarnation"] for _, p in mine):
                causes.append({"cause": "incarnation_changed", "incarnation": cur["incarnation"]})
            wanted = {(model_name, cache_salt, world_size)}
            others = sorted({sp for sp, _ in mine} - wanted)
            causes += [{"cause": "other_namespace", "model_name": m, "cache_salt": s, "world_size": w}
                       for m, s, w in others]
            if not found.get(inst) and not mine:
                causes += [{"cause": "other_chunk_size", "chunk_size": size}
                           for size in self._sizes_holding(tokens, inst, cs)]
            out[inst] = {"matched_prefix_length": found.get(inst, 0), "causes": causes}
        return {"model_name": model_name, "world_size": world_size, "cache_salt": cache_salt, "chunk_size": cs,
                "chunks": len(hashes), "instances": out}

    def _chunk0_placements(self, h: str) -> list[tuple[tuple[str, str, int], dict]]:
        """Every placement of chunk ``h`` in any space: ((model, salt, world size), placement)."""
        spaces = self.all_spaces()
        refs = [(K.mp_bucket(h), f"{chunk_b64(h)}.{sid}") for sid in spaces]
        recs = self.records(refs)
        pmap = self.placements(r for r in recs if r)
        out = []
        for sid, rec in zip(spaces, recs, strict=True):
            if rec:
                m, salt, kr, _ = spaces[sid].split("\t")
                out += [((m, salt, mphash.world_size_of(int(kr))), pmap[(tb, ep)]) for tb, ep, _ in rec.placements]
        return out

    def _sizes_holding(self, tokens: Sequence[int], inst: str, bound: int) -> list[int]:
        out = []
        for size in self.OTHER_CHUNK_SIZES:
            if size != bound and len(tokens) >= size:
                h = mphash.chunk_hashes_hex(tokens[:size], size)[0]
                if any(p["instance_id"] == inst for _, p in self._chunk0_placements(h)):
                    out.append(size)
        return out

    def _shared_pools(self, live: dict[str, float]) -> dict[tuple[str, str], list[str]]:
        """(tier, backend) of each shared pool -> the live instances whose capacity declares it."""
        out: dict[tuple[str, str], list[str]] = {}
        for inst, decl in self.capacity().items():
            if inst in live:
                for m in decl["modules"]:
                    if m["shared"]:
                        out.setdefault((m["tier"], m["backend"]), []).append(inst)
        return out

    # -- blend (non-prefix) index ----------------------------------------------------------

    def _blend_ns(self, model: str, salt: str, world_size: int, create: bool) -> str | None:
        text = f"{model}\t{salt}\t{world_size}"
        nid = self._names.get("n:b" + text)
        if nid is None:
            nid = self.r.hget(K.mp_names_key(), "n:b" + text)
            if nid is None and create:
                new = self.r.hincrby(K.mp_names_key(), "seq:b", 1)
                self.r.hsetnx(K.mp_names_key(), "n:b" + text, new)
                nid = self.r.hget(K.mp_names_key(), "n:b" + text)
            if nid is not None:
                self._names["n:b" + text] = nid
        return nid

    def _index_blend(self, batches: Sequence[W.CacheEventBatch]) -> None:
        """Index every store entry whose token binding is one whole chunk at a known offset."""
        cs = self.chunk_size()
        todo: dict[str, dict[str, set[str]]] = {}
        for b in batches:
            if b.event_type != "store":
                continue
            for e in b.entries:
                if len(e.token_ids) != cs or e.token_offset < 0 or not tokens_text(e.token_ids, 0):
                    continue
                k = e.key
                nid = self._blend_ns(k.model_name, k.cache_salt, mphash.world_size_of(k.kv_rank), create=True)
                if nid is None:  # pragma: no cover (create=True always names one)
                    continue
                fp = _fingerprint(array("I", e.token_ids).tobytes())
                todo.setdefault(nid, {}).setdefault(fp, set()).add(f"{chunk_b64(canon(k.chunk_hash_hex))},"
                                                                    f"{e.token_offset}")
        for nid, fps in todo.items():
            key = K.mp_blend_key(nid)
            old = dict(zip(fps, self.r.hmget(key, list(fps)), strict=True))
            new = {}
            for fp, claims in fps.items():
                have = set(filter(None, (old[fp] or "").split(";")))
                if not claims <= have:
                    new[fp] = ";".join(sorted(have | claims))
            if new:
                self.r.hset(key, mapping=new)

    def blend_matches(self, tokens: Sequence[int], model_name: str, world_size: int = 1,
                      cache_salt: str = "") -> list[dict]:
        """``POST /directory/blend-lookup``: every stored chunk (of this model, salt and world size)
        whose tokens occur anywhere in ``tokens``: ``[{"chunk_hash", "old_st", "cur_st"}]`` sorted by
        ``cur_st`` (old_st: its offset where it was stored). Windows of chunk-size tokens at every
        position are fingerprinted, then each candidate is checked token by token against its
        binding, and kept only while a key of that namespace still holds the chunk."""
        cs = self.chunk_size()
        nid = self._blend_ns(model_name, cache_salt, world_size, create=False)
        if nid is None or len(tokens) < cs:
            return []
        try:
            data = array("I", tokens).tobytes()
        except OverflowError:
            return []
        fps = [_fingerprint(data[4 * p:4 * (p + cs)]) for p in range(len(tokens) - cs + 1)]
        hits = self.r.hmget(K.mp_blend_key(nid), fps)
        cands = [(p, claim) for p, h in enumerate(hits) if h for claim in h.split(";")]
        if not cands:
            return []
        chunks = sorted({c.split(",")[0] for _, c in cands})
        bind = dict(zip(chunks, self.token_bindings([(K.mp_bucket(chunk_hex(c)), c) for c in chunks]), strict=True))
        sids = [sid for sid, text in self.all_spaces().items()
                for m, s, kr, _ in [text.split("\t")] if m == model_name and s == cache_salt
                and mphash.world_size_of(int(kr)) == world_size]
        refs = [(c, sid) for c in chunks for sid in sids]
        recs = self.records([(K.mp_bucket(chunk_hex(c)), f"{c}.{sid}") for c, sid in refs])
        held = {c for (c, _), rec in zip(refs, recs, strict=True) if rec}
        out = []
        for p, claim in cands:
            c, off = claim.split(",")
            if c in held and bind[c][0] == list(tokens[p:p + cs]):
                out.append({"chunk_hash": chunk_hex(c), "old_st": int(off), "cur_st": p})
        return sorted(out, key=lambda m: m["cur_st"])

    def counters(self) -> dict[str, int]:
        """Ingest counters: batches_applied/duplicate/stale/missing, events_dropped."""
        s = self.r.hgetall(K.mp_stats_key())
        return {k: int(s.get(k, 0)) for k in ("batches_applied", "batches_duplicate", "batches_stale",
                                              "batches_missing", "events_dropped")}


def _fingerprint(window: bytes) -> str:
    """The blend index's fingerprint of one chunk's tokens (little-endian uint32 bytes)."""
    return blake3(window).digest(8).hex()


def _key_dict(key: W.EncodedObjectKey) -> dict:
    return {"chunk_hash_hex": key.chunk_hash_hex, "model_name": key.model_name, "kv_rank": key.kv_rank,
            "object_group_id": key.object_group_id, "cache_salt": key.cache_salt}


def _placement(p: dict) -> dict:
    return {"instance_id": p["instance_id"], "incarnation": p["incarnation"], "tier": p["tier"],
            "backend": p["backend"], "size_bytes": p["size_bytes"], "shared": p["shared"]}
