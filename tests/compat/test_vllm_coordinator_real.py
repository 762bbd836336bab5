"""kvlookup's model of vLLM's cache hit (kvlookup.index.vllm_groups.reusable_length) against vLLM
0.33.0's OWN HybridKVCacheCoordinator.find_longest_cache_hit and its sliding-window, full
attention and Mamba finders, run by tests/compat/vllm_coord_driver.py from vLLM's source. Needs
KVLOOKUP_VLLM_PYTHON and KVLOOKUP_VLLM_SRC (scripts/real-peers.sh builds them)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from kvlookup.index.vllm_groups import GroupSpec, held_from, reusable_length
from tests.sidecar.test_vllm_hybrid import WORKED_GROUPS, WORKED_HELD
from tests.support.vllm_helpers import real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    real_vllm() is None, reason="KVLOOKUP_VLLM_PYTHON / KVLOOKUP_VLLM_SRC not set")]

DRIVER = Path(__file__).with_name("vllm_coord_driver.py")


def vllm_hits(cases: list[dict]) -> list[int]:
    py, src = real_vllm()
    out = subprocess.run([py, str(DRIVER), "--vllm-src", f"{src}/x/vllm-0.33.0"],
                         input=json.dumps({"cases": cases}), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["vllm_version"] == "0.33.0"
    return reply["hit_lengths"]


def case(groups: dict[int, GroupSpec], held: dict[int, list[bool]], n_tokens: int) -> dict:
    return {"groups": [{"kind": groups[g].kind, "block_size": groups[g].block_size, "window": groups[g].window}
                       for g in sorted(groups)],
            "held": [held[g] for g in sorted(groups)], "n_tokens": n_tokens}


def random_layout(rng: random.Random) -> tuple[dict[int, GroupSpec], dict[int, list[bool]], int]:
    bs = rng.choice((16, 32))
    kinds = rng.sample(["full_attention", "sliding_window", "mamba", "sliding_window"], rng.randint(1, 4))
    groups = {g: GroupSpec(k, bs, rng.choice((bs, 2 * bs, 3 * bs + 5, 100)) if k == "sliding_window" else None)
              for g, k in enumerate(kinds)}
    n_tokens = rng.randint(bs + 1, 12 * bs)
    n_blocks = n_tokens // bs
    density = rng.random()
    held = {g: [rng.random() < density for _ in range(n_blocks)] for g in groups}
    return groups, held, n_tokens


def test_worked_example_is_what_vllm_computes():
    assert vllm_hits([case(WORKED_GROUPS, WORKED_HELD, 100)]) == [32]
    assert reusable_length(WORKED_GROUPS, held_from(WORKED_HELD), 100) == 32


def assert_model_matches_vllm(layouts) -> None:
    """Our reusable_length equals vLLM's own coordinator on every layout, and the layouts
    exercise more than a few outcomes."""
    want = vllm_hits([case(*layout) for layout in layouts])
    got = [reusable_length(groups, held_from(held), n) for groups, held, n in layouts]
    mismatches = [(layouts[i], got[i], want[i]) for i in range(len(layouts)) if got[i] != want[i]]
    assert not mismatches, mismatches[:3]
    assert len(set(want)) > 5


def test_model_matches_vllm_on_random_layouts():
    rng = random.Random(20261202)
    assert_model_matches_vllm([random_layout(rng) for _ in range(200)])


def mixed_layout(rng: random.Random) -> tuple[dict[int, GroupSpec], dict[int, list[bool]], int]:
    """Groups of different block sizes (multiples of 16): hits aligned to their LCM."""
    kinds = rng.sample(["full_attention", "sliding_window", "mamba", "full_attention"], rng.randint(2, 4))
    groups = {}
    for g, k in enumerate(kinds):
        bs = rng.choice((16, 32, 64))
        groups[g] = GroupSpec(k, bs, rng.choice((bs, 2 * bs, 100)) if k == "sliding_window" else None)
    n_tokens = rng.randint(65, 640)
    density = rng.random()
    held = {g: [rng.random() < density for _ in range(n_tokens // s.block_size)] for g, s in groups.items()}
    return groups, held, n_tokens


def test_model_matches_vllm_with_mixed_block_sizes():
    rng = random.Random(20261203)
    assert_model_matches_vllm([mixed_layout(rng) for _ in range(200)])
