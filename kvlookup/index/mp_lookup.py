"""Prefix lookups over the LMCache MP directory: per live MP instance the matched prefix of a
prompt (``POST /lookup``) and why it is short (``/lookup/explain``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvlookup.hashing import mp as mphash
from kvlookup.index import keys as K
from kvlookup.index import mp_records
from kvlookup.index import mp_scripts as S
from kvlookup.index.io import raise_errors
from kvlookup.index.mp_queries import MPQueries
from kvlookup.index.mp_registry import capacity_of
from kvlookup.index.mp_values import chunk_b64, raw_b64


class MPLookup(MPQueries):
    """Prefix matches and explanations of :class:`kvlookup.index.mp.MPDirectory`."""

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
        hashes = mphash.chunk_hashes(tokens, cs)
        ranks = [mphash.kv_rank(world_size, r) for r in range(world_size)]
        sids = self.space_ids([f"{model_name}\t{cache_salt}\t{kr}\t0" for kr in ranks])
        if not hashes or None in sids:
            return []
        live, capacity, flat = self.prefix_fields(hashes, [s for s in sids if s], now)
        if not live:
            return []
        holders = self._holders({v.partition("|")[2] for v in flat if v}, self._shared_pools(live, capacity))
        n = len(ranks)
        run = dict.fromkeys(live, 0)
        credit: dict[tuple[str, ...], dict[str, list[str]]] = {}  # a chunk's placements parts -> its holders
        counts: dict[str, dict[tuple[str, ...], int]] = {inst: {} for inst in live}  # chunks credited, per parts
        open_ = set(live)
        for c in range(len(flat) // n):
            parts = tuple(v.partition("|")[2] if v else "" for v in flat[c * n:(c + 1) * n])
            held = credit.get(parts)
            if held is None:  # once per distinct parts (the chunks of a prompt mostly share one)
                held = credit[parts] = self._credit(parts, holders)
            for inst in list(open_):
                if inst not in held:
                    open_.discard(inst)
                    continue
                run[inst] = c + 1
                counts[inst][parts] = counts[inst].get(parts, 0) + 1
            if not open_:
                break
        out = []
        for inst in live:
            if run[inst]:
                locs: dict[str, int] = {}
                for parts, k in counts[inst].items():
                    for loc in credit[parts][inst]:
                        locs[loc] = locs.get(loc, 0) + k * cs
                out.append((inst, run[inst] * cs, locs))
        return out

    @staticmethod
    def _credit(parts: tuple[str, ...], holders: dict[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
        """For one chunk (its records' placements parts, one a rank; '' where none): each instance
        every rank of which it holds -> the locations all ranks share (else rank 0's)."""
        held: dict[str, list[set[str]]] = {}
        for r, rest in enumerate(parts):
            for inst, loc in holders[rest] if rest else ():
                held.setdefault(inst, [set() for _ in parts])[r].add(loc)
        return {inst: list(set.intersection(*per_rank) or per_rank[0])
                for inst, per_rank in held.items() if all(per_rank)}

    def prefix_fields(self, hashes: Sequence[bytes], sids: Sequence[str], now: float | None = None
                      ) -> tuple[dict[str, float], dict[str, dict], list[str | None]]:
        """What a prefix match reads, in one script call per READ_SLICE chunks (scripts.MP_READ_PREFIX,
        through :meth:`mp_io`): (:meth:`live_instances`, :meth:`capacity`, the records of chunks
        ``hashes`` in the spaces ``sids``, ``len(sids)`` a chunk, None where missing). The records end
        after the first chunk no space holds (a prefix cannot reach past it)."""
        cutoff = repr(self.heartbeat_cutoff_ms(now))
        io = self.mp_io()
        sha = io.register(S.MP_READ_PREFIX)
        live: dict[str, float] | None = None
        capacity: dict[str, dict] = {}
        flat: list[str | None] = []
        step = mp_records.READ_SLICE
        for i in range(0, len(hashes), step):
            part = hashes[i:i + step]
            got = raise_errors(io.execute([("EVALSHA", sha, 2 + len(part), K.mp_heartbeats_key(), K.mp_capacity_key(),
                                            *(K.mp_chunks_key(K.mp_bucket(h.hex())) for h in part),
                                            cutoff, len(sids), *sids, *map(raw_b64, part))]))[0]
            if live is None:
                live = {m: float(sc) / 1000 for m, sc in zip(got[0][0::2], got[0][1::2], strict=True)}
                capacity = capacity_of(dict(zip(got[1][0::2], got[1][1::2], strict=True)))
            flat += [v or None for v in got[2:]]
            if len(got) - 2 < len(part) * len(sids):
                break
        return live or {}, capacity, flat

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

    def _holders(self, rests: set[str],
                 shared_by: dict[tuple[str, str], list[str]]) -> dict[str, list[tuple[str, str]]]:
        """Each distinct placements part of a record (``<tb>,<epoch>,<size>|...``) -> the (instance,
        ``tier/backend``) pairs it credits, in its order; a shared placement credits every instance
        of ``shared_by`` for its pool. Rendered once per distinct part per call (chunks of one prompt
        mostly share one), never kept between calls."""
        parsed = {t: [(tb, ep) for tb, ep, _ in (p.split(",") for p in t.split("|"))] if t else [] for t in rests}
        pmap = self.placement_skeletons({pair for pls in parsed.values() for pair in pls})
        out: dict[str, list[tuple[str, str]]] = {}
        for t, pls in parsed.items():
            out[t] = []
            for pair in pls:
                p = pmap[pair]
                owners = shared_by.get((p["tier"], p["backend"]), []) if p["shared"] else [p["instance_id"]]
                out[t] += [(inst, f"{p['tier']}/{p['backend']}") for inst in owners]
        return out

    @staticmethod
    def _shared_pools(live: dict[str, float], capacity: dict[str, dict]) -> dict[tuple[str, str], list[str]]:
        """(tier, backend) of each shared pool -> the live instances whose capacity declares it."""
        out: dict[tuple[str, str], list[str]] = {}
        for inst, decl in capacity.items():
            if inst in live:
                for m in decl["modules"]:
                    if m["shared"]:
                        out.setdefault((m["tier"], m["backend"]), []).append(inst)
        return out
