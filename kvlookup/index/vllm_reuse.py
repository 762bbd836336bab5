"""``reusable_prefix_length`` of vLLM matches: the hit vLLM's own coordinator would take.

For each vLLM rank of an answer (``?detail=1``), the rank's KV cache groups
(``keys.group_field``, learned from its stores) and the GPU records of each group give, block
by block, what the engine's GPU block pool holds for the prompt; kvlookup.index.vllm_groups
.reusable_length runs vLLM's fixed point over them. A rank without learned groups is one
full-attention group per prefix chain it uses (a plain model: the unitary coordinator).
Only the GPU medium counts: the coordinator looks in the GPU block pool; CPU and storage
tiers reach the engine through its connector, not through this hit.

Costs one HGETALL of each instance hash, one HMGET of each rank's worker hash and one pipeline
of ZSCOREs (one per block and group) per answer; only ``?detail=1`` pays it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlookup import kinds
from kvlookup.hashing import vllm as vh
from kvlookup.index import keys
from kvlookup.index.vllm_groups import GroupSpec, held_from, is_prefix_group, reusable_length

GPU = "GPU"


def fill_reusable(r, tokens: Sequence[int], matches, lora_name: str | None = None,
                  cache_salt: str | None = None) -> None:
    """Set ``reusable`` ({rank: tokens}) on every match that has vLLM ranks. Raises redis errors."""
    for m in matches:
        if not m.ranks:
            continue
        fields = r.hgetall(keys.instance_key(m.instance_id))
        if kinds.of(fields.get("kind")) is not kinds.VLLM:
            continue
        m.reusable = {rank: _rank_reusable(r, m.instance_id, rank, fields, tokens, lora_name, cache_salt)
                      for rank in m.ranks}


def rank_groups(fields: dict, rank: str) -> dict[int, GroupSpec]:
    """The learned groups of ``rank`` from its instance hash ``fields``."""
    prefix = keys.group_field(rank, 0)[:-1]
    out = {}
    for name, value in fields.items():
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            spec = GroupSpec.parse(value)
            if spec is not None:
                out[int(name[len(prefix):])] = spec
    return out


def _rank_reusable(r, instance_id: str, rank: str, fields: dict, tokens: Sequence[int],
                   lora_name: str | None, cache_salt: str | None) -> int:
    chains = keys.parse_vllm_chains(fields.get(keys.rank_field("block_size", rank)) or "")
    lookahead = {bs: la for bs, la in chains}
    groups = rank_groups(fields, rank)
    layouts = [groups] if groups else [{0: GroupSpec(None, bs)} for bs, _ in chains]
    best = 0
    for layout in layouts:
        spaces = {g: (keys.vllm_space(s.block_size) if is_prefix_group(g, s)
                      else keys.vllm_group_space(s.block_size, g)) for g, s in layout.items()}
        hids = r.hmget(keys.worker_key(instance_id, rank), [keys.location_field(GPU, sp) for sp in spaces.values()])
        holder = dict(zip(spaces, hids, strict=True))
        bits: dict[int, list[bool]] = {}
        pipe = r.pipeline(transaction=False)
        asked: list[tuple[int, int]] = []
        for g, spec in layout.items():
            if holder[g] is None:
                continue
            hashes = vh.chain(vh.request_root(spec.block_size, lora_name, cache_salt), tokens, spec.block_size,
                              lookahead=lookahead.get(spec.block_size, 0))
            for h in hashes:
                pipe.zscore(keys.chunk_key(h, spaces[g]), holder[g])
            asked.append((g, len(hashes)))
        scores = pipe.execute() if asked else []
        at = 0
        for g, n in asked:
            bits[g] = [s is not None for s in scores[at:at + n]]
            at += n
        best = max(best, reusable_length(layout, held_from(bits), len(tokens)))
    return best
