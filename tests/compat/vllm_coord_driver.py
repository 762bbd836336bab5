"""Run vLLM's OWN HybridKVCacheCoordinator.find_longest_cache_hit on a given block layout (test
helper, under the vLLM publisher venv: KVLOOKUP_VLLM_PYTHON).

vLLM's ``vllm/v1/core/kv_cache_coordinator.py`` and ``single_type_kv_cache_manager.py`` are
loaded from an unpacked source tree through tests/compat/vllm_tree.py (engine-only imports
become recorded stand-ins); the fixed point, the per-kind
finders and ``resolve_block_hashes`` are vLLM's code. The coordinator is built without its
``__init__`` (which needs a whole engine config): its attributes are set as ``__init__`` and
``verify_and_split_kv_cache_groups`` would set them for this layout (no EAGLE, DCP 1, hits
aligned to the scheduler block, the hash block the smallest block size). The block pool is a stand-in whose
``get_cached_block(hash, group_ids)`` answers from the layout.

stdin: ``{"cases": [{"groups": [{"kind": "sliding_window", "block_size": 16, "window": 32}, ...],
"held": [[true, ...], ...], "n_tokens": 100}, ...]}``; stdout: ``{"hit_lengths": [N, ...],
"vllm_version": ..., "placeholders": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

EXTRA_STUBS = ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_metrics", "vllm.v1.hisparse",
               "vllm.v1.hisparse.block_pool", "vllm.v1.kv_cache_spec_registry")
SPEC_CLASSES = {"full_attention": "FullAttentionSpec", "sliding_window": "SlidingWindowSpec", "mamba": "MambaSpec"}
MANAGERS = {"full_attention": "FullAttentionManager", "sliding_window": "SlidingWindowManager",
            "mamba": "MambaManager"}


class Pool:
    """The block pool as the finders use it: hash_block_size, null_block, get_cached_block.

    Hashes are the indexes of hash_block_size blocks; a group of a coarser block size is asked for
    the hash at the last hash block of its block (vLLM's BlockHashListWithBlockSize), so its block
    index is (hash + 1) * hash_block_size // block_size - 1."""

    def __init__(self, held: list[list[bool]], hash_block_size: int, block_sizes: list[int]):
        self.held, self.hash_block_size, self.null_block = held, hash_block_size, "null"
        self.block_sizes = block_sizes

    def get_cached_block(self, block_hash: int, group_ids: list[int]):
        def held(g: int) -> bool:
            i = (block_hash + 1) * self.hash_block_size // self.block_sizes[g] - 1
            return i < len(self.held[g]) and self.held[g][i]

        if all(held(g) for g in group_ids):
            return [f"g{g}b{block_hash}" for g in group_ids]
        return None


class Manager:
    def __init__(self, block_size: int, pool: Pool):
        self.block_size, self.block_pool = block_size, pool
        self.dcp_world_size = self.pcp_world_size = 1
        self.retains_longer_hit = False


def hit_length(coord_mod, managers, kvi, groups: list[dict], held: list[list[bool]], n_tokens: int) -> int:
    """vLLM's find_longest_cache_hit for one layout (one group per spec)."""
    hash_bs = min(g["block_size"] for g in groups)
    pool = Pool(held, hash_bs, [g["block_size"] for g in groups])
    specs = []
    for g in groups:
        spec = getattr(kvi, SPEC_CLASSES[g["kind"]])()
        spec.block_size = g["block_size"]
        spec.sliding_window = g.get("window")
        spec.mamba_cache_mode = "align"
        specs.append(spec)
    coord = object.__new__(coord_mod.HybridKVCacheCoordinator)
    coord.kv_cache_config = type("Cfg", (), {"kv_cache_groups": groups})()
    coord.single_type_managers = tuple(Manager(g["block_size"], pool) for g in groups)
    coord.hash_block_size = hash_bs
    coord.scheduler_block_size = math.lcm(*(g["block_size"] for g in groups))
    coord.enable_partial_hash_hits = False
    coord.attention_groups = []
    for i, g in enumerate(groups):  # groups of one spec are looked up together (verify_and_split_kv_cache_groups)
        same = [sg for sg in coord.attention_groups if groups[sg.group_ids[0]] == g]
        if same:
            same[0].group_ids.append(i)
        else:
            coord.attention_groups.append(
                coord_mod.SpecGroup(specs[i], [i], getattr(managers, MANAGERS[g["kind"]]), False))
    coord.attention_groups.sort(key=lambda sg: not isinstance(sg.spec, kvi.FullAttentionSpec))  # as vLLM sorts
    block_hashes = list(range(n_tokens // hash_bs))  # the request's hashes, at hash_block_size
    return coord.find_longest_cache_hit(block_hashes, n_tokens - 1)[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/compat: vllm_tree
    import importlib

    import vllm_tree

    vllm_tree.STANDIN_MODULES = vllm_tree.STANDIN_MODULES + EXTRA_STUBS
    vllm = vllm_tree.load(args.vllm_src)

    coord_mod = importlib.import_module("vllm.v1.core.kv_cache_coordinator")
    managers = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    kvi = sys.modules["vllm.v1.kv_cache_interface"]

    cases = json.loads(sys.stdin.read())["cases"]
    hits = [hit_length(coord_mod, managers, kvi, c["groups"], c["held"], c["n_tokens"]) for c in cases]
    print(json.dumps({"hit_lengths": hits, "vllm_version": vllm.version,
                      "placeholders": sorted(set(vllm.standins))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
