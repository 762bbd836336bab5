"""The LMCache MP directory's key endpoints: ``POST /directory/lookup``, the keys of a token
sequence, ``GET /directory/keys`` (walks the key pages ``keys.mp_page_key``) and ``GET
/directory/stats`` (``keys.mp_stats_key``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec
from redis.cluster import RedisCluster

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index import mp_copies, mp_records
from kvlookup.index import mp_scripts as S
from kvlookup.index.cluster_io import ClusterIO
from kvlookup.index.copies import MISS
from kvlookup.index.io import SingleIO, raise_errors
from kvlookup.index.mp_records import MPRecords, needs_redis
from kvlookup.index.mp_values import (
    canon,
    chunk_b64,
    chunk_hex,
    key_dict,
    many_b64,
    parse_record,
    parse_tokens,
    placement_dict,
    raw_b64,
    space_text,
)
from kvlookup.index.records import CommandIO
from kvlookup.wire import lmcache_mp as W

_MAKE = threading.Lock()  # bucket_reads made once per directory


class MPQueries(MPRecords):
    """The key endpoints of :class:`kvlookup.index.mp.MPDirectory`."""

    def lookup_keys(self, keys: Sequence[W.EncodedObjectKey]) -> list[dict]:
        """``POST /directory/lookup`` results for object keys (validated), in order: one read
        (:meth:`bucket_fields`) of every key's record and its chunk's token binding (shown for every key of a chunk,
        stored or not, as the coordinator does)."""
        sids = self.space_ids([space_text(k) for k in keys])
        refs = [(K.mp_bucket(canon(k.chunk_hash_hex)), chunk_b64(k.chunk_hash_hex)) for k in keys]
        flat = self.bucket_fields([(bucket, (f"{b64}.{sid or 0}", b64))  # space 0 never exists
                                   for (bucket, b64), sid in zip(refs, sids, strict=True)])
        recs = [parse_record(v) if v else None for v in flat[0::2]]
        tokens = [parse_tokens(t)[0] for t in flat[1::2]]
        pmap = self.placements(r for r in recs if r)
        out = []
        for key, rec, toks in zip(keys, recs, tokens, strict=True):
            if rec is None:
                out.append({"key": key_dict(key), "placements": [], "token_ids": toks, "access_count": 0})
                continue
            pls = sorted((dict(pmap[(tb, ep)], size_bytes=sz) for tb, ep, sz in rec.placements),
                         key=lambda p: (p["instance_id"], p["tier"], p["backend"]))
            out.append({"key": key_dict(key), "placements": [placement_dict(p) for p in pls],
                        "token_ids": toks, "access_count": rec.access_count})
        return out

    def lookup_tokens_json(self, token_ids: Sequence[int] | memoryview, model_name: str, world_size: int = 1,
                           cache_salt: str = "", memo: dict | None = None) -> bytes:
        """``POST /directory/lookup`` in the tokens form, answered as JSON bytes: exactly
        ``{"chunks": n, "results": lookup_keys(keys_for_tokens(...))}`` but with no object per
        key (the per-key JSON is assembled from fragments: ~3x cheaper at 32k tokens). Falls back
        to that general path when the model also stores keys in other object groups. ValueError
        for token ids MP cannot hash. ``token_ids``: the ids, or a memoryview of them packed as
        big-endian uint32 (kvlookup.wire.mp_tokens). memo: a dict kept between two tries of the same
        request (the event loop's, then a thread's: app.asgi), so the ids are hashed once."""
        hashes = memo.get("hashes") if memo is not None else None
        if hashes is None:
            cs = self.chunk_size()
            hashes = (mphash.chunk_hashes_packed(token_ids, cs) if isinstance(token_ids, memoryview)
                      else mphash.chunk_hashes(token_ids, cs))
            if memo is not None:
                memo["hashes"] = hashes
        ranks = [mphash.kv_rank(world_size, r) for r in range(world_size)]
        if any(m == model_name and s == cache_salt and g != "0" and int(kr) in ranks
               for m, s, kr, g in (t.split("\t") for t in self.all_spaces(fresh=False).values())):
            ids = mphash.unpack_ids(token_ids) if isinstance(token_ids, memoryview) else token_ids
            chunks, keys = self.keys_for_tokens(ids, model_name, world_size, cache_salt)
            return msgspec.json.encode({"chunks": chunks, "results": self.lookup_keys(keys)}) + b"\n"
        sids = [sid or "0" for sid in self.space_ids([f"{model_name}\t{cache_salt}\t{kr}\t0" for kr in ranks])]
        hexes = [h.hex() for h in hashes]
        flat = self.lookup_fields(hashes, hexes, sids, copy=not (memo and memo.get(mp_copies.NO_COPY)))
        n = len(ranks)
        frags = self._placement_json({v.partition("|")[2] for r in range(n) for v in flat[r::n + 1] if v})
        # per rank the text between a chunk's hash and its placements: the rest of its key
        mids = ['",' + msgspec.json.encode({"model_name": model_name, "kv_rank": kr, "object_group_id": 0,
                                            "cache_salt": cache_salt})[1:].decode() + ',"placements":[' for kr in ranks]
        ends: dict[str, str] = {}  # a record less its key id -> the rest of its item (this call only)
        items = []  # each result item less its opening '{"key":{"chunk_hash_hex":"' (the join's separator)
        for i, h in enumerate(hexes):
            base = i * (n + 1)
            binding = flat[base + n]
            for r in range(n):
                value = flat[base + r]
                tail = value[value.find(",") + 1:]  # "<access count>|<placements>"; '' when not stored
                known = None if binding else ends.get(tail)
                if known is None:
                    known = self._item_end(tail, frags, binding)
                    if not binding:
                        ends[tail] = known
                items.append(f"{h}{mids[r]}{known}")
        head = '{"key":{"chunk_hash_hex":"'
        return f'{{"chunks":{len(hashes)},"results":[{head if items else ""}{("," + head).join(items)}]}}\n'.encode()

    @staticmethod
    def _item_end(tail: str, frags: dict[str, str], binding: str) -> str:
        """A result item from its placements on: ``<placements>],"token_ids":[...],"access_count":n}``
        for a record's ``<access count>|<placements>`` (``tail``, '' when not stored)."""
        acc, _, rest = tail.partition("|")
        toks = msgspec.json.encode(parse_tokens(binding)[0]).decode() if binding else "[]"
        return f'{frags[rest] if tail else ""}],"token_ids":{toks},"access_count":{acc or 0}}}'

    def lookup_fields(self, hashes: Sequence[bytes], hexes: Sequence[str], sids: Sequence[str],
                      copy: bool = True) -> list[str]:
        """Per chunk (its digest in ``hashes``, its hex in ``hexes``): its records in the spaces ``sids``
        then its token binding, flat (``len(sids) + 1`` values a chunk), '' where missing.
        One round trip (scripts.MP_READ_CHUNKS, one call per READ_SLICE chunks, pipelined;
        hiredis packs the arguments: ~0.2 ms less than redis-py's Script at 128 chunks); with bucket
        copies (:meth:`bucket_reads`) from them, and one round trip only for the buckets not copied
        (handed to the copier unless ``copy`` is False). ``sids``: space 0 never exists."""
        reads = self.bucket_reads()
        if reads is not None:
            return self._copied_fields(reads, hashes, hexes, sids, copy)
        needs_redis()
        return self._chunk_fields(hashes, hexes, sids)

    def _chunk_fields(self, hashes: Sequence[bytes], hexes: Sequence[str], sids: Sequence[str]) -> list[str]:
        """:meth:`lookup_fields` from Redis (scripts.MP_READ_CHUNKS)."""
        io = self.mp_io()
        sha = io.register(S.MP_READ_CHUNKS)
        calls, step = [], mp_records.READ_SLICE
        for i in range(0, len(hashes), step):
            part = range(i, min(i + step, len(hashes)))
            calls.append(("EVALSHA", sha, len(part), *(K.mp_chunks_key(K.mp_bucket(hexes[j])) for j in part),
                          len(sids), *sids, *(raw_b64(hashes[j]) for j in part)))
        return [v for got in raise_errors(io.execute(calls)) for v in got]

    def _copied_fields(self, reads, hashes: Sequence[bytes], hexes: Sequence[str], sids: Sequence[str],
                       copy: bool = True) -> list[str]:
        """:meth:`lookup_fields` from whole-bucket copies (kvlookup.index.mp_copies): a record or
        binding a complete copy lacks is not stored. The chunks of buckets not copied are read as
        without copies (one script call) and their buckets handed to the copier. Under
        LOCAL_ONLY, NeedsRedis when a bucket is not copied (nothing sent)."""
        prefix, bh = K.mp_chunks_prefix(), K.MP_BUCKET_HEX
        names = [prefix + h[:bh] for h in hexes]  # keys.mp_chunks_key(keys.mp_bucket(h)): 64 hex digits each
        order = list(dict.fromkeys(names))
        by = dict(zip(order, reads.peek([("HGETALL", k) for k in order]), strict=True))
        lacked = [k for k, v in by.items() if v is MISS]
        read: dict[int, list[str]] = {}  # chunk -> its fields read from Redis (its bucket not copied)
        if lacked:
            needs_redis()
            if copy:
                self.copier().want(lacked)
            gone = set(lacked)
            idx = [i for i, name in enumerate(names) if name in gone]
            flat = self._chunk_fields([hashes[i] for i in idx], [hexes[i] for i in idx], sids)
            m = len(sids) + 1
            read = {i: flat[j * m:(j + 1) * m] for j, i in enumerate(idx)}
        b64s = many_b64(hashes)
        out: list[str] = []
        if len(sids) == 1 and not read:  # the common case: one rank, every bucket copied
            s = "." + sids[0]
            for name, b in zip(names, b64s, strict=True):
                get = by[name].get
                out += (get(b + s, ""), get(b, ""))
            return out
        suffixes = ["." + sid for sid in sids]
        for i, (name, b) in enumerate(zip(names, b64s, strict=True)):
            fields = by[name]
            if fields is MISS:
                out += read[i]
                continue
            out += [fields.get(b + s, "") for s in suffixes]
            out.append(fields.get(b, ""))
        return out

    def copier(self) -> mp_copies.Copier:
        """The background copier of this directory's buckets (made with :meth:`bucket_reads`)."""
        return self._copier

    def bucket_reads(self):
        """The cached reads of the chunk buckets (kvlookup.index.mp_copies), made on first use;
        None without copies (``copy_fields`` 0)."""
        reads = getattr(self, "_bucket_reads", None)
        if reads is None and self.copy_fields:
            with _MAKE:
                reads = getattr(self, "_bucket_reads", None)
                if reads is None:
                    reads = mp_copies.bucket_reads(self.r, self.mp_io(), self.copy_fields, self.copy_keys,
                                                   self.copy_fence)
                    self._copier = mp_copies.Copier(reads, S.MP_READ_BUCKETS)
                    self._bucket_reads = reads
        return reads

    def reads_locally(self) -> bool:
        """Can a lookup be answered from the copies now, with no round trip (unfenced, the
        invalidation connection up)? The event loop tries only then (app.asgi)."""
        reads = self.bucket_reads()
        return reads is not None and reads.local_now()

    def mp_io(self) -> CommandIO:
        """The pipelined command IO of this directory's client (SingleIO, ClusterIO: hiredis packs
        the arguments, ~0.1 ms less than redis-py's Script at 128 chunks); kept (it holds only the client)."""
        io = getattr(self, "_io", None)
        if io is None:
            io = self._io = ClusterIO(self.r) if isinstance(self.r, RedisCluster) else SingleIO(self.r)
        return io

    def _placement_json(self, tails: set[str]) -> dict[str, str]:
        """Each distinct placements part of a record (``<tb>,<epoch>,<size>|...``, what follows the
        head) -> its ``placements`` JSON items, sorted as :meth:`lookup_keys` sorts them. The chunks of
        one prompt mostly share one such part (the same holders, tiers and size), so each distinct
        part is rendered once per call (never kept between calls)."""
        parsed = {t: [(tb, ep, int(sz)) for tb, ep, sz in (p.split(",") for p in t.split("|"))] if t else []
                  for t in tails}
        pmap = self.placement_skeletons({(tb, ep) for pls in parsed.values() for tb, ep, _ in pls})
        heads = {ref: (p["instance_id"], p["tier"], p["backend"],
                       msgspec.json.encode({k: p[k] for k in ("instance_id", "incarnation", "tier", "backend")})
                       [:-1].decode() + ',"size_bytes":', ',"shared":true}' if p["shared"] else ',"shared":false}')
                 for ref, p in pmap.items()}
        out = {}
        for t, pls in parsed.items():
            got = sorted(((heads[(tb, ep)], sz) for tb, ep, sz in pls), key=lambda x: x[0][:3])
            out[t] = ",".join(f"{hd[3]}{sz}{hd[4]}" for hd, sz in got)
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
            out.append({"key": key, "placements": [placement_dict(p) for p in pls], "num_tokens": len(toks),
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
