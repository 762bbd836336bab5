"""vLLM 0.33 event semantics against a real Redis: hybrid models' KV cache groups, several block
sizes on one rank (LMCache MP connector CPU chunks beside GPU blocks), EAGLE lookahead hashes,
ownership and locality, and ``reusable_prefix_length`` as vLLM's coordinator computes it."""

from __future__ import annotations

import pytest

from kvlookup.app import create_app
from kvlookup.client import Client, VllmChains
from kvlookup.hashing import vllm as vh
from kvlookup.index import keys
from kvlookup.index.vllm_groups import GroupSpec, held_from, reusable_length
from kvlookup.sidecar.vllm_ingest import VllmIngest
from tests.support.vllm_helpers import Stream, detail, layout, removed, stored

A = list(range(1000, 1032))  # 2 blocks of 16
P = list(range(5000, 5512))  # 512 tokens: 2 LMCache chunks of 256, 32 blocks of 16
SW = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}
FULL = {"kv_cache_spec_kind": "full_attention"}
MAMBA = {"kv_cache_spec_kind": "mamba"}


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


def test_group0_sliding_window_group1_full_attention(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, group_idx=0, **SW), stored([1, 2], A, group_idx=1, **FULL))
    assert layout(client, A + [7], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}
    inst = r.hgetall(keys.instance_key("pod-a"))
    assert (inst["group:0:0"], inst["group:0:1"]) == ("sliding_window|16|32", "full_attention|16|")
    s.send(ing, removed([1, 2]) | {"group_idx": 0})  # the sliding-window group drops its copies
    assert layout(client, A + [7], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}
    assert sorted(r.hkeys(keys.engine_map_key("pod-a", 0))) == ["1@1", "2@1"]
    s.send(ing, removed([2]) | {"group_idx": 1})
    assert layout(client, A + [7], "locations") == {"pod-a": ("GPU", 16, {"GPU": 16})}
    assert ing.rejected == {} and ing.skipped == {}


def test_a_sliding_window_only_group_never_extends_the_prefix(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, group_idx=0, **SW))
    assert layout(client, A, "locations") == {}
    assert r.hgetall(keys.block_sizes_key()) == {}


def test_two_full_attention_groups_share_the_record(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, group_idx=0, **SW), stored([1, 2], A, group_idx=1, **FULL),
           stored([1, 2], A, group_idx=2, **FULL))
    s.send(ing, removed([1, 2]) | {"group_idx": 1})
    assert layout(client, A + [7], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}  # group 2 still holds them
    s.send(ing, removed([1, 2]) | {"group_idx": 2})
    assert layout(client, A + [7], "locations") == {}


def test_gpu_blocks_and_mp_connector_cpu_chunks_on_one_rank(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([11, 12, 13], P[:48], group_idx=0, **FULL))
    # LMCache's MP connector: one 256-token chunk per event, LMCache hashes, no group_idx
    s.send(ing, stored([0xC0], P[:256], bs=256, medium="CPU"))
    s.send(ing, stored([0xC1], P[256:], bs=256, medium="CPU", parent=0xC0))
    assert layout(client, P, "locations") == {"pod-a": ("CPU", 512, {"GPU": 48, "CPU": 512})}
    assert layout(client, P[:300], "locations") == {"pod-a": ("CPU", 256, {"GPU": 48, "CPU": 256})}
    assert layout(client, P[:40], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}
    assert r.hgetall(keys.block_sizes_key()) == {"0\tpod-a": "16,256"}
    s.send(ing, removed([0xC0, 0xC1, 0xDEAD], medium="CPU"))  # the connector's withdraw-all
    assert layout(client, P, "locations") == {"pod-a": ("GPU", 48, {"GPU": 48})}
    assert ing.rejected == {} and ing.skipped == {"remove_unknown": 1}


def test_lookahead_block_counts_only_for_prompts_that_continue_with_it(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1], A[:16], group_idx=0, lookahead_token_ids=[[A[16]]], **FULL))
    assert layout(client, A, "locations") == {"pod-a": ("GPU", 16, {"GPU": 16})}
    assert layout(client, A[:16] + [9], "locations") == {}
    assert layout(client, A[:16], "locations") == {}  # no token after the block: vLLM never hashes it
    s.send(ing, stored([2], A[16:], parent=1, group_idx=0, lookahead_token_ids=[[3]], **FULL))
    assert layout(client, A + [3], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}
    assert r.hgetall(keys.block_sizes_key()) == {"0\tpod-a": "16+1"}
    s.send(ing, stored([1], A[:16], lookahead_token_ids=[[1], [2]]))  # two lists for one block
    assert ing.rejected == {"lookahead": 1}


def test_ownership_is_a_residency_and_remote_tiers_are_not_credited(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A), stored([1, 2], [], medium="CPU"),
           stored([1, 2], [], medium="CPU", ownership="kvcr"),
           stored([1, 2], [], medium="STORAGE", locality="REMOTE"))
    assert layout(client, A, "locations") == {"pod-a": ("GPU", 32, {"GPU": 32, "CPU": 32})}
    s.send(ing, removed([1, 2]), removed([1, 2], medium="CPU"))
    assert layout(client, A, "locations") == {"pod-a": ("CPU", 32, {"CPU": 32})}  # the kvcr copy stays
    s.send(ing, removed([1, 2], medium="CPU") | {"ownership": "kvcr"})
    assert layout(client, A, "locations") == {}
    assert ing.skipped == {"remote_tier": 1}


def test_session_id_is_kept_for_explain(store, r, redis_settings):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, session_id="sess-42"))
    assert r.hget(keys.instance_key("pod-a"), "session:0") == "sess-42"
    http = create_app({**redis_settings, "instance_ttl_s": 0}).test_client()
    out = http.post("/lookup/explain", json={"tokens": A + [7]}).json
    assert [(e["instance_id"], e["worker_id"], e["matched_prefix_length"], e.get("session_id"))
            for e in out["instances"]] == [("pod-a", "0", 32, "sess-42")]


def test_placeholder_offload_store_of_a_known_block(store, r, client):
    """vLLM's offloading tracker sends block_size 0 and no tokens for keys it has no metadata
    for (kv_connector/v1/offloading/events.py:352-382): resolved through the engine map."""
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, group_idx=0, **FULL), stored([1, 2], [], bs=0, medium="CPU", group_idx=0))
    assert layout(client, A, "locations") == {"pod-a": ("GPU", 32, {"GPU": 32, "CPU": 32})}
    assert ing.rejected == {}


# -- reusable_prefix_length ---------------------------------------------------------------------

# Worked example, traced through vLLM 0.33.0's HybridKVCacheCoordinator.find_longest_cache_hit
# (vllm/v1/core/kv_cache_coordinator.py:806-941) with block_size 16 in every group, so the
# scheduler block (alignment) is 16, and a 100-token prompt: max_cache_hit_length = 99
# (kv_cache_manager.py:302), 6 full blocks.
#   group 0 sliding_window, window 32: cdiv(31, 16) = 2 contiguous blocks needed (:955-966)
#   group 1 full_attention; group 2 mamba
#   held: full {0..5}; sliding {0, 1, 3, 4}; mamba states after blocks {1, 3}
# iteration 1, cap 99: full -> 6 blocks = 96 (:790-800); sliding scans 5 (miss), 4, 3 -> run of
#   2 ending at 3+2 -> 80 (:1015-1048); mamba, 80 // 16 = 5 blocks, scans 4 (miss), 3 -> 64 (:1522-1544)
# iteration 2, cap 64: full trims to 64 (coordinator :850-856); sliding scans 3 (run 1), 2 (miss: 0), 1, 0
#   -> run of 2 ending at 0+2 -> 32; mamba, 2 blocks, 1 held -> 32
# iteration 3, cap 32: full 32, sliding 1, 0 -> 32, mamba 1 -> 32: no group lowers it, 32.
WORKED_GROUPS = {0: GroupSpec("sliding_window", 16, 32), 1: GroupSpec("full_attention", 16),
                 2: GroupSpec("mamba", 16)}
WORKED_HELD = {0: [True, True, False, True, True, False], 1: [True] * 6,
               2: [False, True, False, True, False, False]}


def test_worked_example_model():
    assert reusable_length(WORKED_GROUPS, held_from(WORKED_HELD), 100) == 32
    # without the mamba group the sliding window alone stops at 80
    assert reusable_length({g: WORKED_GROUPS[g] for g in (0, 1)}, held_from(WORKED_HELD), 100) == 80
    # a plain model: the longest run capped at len - 1, block-aligned (a 96-token prompt reuses 80)
    assert reusable_length({0: GroupSpec("full_attention", 16)}, held_from({0: [True] * 6}), 96) == 80


def test_reusable_prefix_length_in_detail(store, r, client):
    T = list(range(7000, 7100))  # 100 tokens, 6 full blocks
    ing, s = VllmIngest(store, "pod-a"), Stream()
    blocks = [T[i * 16:(i + 1) * 16] for i in range(6)]
    events = []
    for g, kind in ((0, SW), (1, FULL), (2, MAMBA)):
        for i, tokens in enumerate(blocks):
            parent = None if i == 0 else 100 * g + i - 1
            events.append(stored([100 * g + i], tokens, parent=parent, group_idx=g, **kind))
    s.send(ing, *events)
    drop = [100 * 0 + i for i in (2, 5)] + [100 * 2 + i for i in (0, 2, 4, 5)]
    s.send(ing, removed([h for h in drop if h < 100]) | {"group_idx": 0},
           removed([h for h in drop if h >= 200]) | {"group_idx": 2})
    got = detail(client, T)["pod-a"]
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (96, 32)
    own = vh.chain(vh.request_root(16), T, 16)
    hid = r.hget(keys.worker_key("pod-a", 0), keys.location_field("GPU", "v16g2"))
    assert [r.zscore(keys.chunk_key(h, "v16g2"), hid) is not None for h in own] == WORKED_HELD[2]


def test_partial_tail_store_keeps_the_group_block_size(store, r, client):
    """Hybrid models' partial-tail stores come at hash_block_size: credited at 16, the group stays 32."""
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1], A, bs=32, group_idx=1, **FULL), stored([2], A[:16], bs=16, group_idx=1, **FULL))
    assert r.hget(keys.instance_key("pod-a"), "group:0:1") == "full_attention|32|"
    assert layout(client, A + [7], "locations") == {"pod-a": ("GPU", 32, {"GPU": 32})}
    assert r.hgetall(keys.block_sizes_key()) == {"0\tpod-a": "16,32"}


def test_sparse_group_store_is_placed_through_another_group(store, r, client):
    """vLLM 0.33's sparse store (Mamba align mode, sparse retention: block_pool.py:277-317): only
    the kept blocks' hashes, the whole range's tokens. Placed at the end of the batch through the
    full-attention group's entry of the same hash; a hash no group holds at that block size is
    counted, never guessed."""
    T = list(range(7000, 7100))  # 100 tokens, 6 full blocks
    ing, s = VllmIngest(store, "pod-a"), Stream()
    full = [stored([10 + i], T[16 * i:16 * i + 16], parent=None if i == 0 else 9 + i, group_idx=1, **FULL)
            for i in range(6)]
    s.send(ing, stored([15], T[:96], group_idx=0, **MAMBA), *full)  # the Mamba store comes first
    got = detail(client, T)["pod-a"]
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (96, 96)
    assert r.hget(keys.engine_map_key("pod-a", 0), "15") == f"{vh.chain(vh.request_root(16), T, 16)[5]}|GPU|v16g0"
    s.send(ing, stored([99], T[:64], bs=32, group_idx=2, **SW))  # no group holds 99 at 32
    assert (ing.rejected, ing.skipped) == ({}, {"sparse_unplaced": 1})
