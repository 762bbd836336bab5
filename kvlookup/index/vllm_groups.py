"""KV cache groups of hybrid vLLM models, and the cache hit vLLM's coordinator would find.

vLLM 0.26+ annotates every BlockStored with its group's kind and sliding window
(vllm/v1/core/kv_cache_manager.py:211-216 builds ``kv_cache_event_metadata`` per group,
:705-730 ``take_events`` copies it onto stores only; BlockRemoved carries ``group_idx`` alone).
Groups are numbered in layer order, so group 0 need not be full attention. kvlookup learns
``(instance, rank, group_idx) -> GroupSpec`` from stores (``keys.group_field``).

Only :data:`PREFIX_KINDS` form the prefix chain that ``matched_prefix_length`` walks (the
``KVCacheSpecKind`` values of vllm/v1/kv_cache_interface.py:183-194 whose manager is
``FullAttentionManager`` or a subclass: full, MLA, sink-full attention). A stream without
groups (vLLM <= 0.25, offloading connectors, LMCache's MP connector) is one prefix chain.

:func:`reusable_length` is the hit length vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``
(vllm/v1/core/kv_cache_coordinator.py:806-941) computes, for the common configuration: no EAGLE
drop, no decode-context parallelism, hits aligned to the scheduler block size (the LCM of the
groups' block sizes, :111-117 and ``_cache_hit_alignment_tokens`` :708-716), capped at
``len(prompt) - 1`` tokens (kv_cache_manager.py:296-302). Per group kind
(vllm/v1/core/single_type_kv_cache_manager.py):

- full attention (:743-800): the longest run of cached blocks from block 0;
- sliding window (:946-1064): scanning right to left from the cap, the first run of
  ``cdiv(window - 1, block_size)`` cached blocks, whose end is aligned; a run reaching block 0
  counts even when shorter;
- Mamba (:1470-1545): the last cached block at or below the cap whose end is aligned (its state
  is the whole prefix).

The coordinator iterates these as a fixed point (each kind accepts the candidate length or
lowers it, full attention first) until no kind lowers it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import lcm

#: Kinds whose blocks extend the prefix chain (FullAttentionManager and subclasses).
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KINDS = frozenset({"mamba"})


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as its stores describe it. kind: vLLM's ``kv_cache_spec_kind`` (None:
    not annotated); block_size: tokens per block; window: sliding window in tokens (or None)."""

    kind: str | None
    block_size: int
    window: int | None = None

    @property
    def prefix(self) -> bool:
        """Whether its blocks extend the prefix chain (unannotated groups count as full attention)."""
        return self.kind is None or self.kind in PREFIX_KINDS

    def format(self) -> str:
        return f"{self.kind or ''}|{self.block_size}|{'' if self.window is None else self.window}"

    @classmethod
    def parse(cls, text: str) -> GroupSpec | None:
        """From :meth:`format`'s text; None when it does not parse."""
        try:
            kind, bs, window = str(text).split("|")
            return cls(kind or None, int(bs), int(window) if window else None)
        except ValueError:
            return None


def is_prefix_group(group_idx: int | None, spec: GroupSpec | None) -> bool:
    """Whether a group's blocks extend the prefix chain: annotated prefix kinds whatever their
    index; without an annotation only group None/0 (single-group engines, older versions)."""
    if spec is not None and spec.kind is not None:
        return spec.kind in PREFIX_KINDS
    return not group_idx


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: ``held(group_idx, block_index) -> bool``: whether the group holds block i of the prompt.
Held = Callable[[int, int], bool]


def reusable_length(groups: Mapping[int, GroupSpec], held: Held, n_tokens: int) -> int:
    """Tokens of an ``n_tokens`` prompt vLLM's hybrid coordinator would take from cache.

    groups: the rank's groups (index -> spec); held: see :data:`Held`. Kinds other than full,
    sliding-window and Mamba (cross attention, chunked local, unknown) are left out, as vLLM
    skips groups that are not prefix-cacheable; with no group the answer is 0.
    """
    specs = {g: s for g, s in groups.items() if s.prefix or s.kind in SLIDING_KINDS | MAMBA_KINDS}
    if not specs or n_tokens <= 1:
        return 0
    align = lcm(*(s.block_size for s in specs.values()))
    joint: dict[GroupSpec, list[int]] = {}  # groups of one spec are looked up together (:722-747)
    for g in sorted(specs):
        joint.setdefault(specs[g], []).append(g)
    order = sorted(joint.items(), key=lambda item: (not item[0].prefix, item[1][0]))  # full first (:755-759)
    length = (n_tokens - 1) // align * align
    while True:
        candidate = length
        for spec, ids in order:
            candidate = min(candidate, _group_hit(spec, _all_held(held, ids), candidate, align))
        if candidate >= length:
            return length
        length = candidate


def _all_held(held: Held, ids: list[int]) -> Callable[[int], bool]:
    return lambda i: all(held(g, i) for g in ids)


def _group_hit(spec: GroupSpec, held: Callable[[int], bool], max_length: int, align: int) -> int:
    bs = spec.block_size
    n = max_length // bs
    if spec.prefix:
        i = 0
        while i < n and held(i):
            i += 1
        return i * bs // align * align  # the coordinator trims to the reconciled, aligned length
    if spec.kind in SLIDING_KINDS:
        return _sliding_hit(spec, held, n, align)
    for i in range(n - 1, -1, -1):  # Mamba: the last aligned state at or below the cap
        if held(i) and (i + 1) * bs % align == 0:
            return (i + 1) * bs
    return 0


def _sliding_hit(spec: GroupSpec, held: Callable[[int], bool], n: int, align: int) -> int:
    bs = spec.block_size
    need = cdiv((spec.window or bs) - 1, bs)
    run = 0
    for i in range(n - 1, -1, -1):
        if held(i):
            if run == 0 and bs != align and (i + 1) * bs % align:
                continue  # a run must end on an aligned boundary
            run += 1
            if run >= need:
                return (i + run) * bs
        else:
            run = 0
    length = run * bs  # the run that reached block 0, aligned down
    return length // align * align


def held_from(bits: Mapping[int, Sequence[bool]]) -> Held:
    """A :data:`Held` over per-group lists of booleans (block i held)."""
    return lambda g, i: i < len(bits.get(g, ())) and bool(bits[g][i])
