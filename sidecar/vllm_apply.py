"""Apply one decoded vLLM event batch of one (instance, data-parallel rank) to the index.

Records live in kvlookup's own hash space (:mod:`kvlookup.hashing.vllm`): chunk keys tagged
``v<block_size>`` for the prefix chain (full/MLA/sink-full attention groups, or streams without
groups; kvlookup.index.vllm_groups) and ``v<block_size>g<group>`` for a hybrid model's other groups.
The holder is (instance, rank, medium, space). A per-rank Redis hash maps each (engine block
hash, group) to its own chunk hash, the residencies holding it and its space
(``keys.engine_map_key``), which resolves BlockRemoved, token-less BlockStored (offloading
connectors) and parents of later stores. One rank may use several block sizes at once (GPU
blocks of 16 beside LMCache MP connector CPU chunks of 256): each store is credited at its own.

A sliding-window or Mamba group's store may be sparse: vLLM 0.33 skips null and masked blocks in
``block_hashes`` (Mamba's align mode, sparse retention; v1/core/block_pool.py:277-282) while
``token_ids`` cover the whole range cached (:315-317, :394), so which block each hash is cannot
be read off the event. Such a store is placed after the rest of its batch, each hash through the
entry of another group that holds the same engine hash at the same block size (vLLM hashes a
block the same in every group, ``BlockHashWithGroupId``; the full-attention group caches every
block in the same step); a hash no group places is counted (``skipped["sparse_unplaced"]``). A
parent the store's own group no longer holds (freed and evicted there) is resolved the same way.

Residency is ``medium`` or ``medium~ownership`` (vLLM's offloading tracker keys residency by
(medium, ownership): kv_connector/v1/offloading/events.py:404-405, 447); a record goes when no
residency of its medium is left in any prefix group. Stores and removes of a ``REMOTE`` tier
(storage not local to the engine, vllm/v1/kv_offload/base.py:55-59) are skipped: the engine
cannot serve them as its own.

An event that does not add up (see :data:`REASONS`) is rejected whole: counted, logged, and
nothing of it is written, so no guessed record ever reaches the index. Round trips per batch:
one pipelined apply per space, the engine map and rank field writes riding in the last one
(``Store.apply(then=)``). This sidecar is the only writer of its ranks' engine maps, so it keeps
a :class:`Mirror` of each: once it emptied a map itself (a fresh start, a clear) the mirror is
the whole map and a batch reads nothing; a stream resumed after a restart reads its map once when
it has at most ``MIRROR_LOAD_MAX`` fields, and else asks (one HMGET per batch) for the fields the
mirror does not know.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field

from kvlookup import metrics
from kvlookup.hashing import vllm as vh
from kvlookup.index.store import ADMIT, EVICT, NotRegistered, Store
from kvlookup.index.vllm_groups import GroupSpec, is_prefix_group
from kvlookup.index.vllm_ranks import (
    VllmRanks,
    chains_text,
    engine_field,
    group_fields,
    group_space,
    prefix_space,
    rank_fields,
)
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored, Event, Malformed

log = logging.getLogger(__name__)

#: Largest block size accepted (tokens); vLLM's are 16 by default, a few hundred at most.
MAX_BLOCK_SIZE = 4096
#: Most lookahead tokens a block may be hashed with (vLLM: num_speculative_tokens).
MAX_LOOKAHEAD = 64

#: Why an event is rejected (metric label ``reason``).
REASONS = {
    "block_size": f"block_size missing, not positive, or above {MAX_BLOCK_SIZE}",
    "token_count": "len(token_ids) != len(block_hashes) * block_size",
    "extra_keys": "extra_keys has not one entry per block",
    "lookahead": f"lookahead_token_ids has not one list per block, of one length <= {MAX_LOOKAHEAD}",
    "unknown_parent": "parent_block_hash was never stored (or was cleared)",
    "unknown_hashes": "token-less store of block hashes never stored with tokens",
}
DEFAULT_MEDIUM = "GPU"
REMOTE = "REMOTE"


@dataclass(slots=True)
class Entry:
    """Engine map value: our chunk hash, the residencies holding the block, its space ("" in
    entries written before spaces were kept: the rank's legacy block size applies). media is
    never changed in place (a change makes a new Entry); a single residency is one shared
    frozenset (:func:`only`), not a set per entry."""

    own: int
    media: Set[str] = frozenset()
    space: str = ""

    @classmethod
    def parse(cls, raw: str | None) -> Entry | None:
        if not raw:
            return None
        own, _, rest = raw.partition("|")
        media, _, space = rest.partition("|")
        return cls(int(own), (only(media) if "," not in media else frozenset(media.split(","))) if media
                   else frozenset(), space)

    def format(self) -> str:
        media = self.media
        text = ",".join(sorted(media)) if len(media) != 1 else next(iter(media))
        return f"{self.own}|{text}|{self.space}"


_ONLY: dict[str, frozenset[str]] = {}


def only(res: str) -> frozenset[str]:
    """``frozenset({res})``, one shared per residency (a few per engine; the mirror holds one per
    block otherwise: ~200 B each)."""
    got = _ONLY.get(res)
    if got is None:
        got = frozenset((res,))
        if len(_ONLY) < 1024:  # residency names come from the wire: the memo stays bounded
            _ONLY[res] = got
    return got


def is_sparse(ev: BlockStored) -> bool:
    """Whether a store's tokens cover more whole blocks than it has hashes (vLLM skipped null or
    masked blocks of a sliding-window or Mamba group: block_pool.py:277-282)."""
    bs, n = ev.block_size or 0, len(ev.block_hashes)
    return bs > 0 and n > 0 and len(ev.token_ids) > n * bs and len(ev.token_ids) % bs == 0


def residency(medium: str, ownership: str | None) -> str:
    """``medium`` or ``medium~ownership`` (a secondary tier's copy is its own residency)."""
    return f"{medium}~{ownership}" if ownership else medium


def medium_of(res: str) -> str:
    return res.partition("~")[0]


@dataclass
class RankContext:
    """What the applier needs about a rank. chains: its prefix chains ((block size, lookahead)
    pairs, kept up to date by the applier); groups: its KV cache groups learned from stores;
    legacy_space: the space of entries without one (the rank's single block size before).
    wipe: retire every record of the rank and empty its engine map. register: register the rank
    again (a new epoch) when the registry lost it."""

    store: Store
    instance_id: str
    rank: int
    wipe: Callable[[], None]
    register: Callable[[], None]
    rejected: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    chains: set[tuple[int, int]] = field(default_factory=set)
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    legacy_space: str = ""
    #: the rank's state in Redis (its engine map and rank fields); None: made from store
    ranks_state: VllmRanks | None = None
    #: the rank's engine map as this sidecar read and wrote it; None: read every batch
    mirror: Mirror | None = None
    #: runs the batch's write (sidecar.vllm_writer.Writer.submit with the rank's on_fail, which
    #: may leave its replies unread until settled); None: written at once
    submit: Callable[[Callable[[], Callable[[], None] | None]], None] | None = None
    #: waits for a write left in flight (before the engine map is read); raises what failed
    settle: Callable[[], None] | None = None


#: A mirror holding more engine map fields than this is emptied and becomes partial (a cache).
MIRROR_MAX = 1_000_000
#: A partial mirror reads the whole map once (HGETALL) when it has at most this many fields.
MIRROR_LOAD_MAX = 50_000


def _lora(ev: BlockStored) -> str | None:
    """The LoRA adapter a store's chain root names: its ``lora_name``, else ``lora_id:<id>``."""
    return ev.lora_name if ev.lora_name is not None else (None if ev.lora_id is None else f"lora_id:{ev.lora_id}")


_NOTHING: dict[str, Entry | None] = {}  # the engine map just wiped (BatchApplier._base)


@functools.lru_cache(maxsize=1024)
def _prefix_space(block_size: int) -> str:
    """``prefix_space`` memoized (a few block sizes per engine)."""
    return prefix_space(block_size)


@functools.lru_cache(maxsize=1024)
def _plain_root(block_size: int, lora: str | None) -> int:
    """``vh.namespace_root`` of a chain without namespace extras (memoized: a few per engine)."""
    return vh.namespace_root(block_size, lora, ())


class Mirror:
    """A rank's engine map (field -> parsed :class:`Entry`) as this sidecar read and wrote it.
    ``complete``: it is the whole map (this sidecar emptied the map and wrote every field since),
    so a field it lacks is absent, and a batch reads its fields straight from it; else it only
    caches what was read (None: read absent). The sidecar is the map's only writer; a write that
    failed makes it partial and empty (:meth:`forget`). Entries are never changed in place (an
    applier makes a new one for every change), so the mirror and a batch share them."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry | None] = {}
        self.complete = False
        self.load_tried = False

    def load(self, ranks: VllmRanks, rank: int) -> None:
        """Once: read the whole map when it is small (then complete)."""
        self.load_tried = True
        if ranks.engine_map_size(rank) <= MIRROR_LOAD_MAX:
            self.entries = {f: Entry.parse(v) for f, v in ranks.engine_map(rank).items()}
            self.complete = True

    def emptied(self) -> None:
        """The map was just unlinked: empty, and complete."""
        self.entries.clear()
        self.complete = True

    def forget(self) -> None:
        """Not sure what the map holds any more (a write failed): empty and partial, read again."""
        self.entries.clear()
        self.complete = False
        self.load_tried = False

    def known(self, fields: set[str]) -> dict[str, Entry | None]:
        """What the mirror says of ``fields`` (every one of them when complete)."""
        e = self.entries
        if self.complete:
            return {f: e.get(f) for f in fields}
        return {f: e[f] for f in fields if f in e}

    def update(self, values: dict[str, Entry | None]) -> None:
        """Fields as written (None: deleted) or read (None: absent)."""
        if len(self.entries) + len(values) > MIRROR_MAX:
            self.entries.clear()
            self.complete = False
        e = self.entries
        e.update(values)
        if self.complete:  # a complete mirror holds no None: a field deleted is absent
            for f in [f for f, v in values.items() if v is None]:
                del e[f]


class BatchApplier:
    """Applies the events of one batch in order; :meth:`run` writes them."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.ranks = ctx.ranks_state or VllmRanks(ctx.store, ctx.instance_id)
        self.fetched: dict[str, Entry | None] = {}
        self.changed: dict[str, Entry | None] = {}
        self.wiped = False
        #: (medium, space) -> its ops folded as Store.apply takes them ({chunk hash text: ADMIT|EVICT},
        #: each chunk's last op), and [admits, evicts] as they came (kvlookup_ingest_ops_total)
        self.ops: dict[tuple[str, str], dict[str, str]] = {}
        self.counts: dict[tuple[str, str], list[int]] = {}
        self.new_chains = False
        self.new_groups: dict[int, GroupSpec] = {}
        self.session: str | None = None
        self.sparse: list[BlockStored] = []  # sparse group stores, placed at the end of the batch

    def run(self, events: Sequence[Event], persist: dict[str, str | int]) -> None:
        """Apply ``events``; write ``persist`` (instance hash fields) with the last writes."""
        self._prefetch(events)
        plain = self._stored_plain
        for ev in events:
            try:
                if type(ev) is BlockStored and ev.group_idx is None and ev.locality is None \
                        and ev.ownership is None and ev.extra_keys is None and not ev.lookahead_token_ids \
                        and ev.token_ids and ev.block_hashes and type(bs := ev.block_size) is int \
                        and 0 < bs <= MAX_BLOCK_SIZE:  # the usual store: what _stored would find
                    if ev.session_id:
                        self.session = ev.session_id
                    plain(ev, bs, ev.medium or DEFAULT_MEDIUM)
                    continue
                self._event(ev)
            except WireError as exc:
                self.ctx.rejected[exc.reason] += 1
                metrics.REJECTED.labels("vllm", exc.reason).inc()
                log.warning("%s rank %d: rejected %s: %s", self.ctx.instance_id, self.ctx.rank,
                            type(ev).__name__, exc)
        self._place_sparse()
        self.flush(persist)

    def _event(self, ev: Event) -> None:
        t = type(ev)
        if t is BlockStored and ev.locality is None:  # type: ignore[union-attr]
            self._stored(ev)  # type: ignore[arg-type]
            return
        if t is BlockRemoved and ev.locality is None:  # type: ignore[union-attr]
            self._removed(ev)  # type: ignore[arg-type]
            return
        if isinstance(ev, Malformed):
            raise WireError(ev.reason, ev.detail)
        if isinstance(ev, AllBlocksCleared):
            self._place_sparse()
            self.flush({})
            self.ctx.wipe()
            self.ctx.chains.clear()
            self.ctx.groups.clear()
            self.ctx.legacy_space = ""
            self.fetched.clear()
            self.wiped = True
            return
        if ev.locality == REMOTE:
            self.ctx.skipped["remote_tier"] += 1  # not the engine's own cache
            return
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)

    # -- events ---------------------------------------------------------------------------

    def _learn_group(self, ev: BlockStored) -> GroupSpec | None:
        g = ev.group_idx
        if g is None:
            return None
        known = self.ctx.groups.get(g)
        if ev.kv_cache_spec_kind is None or not ev.block_size:
            return known
        bs = ev.block_size
        if known is not None and known.kind == ev.kv_cache_spec_kind:
            bs = max(bs, known.block_size)  # a partial-tail store at hash_block_size keeps the group's size
        spec = GroupSpec(ev.kv_cache_spec_kind, bs, ev.kv_cache_spec_sliding_window)
        if spec != known:
            self.ctx.groups[g] = self.new_groups[g] = spec
        return spec

    def _space(self, group_idx: int | None, block_size: int, spec: GroupSpec | None) -> str:
        if is_prefix_group(group_idx, spec):
            return prefix_space(block_size)
        return group_space(block_size, group_idx or 0)

    def _stored(self, ev: BlockStored) -> None:
        g = ev.group_idx
        spec = None if g is None else self._learn_group(ev)
        bs = ev.block_size
        tokenless = not ev.token_ids
        if not (tokenless and bs == 0) and (bs is None or not 0 < bs <= MAX_BLOCK_SIZE):
            raise WireError("block_size", f"block_size is {bs!r}")
        if not ev.block_hashes:
            return
        if ev.session_id:
            self.session = ev.session_id
        medium = ev.medium or DEFAULT_MEDIUM
        if g is None and ev.ownership is None and ev.extra_keys is None and not ev.lookahead_token_ids \
                and not tokenless:
            self._stored_plain(ev, bs, medium)
            return
        res = residency(medium, ev.ownership)
        if tokenless:
            olds = self._resolve_tokenless(ev)
            for engine_hash, e in zip(ev.block_hashes, olds, strict=True):
                self._place(engine_field(engine_hash, g), e.own, self._entry_space(e), medium, res)
            return
        lookahead = self._lookahead(ev) if ev.lookahead_token_ids else 0
        chain_space = prefix_space(bs)
        space = chain_space if g is None else self._space(g, bs, spec)
        if space != chain_space and is_sparse(ev):
            self.sparse.append(ev)
            return
        owns = self._own_hashes(ev, bs, lookahead)
        if space == chain_space and (bs, lookahead) not in self.ctx.chains:
            self.ctx.chains.add((bs, lookahead))
            self.new_chains = True
        ops = self._ops(medium, space)
        for engine_hash, own in zip(ev.block_hashes, owns, strict=True):
            self._place(engine_field(engine_hash, g), own, space, medium, res, ops)

    def _stored_plain(self, ev: BlockStored, bs: int, medium: str) -> None:
        """:meth:`_stored` of the usual store, in one loop: the prefix chain of a rank without groups
        (group None), plain blocks (no extra keys, no lookahead), no ownership."""
        hashes, tokens = ev.block_hashes, ev.token_ids
        n = len(hashes)
        if len(tokens) != n * bs:
            raise WireError("token_count", f"{len(tokens)} tokens for {n} blocks of {bs}")
        changed, base = self.changed, self._base()
        if ev.parent_block_hash is None:
            parent = _plain_root(bs, _lora(ev))
        else:
            f = str(ev.parent_block_hash)  # engine_field(parent, None)
            entry = changed[f] if f in changed else base(f)
            if entry is None:  # group None: no other group to place it from
                raise WireError("unknown_parent", f"parent {ev.parent_block_hash} is not known")
            parent = entry.own
        space = _prefix_space(bs)
        if (bs, 0) not in self.ctx.chains:
            self.ctx.chains.add((bs, 0))
            self.new_chains = True
        ops = self._ops(medium, space)
        self.counts[(medium, space)][0] += n
        if n == 1:  # a decode step's store: vh.plain_chain of one block
            owns = [hash((parent, tokens if type(tokens) is tuple else tuple(tokens)))]
        else:
            owns = vh.plain_chain(parent, tokens, bs)
        fresh = only(medium)
        for engine_hash, own in zip(hashes, owns, strict=True):
            f = str(engine_hash)  # engine_field(engine_hash, None)
            old = changed[f] if f in changed else base(f)
            changed[f] = Entry(own, fresh if not old or old.own != own else
                               old.media if medium in old.media else {*old.media, medium}, space)
            ops[str(own)] = ADMIT  # chunk_text

    def _place(self, f, own: int, space, medium: str, res, ops: dict | None = None) -> None:
        """Admit our chunk hash ``own`` under the engine field ``f`` in ``space`` for ``medium``
        (residency ``res``), keeping the media the field already had for the same hash. ops: the
        (medium, space) op list, when the caller has it."""
        old = self._get(f)
        self.changed[f] = Entry(own, only(res) if not old or old.own != own else
                                old.media if res in old.media else {*old.media, res}, space)
        (self._ops(medium, space) if ops is None else ops)[str(own)] = ADMIT
        self.counts[(medium, space)][0] += 1

    def _ops(self, medium: str, space: str) -> dict[str, str]:
        """The folded ops of (medium, space) (see ``self.ops``), made empty when new."""
        key = (medium, space)
        ops = self.ops.get(key)
        if ops is None:
            ops = self.ops[key] = {}
            self.counts[key] = [0, 0]
        return ops

    def _lookahead(self, ev: BlockStored) -> int:
        la = ev.lookahead_token_ids
        if not la:
            return 0
        n = len(la[0])
        if len(la) != len(ev.block_hashes) or not 0 < n <= MAX_LOOKAHEAD or any(len(x) != n for x in la):
            raise WireError("lookahead", f"{len(la)} lookahead lists for {len(ev.block_hashes)} blocks")
        return n

    def _own_hashes(self, ev: BlockStored, bs: int, lookahead: int) -> list[int]:
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * bs:
            raise WireError("token_count", f"{len(ev.token_ids)} tokens for {n} blocks of {bs}")
        extra_keys = ev.extra_keys
        if extra_keys is not None and len(extra_keys) != n:
            raise WireError("extra_keys", f"{len(extra_keys)} extra_keys entries for {n} blocks")
        per_block = [vh.split_extra_keys(e, ev.lora_name) for e in extra_keys] if extra_keys else None
        extras = [tuple(e) or None for e in per_block] if per_block else None  # None: plain blocks
        if ev.parent_block_hash is None:
            parent = vh.namespace_root(bs, _lora(ev), per_block[0] if per_block else ())
            if extras:
                extras[0] = None  # the first block's extra keys are part of the root
        else:
            entry = self._get(engine_field(ev.parent_block_hash, ev.group_idx))
            found = entry.own if entry is not None else self._own_elsewhere(ev.parent_block_hash, ev.group_idx, bs)
            if found is None:
                raise WireError("unknown_parent", f"parent {ev.parent_block_hash} is not known")
            parent = found
        if lookahead and ev.lookahead_token_ids:
            extras = [vh.with_lookahead(e, la) for e, la in zip(extras or [None] * n, ev.lookahead_token_ids,
                                                                 strict=True)]
        if not extras:
            return vh.plain_chain(parent, ev.token_ids, bs)
        return vh.chain(parent, ev.token_ids, bs, extras)

    def _own_elsewhere(self, engine_hash: int, group_idx: int | None, bs: int) -> int | None:
        """Our chunk hash of ``engine_hash`` from another group holding it at block size ``bs``
        (vLLM hashes a block alike in every group; our chain at ``bs`` is alike too), or None."""
        if group_idx is None:
            return None
        for g in sorted({0, *self.ctx.groups} - {group_idx}):
            entry = self._get(engine_field(engine_hash, g))
            if entry is not None and self._entry_space(entry) in (prefix_space(bs), group_space(bs, g)):
                return entry.own
        return None

    def _place_sparse(self) -> None:
        """Place the batch's sparse group stores (see the module docstring)."""
        for ev in self.sparse:
            bs, g = ev.block_size or 0, ev.group_idx
            space = group_space(bs, g or 0)
            medium = ev.medium or DEFAULT_MEDIUM
            res = residency(medium, ev.ownership)
            for engine_hash in ev.block_hashes:
                own = self._own_elsewhere(engine_hash, g, bs)
                if own is None:
                    self.ctx.skipped["sparse_unplaced"] += 1
                    continue
                self._place(engine_field(engine_hash, g), own, space, medium, res)
        self.sparse = []

    def _resolve_tokenless(self, ev: BlockStored) -> list[Entry]:
        entries = [self._get(engine_field(h, ev.group_idx)) for h in ev.block_hashes]
        missing = [h for h, e in zip(ev.block_hashes, entries, strict=True) if e is None]
        if missing:
            raise WireError("unknown_hashes", f"{len(missing)} of {len(entries)} hashes never stored "
                                                  f"with tokens (first {missing[0]})")
        return [e for e in entries if e is not None]

    def _entry_space(self, entry: Entry) -> str:
        return entry.space or self.ctx.legacy_space

    def _removed(self, ev: BlockRemoved) -> None:
        medium = ev.medium or DEFAULT_MEDIUM
        res = residency(medium, ev.ownership)
        g = ev.group_idx
        alone = not g and not self.ctx.groups  # no other group may hold the same record
        changed, base = self.changed, self._base()
        legacy = self.ctx.legacy_space
        last_space, space_ops, count = None, None, None
        for engine_hash in ev.block_hashes:
            f = engine_field(engine_hash, g)
            old = changed[f] if f in changed else base(f)
            if old is None or res not in old.media:
                self.ctx.skipped["remove_unknown"] += 1
                continue
            media = old.media - {res}
            entry = Entry(old.own, media, old.space)
            changed[f] = entry if media else None
            space = old.space or legacy
            if not space or (media and alone and any(medium_of(r) == medium for r in media)):
                continue
            if (alone and not media) or not self._still_held(engine_hash, g, entry, medium, space):
                if space != last_space:
                    last_space, space_ops, count = space, self._ops(medium, space), self.counts[(medium, space)]
                space_ops[str(old.own)] = EVICT  # type: ignore[index]  # chunk_text
                count[1] += 1  # type: ignore[index]

    def _still_held(self, engine_hash: int, group_idx: int | None, entry: Entry, medium: str, space: str) -> bool:
        """Whether another residency of ``medium`` keeps the record in ``space``: the same entry
        (another ownership) or, for the prefix chain, the same block of another prefix group."""
        if any(medium_of(r) == medium for r in entry.media):
            return True
        for g in self._groups_sharing(group_idx, space):
            other = self._get(engine_field(engine_hash, g))
            if other and other.own == entry.own and self._entry_space(other) == space and any(
                    medium_of(r) == medium for r in other.media):
                return True
        return False

    def _groups_sharing(self, group_idx: int | None, space: str) -> list[int]:
        """The other groups whose blocks may hold the same record: every group, for a prefix space
        (``v<digits>``); none for a group space (``v<bs>g<group>``, one group's own)."""
        if not space[1:].isdigit():
            return []
        return [g for g in {0, *self.ctx.groups} if g != (group_idx or 0)]

    # -- engine map -----------------------------------------------------------------------

    def _get(self, f: str) -> Entry | None:
        if f in self.changed:
            return self.changed[f]
        return self._base()(f)

    def _base(self) -> Callable[[str], Entry | None]:
        """Where :meth:`_get` reads a field the batch has not changed: nothing after a wipe in this
        batch, a complete mirror, else what :meth:`_prefetch` read (a dict's ``get``; call it anew
        after each event, a wipe changes it)."""
        if self.wiped:
            return _NOTHING.get
        mirror = self.ctx.mirror
        if mirror is not None and mirror.complete:
            return mirror.entries.get
        return self.fetched.get

    def _prefetch(self, events: Sequence[Event]) -> None:
        """Read the engine map fields the batch may need (one HMGET), unless the mirror is complete
        (then :meth:`_get` reads it as it goes)."""
        mirror = self.ctx.mirror
        if (mirror is None or not mirror.complete) and self.ctx.settle is not None:
            self.ctx.settle()  # the map is read below: the write in flight first
        if mirror is not None and not mirror.complete and not mirror.load_tried and events:
            mirror.load(self.ranks, self.ctx.rank)
        if mirror is not None and mirror.complete:
            return
        wanted: set[str] = set()
        groups = {0, *self.ctx.groups}
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.group_idx is not None and ev.group_idx not in self.ctx.groups:
                    groups.add(ev.group_idx)
                wanted.update(engine_field(h, ev.group_idx) for h in ev.block_hashes)
                if ev.parent_block_hash is not None:
                    wanted.add(engine_field(ev.parent_block_hash, ev.group_idx))
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx is not None:
                    groups.add(ev.group_idx)
        for ev in events:
            if isinstance(ev, BlockRemoved):
                wanted.update(engine_field(h, g) for h in ev.block_hashes for g in groups)
            elif isinstance(ev, BlockStored) and ev.group_idx is not None:  # other groups may place it
                if ev.parent_block_hash is not None:
                    wanted.update(engine_field(ev.parent_block_hash, g) for g in groups)
                if is_sparse(ev):
                    wanted.update(engine_field(h, g) for h in ev.block_hashes for g in groups)
        known: dict[str, Entry | None] = {}
        if mirror is not None and wanted:
            known = mirror.known(wanted)
            wanted.difference_update(known)
        if wanted:
            order = list(wanted)
            got = {f: Entry.parse(v) for f, v in zip(order, self.ranks.engine_entries(self.ctx.rank, order),
                                                      strict=True)}
            known.update(got)
            if mirror is not None:
                mirror.update(got)
        self.fetched = known

    # -- writes ---------------------------------------------------------------------------

    def flush(self, persist: dict[str, str | int]) -> None:
        """Write pending chunk ops, engine map changes and ``persist`` fields: one round trip per
        space written (the map and rank fields ride in the last one), or one when there are no ops;
        through ``ctx.submit`` when set (the write may be left in flight: sidecar.vllm_writer)."""
        ctx = self.ctx
        by_space: dict[str, list] = {}
        for (medium, space), ops in self.ops.items():
            if ops:
                by_space.setdefault(space, []).append((ctx.instance_id, ctx.rank, medium, ops,
                                                       self.counts[(medium, space)]))
        self.ops, self.counts = {}, {}
        sets = {f: e.format() for f, e in self.changed.items() if e is not None}
        dels = [f for f, e in self.changed.items() if e is None]
        persist = dict(persist)
        block_sizes = None
        if self.new_chains and ctx.chains:
            block_sizes = chains_text(ctx.chains)
            persist.update(rank_fields(ctx.rank, block_size=block_sizes))
            self.new_chains = False
        persist.update(group_fields(ctx.rank, {g: spec.format() for g, spec in self.new_groups.items()}))
        self.new_groups = {}
        if self.session:
            persist.update(rank_fields(ctx.rank, session=self.session))
            self.session = None
        then = self.ranks.write_commands(ctx.rank, sets, dels, block_sizes=block_sizes, persist=persist,
                                         min_block_size=min(bs for bs, _ in ctx.chains) if block_sizes else None)
        spaces = list(by_space.items())

        def write() -> Callable[[], None] | None:
            """Write every space but the last; send the last (map and rank fields with it) and
            return what reads its replies."""
            if not spaces:
                self.ranks.send(then)
                return None
            for space, batches in spaces[:-1]:
                self._apply(batches, space, ())()
            space, batches = spaces[-1]
            return self._apply(batches, space, then)

        if ctx.submit is None:
            finish = write()
            if finish is not None:
                finish()
        else:  # maybe left in flight; a failure forgets the mirror updated below (its on_fail)
            ctx.submit(write)
        if ctx.mirror is not None:  # the map as written: only now may the mirror say so
            ctx.mirror.update(self.changed)
        if ctx.mirror is None or not ctx.mirror.complete:
            self.fetched.update(self.changed)
        self.changed = {}

    def _apply(self, batches: list, space: str, then: Sequence[tuple]) -> Callable[[], None]:
        """Send one space's (instance, rank, medium, folded ops, [admits, evicts]) batches
        (``Store.apply_send``); returns what reads the replies and counts the ops."""
        writes = [b[:4] for b in batches]
        try:
            read = self.ctx.store.apply_send(writes, space=space, then=then)
        except NotRegistered:
            ctx = self.ctx
            log.warning("%s rank %d was deregistered; registering it again", ctx.instance_id, ctx.rank)
            ctx.register()
            read = self.ctx.store.apply_send(writes, space=space, then=then)
        admits, evicts = sum(b[4][0] for b in batches), sum(b[4][1] for b in batches)

        def finish() -> None:
            read()
            if admits:
                metrics.INGEST_OPS.labels("admit", "applied").inc(admits)
            if evicts:
                metrics.INGEST_OPS.labels("evict", "applied").inc(evicts)

        return finish

