"""Why a lookup matched nothing, or less than expected (``POST /lookup/explain``, ``kvlookup explain``).

:meth:`Explainer.explain` reads, in three pipelined round trips and never by scanning:

1. every chunk set of the prompt's chains (as a lookup does), the first :data:`VARIANT_CHUNKS`
   chunks under every other hash profile (:func:`profile_variants`) and, for vLLM blocks, under
   the request's other namespaces; the holder descriptions and the departures log;
2. how each holder seen counts (the ``RESOLVE`` script), retirements, the workers and leases
   of the instances seen;
3. the eviction logs of the holders of each chunk where a walk stopped.

Then it walks the chains with :class:`kvlookup.index.walk.ChainWalk` (``report``) and names, per
instance, where and why its match stopped (:data:`REASONS`). The answer's shape is in
docs/operations.md ("Explaining a miss").
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from kvlookup import metrics
from kvlookup.hashing import vllm as vh
from kvlookup.hashing.lmcache import EXTRA_KEYS_MODES, HashProfile, seeded_str_hash
from kvlookup.hashing.namespace import DEFAULT, Namespace
from kvlookup.index import keys, scripts, staleness
from kvlookup.index.io import raise_errors
from kvlookup.index.records import Chain, walk_registry_keys
from kvlookup.index.walk import ChainWalk, Holder, resolved

log = logging.getLogger(__name__)

#: Instances one explanation covers at most: those reaching furthest into the prompt
#: (``instances_omitted`` counts the rest); with more than 4x this many holders in the
#: registry, instances that hold none of the prompt are not searched for recent evictions.
MAX_INSTANCES = 256
#: Chunk sizes tried for the LMCache space: LMCache's usual sizes and vLLM's block sizes.
CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Chunks read per other profile or namespace.
VARIANT_CHUNKS = 4
#: Reason codes of a stop (docs/operations.md).
REASONS = ("never_stored", "evicted", "ranks", "instance_not_alive", "worker_silent", "reaped", "deregistered",
           "new_epoch", "retired", "hash_profile", "other_namespace", "partial_chunk_not_hashed")


def iso(ms: float) -> str:
    """Unix ms as ISO 8601 UTC with milliseconds."""
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


@dataclass
class Variant:
    """Another way to hash the prompt: ``label`` its differences, ``setting`` what fixes them."""

    kind: str  # "profile" | "namespace"
    label: dict
    setting: str
    chain: Chain
    matched: dict[str, list[int]] = field(default_factory=dict)  # instance -> [chunks, tokens]


def profile_variants(profile: HashProfile, tokens: Sequence[int], hash_seed: str | None) -> list[Variant]:
    """Every other profile of :data:`CHUNK_SIZES` x NONE_HASH (0, the seed-derived one when
    ``hash_seed`` is known, the configured one) x extra keys (and sha256), whose first chunk hash
    differs from the configured profile's and from each other's; fewest differences first."""
    none_hashes = {0: "0", profile.none_hash: str(profile.none_hash)}
    if hash_seed not in (None, ""):
        none_hashes.setdefault(seeded_str_hash(str(hash_seed)), "seed")
    cands = []
    for cs in sorted({*CHUNK_SIZES, profile.chunk_size}):
        for nh in none_hashes:
            for ek in EXTRA_KEYS_MODES:
                cands.append(replace(profile, chunk_size=cs, none_hash=nh, extra_keys=ek, save_unfull_chunk=True))
        cands.append(replace(profile, chunk_size=cs, none_hash=0, extra_keys="empty", algorithm="sha256",
                             save_unfull_chunk=True))
    mine = profile.chunk_hashes(tokens[:profile.chunk_size])[:1]
    seen = set(mine)
    out = []
    for p in sorted(cands, key=lambda p: len(_differs(profile, p, none_hashes))):
        hashes = p.chunk_hashes(tokens[:p.chunk_size * VARIANT_CHUNKS])
        if not hashes or hashes[0] in seen:
            continue
        seen.add(hashes[0])
        diff = _differs(profile, p, none_hashes)
        setting = ", ".join(f"hash.{k}: {v}" for k, v in diff.items())
        end = min(len(tokens), p.chunk_size * len(hashes))
        out.append(Variant("profile", diff, setting, Chain(keys.chunk_prefix(), hashes, p.chunk_size, end)))
    return out


def _differs(mine: HashProfile, other: HashProfile, none_labels: dict[int, str]) -> dict:
    out: dict = {}
    if other.chunk_size != mine.chunk_size:
        out["chunk_size"] = other.chunk_size
    if other.algorithm == "sha256":
        if mine.algorithm != "sha256":
            out["extra_keys"] = "sha256"
        return out
    if other.none_hash != mine.none_hash:
        out["none_hash"] = none_labels.get(other.none_hash, other.none_hash)
    if other.extra_keys != mine.extra_keys or mine.algorithm == "sha256":
        out["extra_keys"] = other.extra_keys
    return out


def namespace_variants(block_sizes: Sequence[int], tokens: Sequence[int], namespace: Namespace) -> list[Variant]:
    """The request's other vLLM namespaces (base model, LoRA without salt, salt without LoRA)."""
    wanted = (namespace.lora_name, namespace.cache_salt)
    names = {(None, None), (wanted[0], None), (None, wanted[1])} - {wanted}
    out = []
    for bs in block_sizes:
        for lora, salt in sorted(names, key=str):
            hashes = vh.chain(vh.request_root(bs, lora, salt), tokens[:bs * VARIANT_CHUNKS], bs)
            if hashes:
                label = {"lora_name": lora, "cache_salt": salt}
                setting = ", ".join(f"{k}: {v!r}" for k, v in label.items() if v) or "no lora_name, no cache_salt"
                out.append(Variant("namespace", {"block_size": bs, **label}, setting,
                                   Chain(keys.chunk_prefix(keys.vllm_space(bs)), hashes, bs, bs * len(hashes))))
    return out


class Explainer:
    """Explains lookups of one :class:`kvlookup.client.Client`.

    hash_seed: the engines' PYTHONHASHSEED (``hash.hash_seed``), for the seed-derived NONE_HASH
    variant; None leaves that variant out.
    """

    def __init__(self, client, hash_seed: str | None = None):
        self.client = client
        self.hash_seed = hash_seed
        self.io = client.store.records.io
        self.resolve_sha = self.io.register(scripts.RESOLVE)

    def explain(self, tokens: Sequence[int], answer: dict, namespace: Namespace = DEFAULT,
                now_ms: int | None = None) -> dict:
        """The explanation of a lookup of ``tokens`` whose plain answer was ``answer``.

        Returns ``{"answer", "profile", "tokens", "chunks", "hashed_tokens", "instances",
        "profiles", "namespaces", "diagnosis", "cause"}`` (docs/operations.md). Raises
        redis.RedisError when Redis fails.
        """
        now_ms = self.client.store.clock.now_ms() if now_ms is None else now_ms
        prof = self.client.profile
        ns = namespace.label()
        chains = [c for c in self.client.chains(tokens, namespace) if c.hashes]
        variants = profile_variants(prof, tokens, self.hash_seed)
        variants += namespace_variants(self._block_sizes(), tokens, namespace) if ns else []
        st = _State(self, tokens, chains, variants, now_ms)
        st.read()
        entries = st.entries()
        self._add_sessions(entries)
        self._add_staleness(entries)
        out = {"answer": answer, "profile": asdict(prof), "tokens": len(tokens),
               "chunks": len(prof.chunk_bounds(len(tokens))), "hashed_tokens": prof.hashed_length(len(tokens)),
               "instances": entries,
               "profiles": [st.variant_json(v) for v in variants if v.kind == "profile" and v.matched],
               "namespaces": [st.variant_json(v) for v in variants if v.kind == "namespace" and v.matched]}
        if st.omitted:
            out["instances_omitted"] = st.omitted
        out["diagnosis"] = st.diagnosis(out)
        out["cause"] = _cause(out)
        return out

    def _add_sessions(self, entries: list[dict]) -> None:
        """vLLM ranks: the session_id of the last store that named one (``session:<rank>``)."""
        wanted = [e for e in entries if e["worker_id"] and e["space"].startswith("v")]
        if not wanted:
            return
        pipe = self.client.store.r.pipeline(transaction=False)
        for e in wanted:
            pipe.hget(keys.instance_key(e["instance_id"]), keys.rank_field("session", e["worker_id"]))
        for e, session in zip(wanted, pipe.execute(), strict=True):
            if session:
                e["session_id"] = session

    def _add_staleness(self, entries: list[dict]) -> None:
        """``possibly_stale: {since_ms, reason}`` on the entries of instances whose records may be
        missing ops (kvlookup.index.staleness: their sidecar was killed)."""
        marked = staleness.marks(self.client.store.r, sorted({e["instance_id"] for e in entries}))
        for e in entries:
            if e["instance_id"] in marked:
                e["possibly_stale"] = marked[e["instance_id"]]

    def _block_sizes(self) -> list[int]:
        from kvlookup.client import VllmChains

        return sorted({bs for s in self.client.extra_chains if isinstance(s, VllmChains) for bs in s.block_sizes()})


def _cause(out: dict) -> str:
    """One cause for the miss counter: hit, profile_mismatch_suspected, namespace, ranks,
    dead_instance, evicted, short_prompt or no_holder."""
    answer = out["answer"]
    if any(k not in ("event_id", "detail", "layout_info") for k in answer) or answer.get("layout_info"):
        return "hit"
    if out["profiles"]:
        return "profile_mismatch_suspected"
    if out["namespaces"]:
        return "namespace"
    reasons = {e["stop"]["reason"] for e in out["instances"] if e["stop"]}
    if "ranks" in reasons:
        return "ranks"
    if reasons & {"instance_not_alive", "worker_silent", "reaped", "deregistered", "new_epoch", "retired"}:
        return "dead_instance"
    if "evicted" in reasons:
        return "evicted"
    return "short_prompt" if out["chunks"] == 0 else "no_holder"


class _State:
    """One explanation's reads and walk."""

    def __init__(self, ex: Explainer, tokens, chains: list[Chain], variants: list[Variant], now_ms: int):
        self.ex, self.tokens, self.chains, self.variants, self.now = ex, tokens, chains, variants, now_ms
        self.profile = ex.client.profile

    # -- reads ---------------------------------------------------------------------------------

    def read(self) -> None:
        io = self.ex.io
        all_chains = self.chains + [v.chain for v in self.variants]
        held = self.ex.client.store.records.holders([k for c in all_chains for k in c.chunk_keys()])
        pos = 0
        self.members: list[list[list[str]]] = []
        for c in all_chains:
            self.members.append(held[pos:pos + len(c.hashes)])
            pos += len(c.hashes)
        res = raise_errors(io.execute([("HGETALL", keys.holders_key()),
                                       ("ZRANGE", keys.departures_key(), 0, -1, "WITHSCORES")]))
        self.desc = _descriptions(_pairs(res[0]))
        self.departures = {m: float(s) for m, s in _pairs(res[1])}
        self._bound()
        hids = sorted({h for lists in self.members for ms in lists for h in ms})
        insts = sorted({self.desc[h][0] for h in hids if h in self.desc})
        workers = sorted({(self.desc[h][0], self.desc[h][1]) for h in hids if h in self.desc})
        live = self.ex.client.store.liveness(self.now)
        cmds: list[tuple] = [("EVALSHA", self.ex.resolve_sha, 6, *walk_registry_keys(), keys.registry_version_key(),
                              *live.argv(), *hids)] if hids else []
        # one ZMSCORE per sorted set, not one ZSCORE per member: linear with a small constant
        cmds += [("ZMSCORE", keys.dead_holders_key(), *hids)] if hids else []
        cmds += [("ZMSCORE", keys.alive_key(), *insts)] if insts else []
        members = [keys.worker_member(i, w) for i, w in workers]
        cmds += [("ZMSCORE", keys.heartbeats_key(), *members)] if members else []
        cmds += [("SMEMBERS", keys.instance_workers_key(i)) for i in insts]
        cmds += [("HGETALL", keys.worker_key(i, w)) for i, w in workers]
        res = raise_errors(io.execute(cmds))
        texts = res[0][1:] if hids else []
        res = res[1:] if hids else res
        self.resolved: dict[str, tuple[Holder | None, float]] = {}
        for hid, text in zip(hids, texts, strict=True):
            holder, until, _lapsed = resolved(text)
            self.resolved[hid] = (holder, until if text else 0.0)
        dead = res.pop(0) if hids else []
        alive = res.pop(0) if insts else []
        beats = res.pop(0) if members else []
        self.dead = {h: float(s) for h, s in zip(hids, dead, strict=True) if s is not None}
        self.ranks = {i: set(res[n]) for n, i in enumerate(insts)}
        self.alive = {i: _score(a) for i, a in zip(insts, alive, strict=True)}
        res = res[len(insts):]
        self.workers = {w: _dict(res[n]) for n, w in enumerate(workers)}
        self.heartbeats = {w: _score(b) for w, b in zip(workers, beats, strict=True)}
        self.counting = {h: hol for h, (hol, until) in self.resolved.items() if hol is not None and until >= self.now}
        self._walk()
        self._read_evictions()

    def _bound(self) -> None:
        """Keep the MAX_INSTANCES instances that reach furthest into the prompt (ties by id):
        the holders of the others leave the chunk lists and the registry candidates, so an
        explanation costs at most about MAX_INSTANCES instances whatever the fleet's size;
        ``self.omitted`` counts the instances left out."""
        depth: dict[str, int] = {}
        for lists in self.members:
            for i, ms in enumerate(lists):
                for h in ms:
                    d = self.desc.get(h)
                    if d and depth.get(d[0], -1) < i:
                        depth[d[0]] = i
        self.omitted = 0
        self.candidates_capped = len(self.desc) > MAX_INSTANCES * 4
        if len(depth) <= MAX_INSTANCES:
            return
        kept = set(sorted(depth, key=lambda inst: (-depth[inst], inst))[:MAX_INSTANCES])
        self.omitted = len(depth) - len(kept)
        self.members = [[[h for h in ms if h in self.desc and self.desc[h][0] in kept] for ms in lists]
                        for lists in self.members]

    def _walk(self) -> None:
        self.walks = []
        for ci, c in enumerate(self.chains):
            w = ChainWalk(c.chunk_size, c.n_tokens, report=True)
            w.feed(self.members[ci], self.counting)
            self.walks.append(w)
        base = len(self.chains)
        for vi, v in enumerate(self.variants):
            lists = self.members[base + vi]
            for inst in {self.counting[h].instance_id for h in (lists[0] if lists else []) if h in self.counting}:
                n = 0
                while n < len(lists) and any(self.counting.get(h) and self.counting[h].instance_id == inst
                                             for h in lists[n]):
                    n += 1
                v.matched[inst] = [n, min(n * v.chain.chunk_size, v.chain.n_tokens)]

    def _read_evictions(self) -> None:
        """Round 3: for each stop, the eviction logs of that instance's holders in that space."""
        self.stops: list[tuple[int, str, str, int, int, set | None]] = []
        for ci, w in enumerate(self.walks):
            for _key, (inst, wid, upto, end, short) in w.stops().items():
                self.stops.append((ci, inst, wid, upto, end, short))
        grouped = {(ci, inst, wid) for ci, inst, wid, *_ in self.stops}
        grouped_insts = {(ci, inst) for ci, inst, *_ in grouped}
        space_of = [c.prefix[len(keys.chunk_prefix()):].rstrip(":") for c in self.chains]
        # Indexes, so that every step below is linear in holders (issue 20: it was quadratic):
        # (instance, space) -> its holder ids; per chain, instance -> holder ids in the prompt's
        # chunk lists, and per chunk, instance -> the holder ids of that chunk.
        self.of_inst: dict[tuple[str, str], list[str]] = {}
        for hid, (inst, _w, _loc, space) in self.desc.items():
            self.of_inst.setdefault((inst, space), []).append(hid)
        self.in_chain: list[set[str]] = []
        self.at_chunk: list[list[dict[str, list[str]]]] = []
        for lists in self.members[:len(self.chains)]:
            per_chunk = []
            for ms in lists:
                by: dict[str, list[str]] = {}
                for h in ms:
                    d = self.desc.get(h)
                    if d:
                        by.setdefault(d[0], []).append(h)
                per_chunk.append(by)
            self.at_chunk.append(per_chunk)
            self.in_chain.append({inst for by in per_chunk for inst in by})
        for ci, lists in enumerate(self.members[:len(self.chains)]):  # instances that never formed a group
            for hid in {h for ms in lists for h in ms}:
                d = self.desc.get(hid)
                hol = self.resolved.get(hid, (None, 0))[0]
                wid = hol.worker_id if hol else ""
                if d and (ci, d[0], wid) not in grouped and (ci, d[0], "") not in grouped:
                    grouped.add((ci, d[0], wid))
                    grouped_insts.add((ci, d[0]))
                    self.stops.append((ci, d[0], wid, 0, 0, None))
        for ci in range(len(self.chains)):  # current holders that may have held chunk 0 recently
            if self.candidates_capped:
                break  # a large fleet: only instances holding some of the prompt are asked (bounded)
            for hid, (inst, _w, _loc, space) in self.desc.items():
                if space == space_of[ci] and hid not in self.dead and (ci, inst) not in grouped_insts:
                    grouped.add((ci, inst, ""))
                    grouped_insts.add((ci, inst))
                    self.stops.append((ci, inst, "", 0, 0, None))
        self.evict_cmds: list[tuple[int, int, str]] = []
        cmds: list[tuple] = []
        for si, (ci, inst, _wid, upto, _end, _short) in enumerate(self.stops):
            c = self.chains[ci]
            if upto >= len(c.hashes):
                continue
            for hid in self.of_inst.get((inst, space_of[ci]), ()):
                self.evict_cmds.append((si, len(cmds), hid))
                cmds.append(("ZSCORE", keys.holder_evicted_key(hid), str(c.hashes[upto])))
        res = raise_errors(self.ex.io.execute(cmds)) if cmds else []
        self.evicted: dict[int, tuple[float, str]] = {}
        for si, ri, hid in self.evict_cmds:
            if res[ri] is not None:
                t = float(res[ri])
                if si not in self.evicted or t > self.evicted[si][0]:
                    self.evicted[si] = (t, self.desc[hid][2])
        keep = []
        for si, s in enumerate(self.stops):  # a holder with no chunk of the prompt and no eviction: not listed
            ci, inst = s[0], s[1]
            if s[3] > 0 or si in self.evicted or inst in self.in_chain[ci]:
                keep.append((si, s))
        self.kept = keep

    # -- answers -------------------------------------------------------------------------------

    def entries(self) -> list[dict]:
        out = [self._entry(si, *s) for si, s in self.kept]
        have = {(e["space"], e["instance_id"]) for e in out}
        for v in self.variants:
            space = v.chain.prefix[len(keys.chunk_prefix()):].rstrip(":")
            for inst in sorted(v.matched):
                if (space, inst) in have:
                    continue
                have.add((space, inst))
                reason = "hash_profile" if v.kind == "profile" else "other_namespace"
                what = _label_text(v.label)
                unit, other = ("chunks", "hash profile") if v.kind == "profile" else ("blocks", "namespace")
                why = f"it holds this prompt's first {unit} under another {other} ({what})"
                out.append({"instance_id": inst, "worker_id": "", "space": space, "matched_prefix_length": 0,
                            "matched_chunks": 0, "stop": {"chunk": 0, "token_offset": 0,
                                                          "chunk_hash": str(self._hash0(space)), "reason": reason,
                                                          "explanation": why, "fix": v.setting}})
        return sorted(out, key=lambda e: (-e["matched_prefix_length"], e["space"], e["instance_id"], e["worker_id"]))

    def _hash0(self, space: str):
        for c in self.chains:
            if c.prefix == keys.chunk_prefix(space) and c.hashes:
                return c.hashes[0]
        return None

    def _entry(self, si: int, ci: int, inst: str, wid: str, upto: int, end: int, short) -> dict:
        c = self.chains[ci]
        space = c.prefix[len(keys.chunk_prefix()):].rstrip(":")
        entry = {"instance_id": inst, "worker_id": wid, "space": space, "matched_prefix_length": end,
                 "matched_chunks": upto, "stop": None}
        n = len(self.tokens)
        if upto >= len(c.hashes):
            if c.n_tokens < n:
                unit = "block" if space else "chunk"
                entry["stop"] = {"chunk": upto, "token_offset": c.n_tokens, "chunk_hash": None,
                                 "reason": "partial_chunk_not_hashed",
                                 "explanation": f"the remaining {n - c.n_tokens} tokens (from {c.n_tokens}) are a "
                                                f"partial {unit}, which is not hashed"}
            return entry
        start, stop_tok = upto * c.chunk_size, min((upto + 1) * c.chunk_size, c.n_tokens)
        stop = {"chunk": upto, "token_offset": start, "chunk_hash": str(c.hashes[upto])}
        where = f"chunk {upto} (tokens {start}-{stop_tok}, hash {c.hashes[upto]})"
        mine = self.at_chunk[ci][upto].get(inst, [])
        counting = [self.counting[h] for h in mine if h in self.counting]
        if short is not None and counting:
            held = sorted(short, key=_num)
            missing = sorted(self.ranks.get(inst, set()) - set(held), key=_num)
            stop.update(reason="ranks", ranks_holding=held, ranks_missing=missing,
                        explanation=f"{where} is held by rank(s) {', '.join(held)} only; rank(s) "
                                    f"{', '.join(missing)} lack it, and every TP rank must hold a chunk")
        elif mine:
            stop.update(self._not_counting(mine[0]))
        elif si in self.evicted:
            t, loc = self.evicted[si]
            stop.update(reason="evicted", at_ms=int(t), location=loc,
                        explanation=f"{where} was evicted from {loc} at {iso(t)}")
        else:
            stop.update(reason="never_stored", explanation=f"{where} was never stored there")
        entry["stop"] = stop
        return entry

    def _not_counting(self, hid: str) -> dict:
        """Why holder ``hid`` (present in the chunk's set) does not count."""
        inst, wid, loc, _space = self.desc[hid]
        holder, until = self.resolved.get(hid, (None, 0.0))
        if holder is not None:
            lease = self.alive.get(inst)
            if self.ex.client.store.instance_ttl_ms > 0 and (lease is None or float(lease) < self.now):
                t = float(lease) if lease is not None else until
                return {"reason": "instance_not_alive", "at_ms": int(t),
                        "explanation": f"its liveness lease expired at {iso(t)} (no sidecar renews it), "
                                       "so its chunks do not count"}
            hb = self.heartbeats.get((inst, wid))
            t = float(hb) if hb is not None else until
            return {"reason": "worker_silent", "at_ms": int(t),
                    "explanation": f"worker {wid} sent its last heartbeat at {iso(t)}, more than worker_ttl_s ago, "
                                   "so its chunks do not count"}
        t = self.dead.get(hid, 0.0)
        worker = self.workers.get((inst, wid)) or {}
        if not worker:
            cause = next((m.rsplit(keys.SEP, 1)[1] for m, s in self.departures.items()
                          if s == t and m.startswith(keys.worker_member(inst, wid) + keys.SEP)), "deregistered")
            verb = "was reaped" if cause == "reaped" else "deregistered"
            return {"reason": cause, "at_ms": int(t),
                    "explanation": f"worker {wid} {verb} at {iso(t)}, so its chunks no longer count"}
        if float(worker.get("registered_at") or 0) * 1000 >= t - 1:
            return {"reason": "new_epoch", "at_ms": int(t), "epoch": int(worker.get("epoch") or 0),
                    "explanation": f"worker {wid} re-registered at {iso(t)} (epoch {worker.get('epoch')}), "
                                   "so its earlier chunks no longer count"}
        return {"reason": "retired", "at_ms": int(t), "location": loc,
                "explanation": f"worker {wid}'s chunks in {loc} were retired at {iso(t)} (a full sync began)"}

    def variant_json(self, v: Variant) -> dict:
        return {**v.label, "setting": v.setting,
                "instances": {i: {"chunks": n, "tokens": t} for i, (n, t) in sorted(v.matched.items())}}

    def diagnosis(self, out: dict) -> list[str]:
        """Plain sentences, the most telling first."""
        p = self.profile
        lines = []
        if out["chunks"] == 0 and self.tokens:
            lines.append(f"the prompt has {len(self.tokens)} tokens, fewer than one chunk ({p.chunk_size}), and "
                         "partial chunks are not hashed (save_unfull_chunk: false): nothing to look up")
        elif not self.tokens:
            lines.append("the prompt is empty: nothing to look up")
        mine = {"chunk_size": p.chunk_size, "none_hash": p.none_hash,
                "extra_keys": "sha256" if p.algorithm == "sha256" else p.extra_keys}
        for v in self.variants:
            if not v.matched:
                continue
            who = ", ".join(sorted(v.matched))
            one = len(v.matched) == 1
            noun = "instance" if one else "instances"
            if v.kind == "profile":
                theirs = ", ".join(f"{k} {val}" for k, val in v.label.items())
                ours = ", ".join(f"{k} {mine[k]}" for k in v.label)
                lines.append(f"{noun} {who} {'stores' if one else 'store'} {theirs}; this controller uses {ours}: "
                             f"set {v.setting}")
            else:
                lines.append(f"{noun} {who} {'holds' if one else 'hold'} this prompt's first blocks "
                             f"(block size {v.label['block_size']}) "
                             f"under {v.setting}, not this request's namespace")
        for e in out["instances"]:
            who = f"instance {e['instance_id']}" + (f" rank {e['worker_id']}" if e["worker_id"] else "")
            if e["space"]:
                who += f" (vLLM blocks of {e['space'][1:]})"
            if "possibly_stale" in e:
                st = e["possibly_stale"]
                lines.append(f"{who} may be stale since {iso(st['since_ms'])}: {st['reason']}")
            if e["stop"] is None:
                lines.append(f"{who} matched all {len(self.tokens)} tokens")
            elif e["stop"]["reason"] not in ("hash_profile", "other_namespace"):
                lines.append(f"{who} matched {e['matched_prefix_length']} of {len(self.tokens)} tokens: "
                             f"{e['stop']['explanation']}")
        if not out["instances"] and out["chunks"]:
            c = self.chains[0]
            head = (f"no instance holds chunk 0 (tokens 0-{min(c.chunk_size, c.n_tokens)}, hash {c.hashes[0]}) "
                    "of this prompt, under this or any other hash profile tried")
            gone = self._departed()
            lines.append(f"{head}; workers that left in the last hour, whose records are purged (one may have "
                         f"held it): {gone}" if gone else f"{head}, nor held it recently")
        return lines

    def _departed(self, most: int = 5) -> str:
        """The departures log's newest entries as text ('' when empty): who left, how, when."""
        newest = sorted(self.departures.items(), key=lambda kv: -kv[1])
        parts = []
        for member, at in newest[:most]:
            wid, inst, cause = member.split(keys.SEP, 2)
            parts.append(f"instance {inst} worker {wid} {cause} at {iso(at)}")
        more = len(newest) - most
        return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def _label_text(label: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in label.items() if v is not None)


def _num(rank: str):
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)


def _pairs(flat) -> list[tuple]:
    if isinstance(flat, dict):
        return list(flat.items())
    if flat and isinstance(flat[0], list):  # RESP3: [member, score] pairs
        return [tuple(x) for x in flat]
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _score(value):
    """A ZMSCORE element as ZSCORE answers it (float or None; raw replies may be text)."""
    return None if value is None else float(value)


def _dict(flat) -> dict:
    return dict(_pairs(flat)) if flat else {}


def _descriptions(pairs) -> dict[str, tuple[str, str, str, str]]:
    """holder id -> parsed description; an unparsable one (written by a version that did not
    check engine strings) is skipped and counted (``kvlookup_unparsable_records_total``)."""
    out = {}
    for hid, value in pairs:
        try:
            out[hid] = keys.parse_holder(value)
        except ValueError as exc:
            metrics.UNPARSABLE.labels("explain").inc()
            log.debug("holder %s skipped: %s", hid, exc)
    return out
