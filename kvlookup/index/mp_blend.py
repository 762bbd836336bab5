"""The LMCache MP directory's blend (non-prefix) index: every stored chunk whose token binding
is one whole chunk, by a fingerprint of its tokens, per namespace (``keys.mp_blend_key``), for
``POST /directory/blend-lookup``."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index.mp_lookup import MPLookup
from kvlookup.index.mp_values import chunk_hex, fingerprint, raw_b64
from kvlookup.wire import lmcache_mp as W


class MPBlend(MPLookup):
    """The blend index of :class:`kvlookup.index.mp.MPDirectory`."""

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
                if len(e.token_ids) != cs or e.token_offset < 0:
                    continue
                try:  # ids outside uint32 have no binding (mp_values.tokens_text)
                    window = array("I", e.token_ids)
                except OverflowError:
                    continue
                k = e.key
                nid = self._blend_ns(k.model_name, k.cache_salt, mphash.world_size_of(k.kv_rank), create=True)
                if nid is None:  # pragma: no cover (create=True always names one)
                    continue
                todo.setdefault(nid, {}).setdefault(fingerprint(window.tobytes()), set()).add(
                    f"{raw_b64(bytes.fromhex(k.chunk_hash_hex))},{e.token_offset}")  # = chunk_b64(canon(...))
        for nid, fps in todo.items():  # one script a namespace (mp_scripts.MP_BLEND_ADD): no claim lost
            self._blend_add(keys=[K.mp_blend_key(nid)],
                            args=[x for fp, claims in fps.items() for x in (fp, ";".join(sorted(claims)))])

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
        fps = [fingerprint(data[4 * p:4 * (p + cs)]) for p in range(len(tokens) - cs + 1)]
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
