"""Apply one decoded vLLM event batch of one (instance, data-parallel rank) to the index.

Records live in kvlookup's own hash space (:mod:`kvlookup.hashing.vllm`, chunk keys tagged
``v<block_size>``); the holder is (instance, rank, medium). A per-rank Redis hash maps each
engine block hash to its own chunk hash and the media holding it
(``keys.engine_map_key``), which resolves BlockRemoved, token-less BlockStored (offloading
connectors) and parents of later stores.

An event that does not add up (see :data:`REASONS`) is rejected whole: counted, logged, and
nothing of it is written, so no guessed record ever reaches the index. Round trips per batch:
one HMGET of the engine hashes it mentions, one pipelined apply, one pipeline of map writes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlookup import metrics
from kvlookup.hashing import vllm as vh
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, NotRegistered, Store
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored, Event, Malformed

log = logging.getLogger(__name__)

#: Largest block size accepted (tokens); vLLM's are 16 by default, a few hundred at most.
MAX_BLOCK_SIZE = 4096

#: Why an event is rejected (metric label ``reason``).
REASONS = {
    "block_size": f"block_size missing, not positive, or above {MAX_BLOCK_SIZE}",
    "block_size_changed": "block_size differs from the one this rank's records use",
    "token_count": "len(token_ids) != len(block_hashes) * block_size",
    "extra_keys": "extra_keys has not one entry per block",
    "unknown_parent": "parent_block_hash was never stored (or was cleared)",
    "unknown_hashes": "token-less store of block hashes never stored with tokens",
}
DEFAULT_MEDIUM = "GPU"


@dataclass
class Entry:
    """Engine map value: our chunk hash and the media holding the block."""

    own: int
    media: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, raw: str | None) -> Entry | None:
        if not raw:
            return None
        own, _, media = raw.partition("|")
        return cls(int(own), set(media.split(",")) if media else set())

    def format(self) -> str:
        return f"{self.own}|{','.join(sorted(self.media))}"


@dataclass
class RankContext:
    """What the applier needs about a rank. block_size: the size its records use (None until
    the first store). wipe: retire every record of the rank and empty its engine map.
    register: register the rank again (a new epoch) when the registry lost it."""

    store: Store
    instance_id: str
    rank: int
    block_size: int | None
    wipe: Callable[[], None]
    register: Callable[[], None]
    rejected: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)


class BatchApplier:
    """Applies the events of one batch in order; :meth:`run` writes them."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.map_key = keys.engine_map_key(ctx.instance_id, ctx.rank)
        self.fetched: dict[int, Entry | None] = {}
        self.changed: dict[int, Entry | None] = {}
        self.wiped = False
        self.ops: dict[str, list[tuple[str, int]]] = {}
        self.new_block_size: int | None = None

    def run(self, events: Sequence[Event], persist: dict[str, str | int]) -> None:
        """Apply ``events``; write ``persist`` (instance hash fields) with the last writes."""
        self._prefetch(events)
        for ev in events:
            try:
                self._event(ev)
            except WireError as exc:
                self.ctx.rejected[exc.reason] += 1
                metrics.REJECTED.labels("vllm", exc.reason).inc()
                log.warning("%s rank %d: rejected %s: %s", self.ctx.instance_id, self.ctx.rank,
                            type(ev).__name__, exc)
        self.flush(persist)

    def _event(self, ev: Event) -> None:
        if isinstance(ev, Malformed):
            raise WireError(ev.reason, ev.detail)
        if isinstance(ev, AllBlocksCleared):
            self.flush({})
            self.ctx.wipe()
            self.ctx.block_size = None
            self.fetched.clear()
            self.wiped = True
            return
        if ev.group_idx not in (None, 0):
            self.ctx.skipped["other_group"] += 1  # hybrid models: only group 0 (full attention)
            return
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)

    # -- events ---------------------------------------------------------------------------

    def _stored(self, ev: BlockStored) -> None:
        bs = ev.block_size
        if bs is None or not 0 < bs <= MAX_BLOCK_SIZE:
            raise WireError("block_size", f"block_size is {bs!r}")
        if self.ctx.block_size is not None and bs != self.ctx.block_size:
            raise WireError("block_size_changed", f"block_size {bs}, records use {self.ctx.block_size}")
        if not ev.block_hashes:
            return
        owns = self._own_hashes(ev, bs) if ev.token_ids else self._resolve_tokenless(ev)
        if self.ctx.block_size is None:
            self.ctx.block_size = self.new_block_size = bs
        medium = ev.medium or DEFAULT_MEDIUM
        ops = self.ops.setdefault(medium, [])
        for engine_hash, own in zip(ev.block_hashes, owns, strict=True):
            old = self._get(engine_hash)
            entry = Entry(own, set(old.media) if old and old.own == own else set())
            entry.media.add(medium)
            self.changed[engine_hash] = entry
            ops.append((ADMIT, own))

    def _own_hashes(self, ev: BlockStored, bs: int) -> list[int]:
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * bs:
            raise WireError("token_count", f"{len(ev.token_ids)} tokens for {n} blocks of {bs}")
        extra_keys = ev.extra_keys
        if extra_keys is not None and len(extra_keys) != n:
            raise WireError("extra_keys", f"{len(extra_keys)} extra_keys entries for {n} blocks")
        per_block = [vh.split_extra_keys(e, ev.lora_name) for e in extra_keys] if extra_keys else [()] * n
        extras = [tuple(e) or None for e in per_block]
        if ev.parent_block_hash is None:
            lora = ev.lora_name if ev.lora_name is not None else (
                None if ev.lora_id is None else f"lora_id:{ev.lora_id}")
            parent = vh.namespace_root(bs, lora, per_block[0])
            extras[0] = None  # the first block's extra keys are part of the root
        else:
            entry = self._get(ev.parent_block_hash)
            if entry is None:
                raise WireError("unknown_parent", f"parent {ev.parent_block_hash} is not known")
            parent = entry.own
        return vh.chain(parent, ev.token_ids, bs, extras)

    def _resolve_tokenless(self, ev: BlockStored) -> list[int]:
        entries = [self._get(h) for h in ev.block_hashes]
        missing = [h for h, e in zip(ev.block_hashes, entries, strict=True) if e is None]
        if missing:
            raise WireError("unknown_hashes", f"{len(missing)} of {len(entries)} hashes never stored "
                                                  f"with tokens (first {missing[0]})")
        return [e.own for e in entries if e is not None]

    def _removed(self, ev: BlockRemoved) -> None:
        medium = ev.medium or DEFAULT_MEDIUM
        ops = self.ops.setdefault(medium, [])
        for engine_hash in ev.block_hashes:
            old = self._get(engine_hash)
            if old is None:
                self.ctx.skipped["remove_unknown"] += 1
                continue
            ops.append((EVICT, old.own))
            entry = Entry(old.own, old.media - {medium})
            self.changed[engine_hash] = entry if entry.media else None

    # -- engine map -----------------------------------------------------------------------

    def _get(self, engine_hash: int) -> Entry | None:
        if engine_hash in self.changed:
            return self.changed[engine_hash]
        return None if self.wiped else self.fetched.get(engine_hash)

    def _prefetch(self, events: Sequence[Event]) -> None:
        wanted: set[int] = set()
        for ev in events:
            if isinstance(ev, BlockStored):
                wanted.update(ev.block_hashes)
                if ev.parent_block_hash is not None:
                    wanted.add(ev.parent_block_hash)
            elif isinstance(ev, BlockRemoved):
                wanted.update(ev.block_hashes)
        if wanted:
            order = list(wanted)
            values = self.ctx.store.r.hmget(self.map_key, [str(h) for h in order])
            self.fetched = {h: Entry.parse(v) for h, v in zip(order, values, strict=True)}

    # -- writes ---------------------------------------------------------------------------

    def flush(self, persist: dict[str, str | int]) -> None:
        """Write pending chunk ops, engine map changes and ``persist`` fields."""
        ctx = self.ctx
        if self.ops and ctx.block_size is not None:
            batches = [(ctx.instance_id, ctx.rank, loc, ops) for loc, ops in self.ops.items() if ops]
            self._apply(batches, keys.vllm_space(ctx.block_size))
        self.ops = {}
        pipe = ctx.store.r.pipeline(transaction=False)
        sets = {str(h): e.format() for h, e in self.changed.items() if e is not None}
        dels = [str(h) for h, e in self.changed.items() if e is None]
        if sets:
            pipe.hset(self.map_key, mapping=sets)
        if dels:
            pipe.hdel(self.map_key, *dels)
        self.fetched.update(self.changed)
        self.changed = {}
        if self.new_block_size is not None:
            pipe.hset(keys.block_sizes_key(), keys.worker_member(ctx.instance_id, ctx.rank), self.new_block_size)
            pipe.hset(keys.instance_key(ctx.instance_id), "block_size", self.new_block_size)
            persist = {**persist, keys.rank_field("block_size", ctx.rank): self.new_block_size}
            self.new_block_size = None
        if persist:
            pipe.hset(keys.instance_key(ctx.instance_id), mapping=persist)
        if len(pipe):
            pipe.execute()

    def _apply(self, batches: list, space: str) -> None:
        try:
            self.ctx.store.apply(batches, space=space)
        except NotRegistered:
            ctx = self.ctx
            log.warning("%s rank %d was deregistered; registering it again", ctx.instance_id, ctx.rank)
            ctx.register()
            self.ctx.store.apply(batches, space=space)
        for batch in batches:
            metrics.count_ops(batch[3], "applied")
