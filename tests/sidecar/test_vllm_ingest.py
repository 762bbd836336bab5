"""vLLM event semantics against a real Redis: stores, removals, offload, LoRA, clears,
malformed events, sequence gaps, replay, engine and sidecar restarts."""

from __future__ import annotations

import pytest

from kvlookup.client import Client, VllmChains
from kvlookup.hashing import vllm as vh
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.sidecar.vllm_ingest import VllmIngest, digest
from tests.support.vllm_helpers import Stream, cleared, layout, removed, stored

A = list(range(1000, 1032))  # 2 blocks of 16
B = list(range(2000, 2016))
H1, H2, H3 = 16823396573910764246, 9852303496387231819, 9705754376319679393


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


def test_store_chain_remove(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([H1, H2], A))
    s.send(ing, stored([H3], B, parent=H2))
    assert layout(client, A + B + [7], "locations", "ranks") == {"pod-a": ("GPU", 48, {"GPU": 48}, {"0": 48})}
    assert layout(client, A[:16] + B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
    assert r.hgetall(keys.instance_key("pod-a")) == {
        "kind": "vllm", "worker_rule": "any", "block_size": "16", "block_size:0": "16", "seq:0": "1",
        "digest:0": r.hget(keys.instance_key("pod-a"), "digest:0")}
    assert r.hgetall(keys.block_sizes_key()) == {"0\tpod-a": "16"}
    s.send(ing, removed([H2]))
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
    own = vh.chain(vh.request_root(16), A + B, 16)
    assert r.hgetall(keys.engine_map_key("pod-a", 0)) == {str(H1): f"{own[0]}|GPU|v16", str(H3): f"{own[2]}|GPU|v16"}
    s.send(ing, removed([H1, H3, 12345]))
    assert layout(client, A + B, "locations", "ranks") == {}
    assert r.exists(keys.engine_map_key("pod-a", 0)) == 0
    assert ing.skipped == {"remove_unknown": 1} and ing.rejected == {}


def test_offload_to_cpu_without_tokens(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([H1, H2], A), stored([H1, H2], [], medium="CPU"))
    assert layout(client, A, "locations", "ranks") == {"pod-a": ("GPU", 32, {"GPU": 32, "CPU": 32}, {"0": 32})}
    s.send(ing, removed([H1, H2]))
    assert layout(client, A, "locations", "ranks") == {"pod-a": ("CPU", 32, {"CPU": 32}, {"0": 32})}
    own = vh.chain(vh.request_root(16), A, 16)
    assert r.hgetall(keys.engine_map_key("pod-a", 0)) == {str(H1): f"{own[0]}|CPU|v16", str(H2): f"{own[1]}|CPU|v16"}
    s.send(ing, stored([H1], [], medium="GPU"), removed([H2], medium="CPU"))  # reload block 1 to GPU
    assert layout(client, A, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16, "CPU": 16}, {"0": 16})}
    assert ing.rejected == {}


def test_lora_and_cache_salt_are_separate_namespaces(store, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A, lora_id=1, lora_name="sql-lora", extra_keys=[["sql-lora"], ["sql-lora"]]))
    s.send(ing, stored([3, 4], B + B, extra_keys=[["salt-1"], None]))
    s.send(ing, stored([5], B, lora_id=2, lora_name="chat-lora"), form="array")
    assert layout(client, A, "locations", "ranks") == {}
    assert layout(client, A, "locations", "ranks", lora_name="other") == {}
    assert (layout(client, A, "locations", "ranks", lora_name="sql-lora") ==
            {"pod-a": ("GPU", 32, {"GPU": 32}, {"0": 32})})
    assert layout(client, B + B, "locations", "ranks") == {}
    assert layout(client, B + B, "locations", "ranks", cache_salt="salt-2") == {}
    assert (layout(client, B + B, "locations", "ranks", cache_salt="salt-1") ==
            {"pod-a": ("GPU", 32, {"GPU": 32}, {"0": 32})})
    assert (layout(client, B, "locations", "ranks", lora_name="chat-lora") ==
            {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})})
    assert layout(client, B, "locations", "ranks", lora_name="sql-lora") == {}


def test_all_blocks_cleared(store, r, client):
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([H1, H2], A))
    s.send(ing, cleared(), stored([H3], B))
    assert layout(client, A, "locations", "ranks") == {}
    assert layout(client, B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
    assert r.hkeys(keys.engine_map_key("pod-a", 0)) == [str(H3)]
    s.send(ing, stored([9], A[16:], parent=H2))  # the parent went with the clear
    assert ing.rejected == {"unknown_parent": 1}
    assert store.purge() == 2  # the two cleared records, later and in bounded steps


def test_malformed_events_are_rejected_whole(store, r, client):
    other, so = VllmIngest(store, "pod-b"), Stream()
    so.send(other, stored([H1, H2], A))
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([1, 2], A[:31]),  # token count
           stored([3], B, parent=999),  # unknown parent
           stored([4, 5], [], medium="CPU"),  # token-less, never stored with tokens
           stored([6], B, bs=0), stored([7], B, bs=None),
           {"type": "BlockStored", "block_hashes": [8], "token_ids": B},  # block_size missing
           stored([9, 10], A, extra_keys=[None]),
           {"type": "Bogus"}, "junk",
           stored([11], B))  # the one good event of the batch
    s.send(ing, stored([12], B, bs=32))  # 16 tokens for one block of 32
    s.send(None, b"")  # not even a batch: counted, seq advances
    ing.handle_live(0, [b"kv@pod-a", (2).to_bytes(8, "big"), b"\x93\xc1"])
    ing.handle_live(0, [b"kv@pod-a", b"\x00"])
    assert ing.rejected == {"token_count": 2, "unknown_parent": 1, "unknown_hashes": 1, "block_size": 3,
                            "extra_keys": 1, "unknown_type": 1, "event_shape": 1, "msgpack": 1, "frames": 1}
    assert r.hkeys(keys.engine_map_key("pod-a", 0)) == [str(11)]
    assert layout(client, B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
    assert layout(client, A, "locations", "ranks") == {"pod-b": ("GPU", 32, {"GPU": 32}, {"0": 32})}
    assert ing.ranks[0].last == 2 and other.rejected == {}


def test_gap_is_healed_by_replay_once(store, r, client):
    s = Stream()
    ing = VllmIngest(store, "pod-a", replay=s.replay)
    s.send(ing, stored([H1, H2], A))
    s.send(ing, stored([H3], B, parent=H2), deliver=False)  # lost on the wire
    s.send(ing, removed([H1]), deliver=False)
    s.send(ing, stored([H1], A[:16]))  # gap: 1 and 2 replayed, 3 applied once
    assert s.replays == [1]
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 48, {"GPU": 48}, {"0": 48})}
    ing.handle_live(0, [b"kv@pod-a", (2).to_bytes(8, "big"), s.buffer[2][1]])
    assert ing.resyncs == {"engine_restart": 1}  # a live seq going back is a restart: cleared,
    assert s.replays == [1, 0]  # then rebuilt from seq 0 because the buffer still reaches it
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 48, {"GPU": 48}, {"0": 48})}
    assert r.hget(keys.worker_key("pod-a", 0), "epoch") == "2"


def test_duplicates_after_replay_are_skipped(store, client):
    s = Stream()
    ing = VllmIngest(store, "pod-a", replay=s.replay)
    s.send(ing, stored([H1, H2], A))
    s.send(ing, stored([H3], B, parent=H2), deliver=False)
    s.send(ing, removed([H3]), deliver=False)
    s.send(ing, stored([9], B), deliver=False)
    ing.handle_live(0, [b"kv@pod-a", (2).to_bytes(8, "big"), s.buffer[2][1]])  # gap: replays 1..3
    assert ing.ranks[0].last == 3 and s.replays == [1]
    ing.handle_live(0, [b"kv@pod-a", (3).to_bytes(8, "big"), s.buffer[3][1]])  # seen in replay
    assert ing.duplicates == 1 and ing.resyncs == {}
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 32, {"GPU": 32}, {"0": 32})}


@pytest.mark.parametrize("replay,reason", [(False, "no_replay"), (True, "replay_miss")])
def test_unhealable_gap_clears_and_marks_resync(store, r, client, replay, reason):
    s = Stream(buffer=2)
    ing = VllmIngest(store, "pod-a", replay=s.replay if replay else None)
    s.send(ing, stored([H1, H2], A))
    for _ in range(3):
        s.send(ing, stored([5], B), deliver=False)
    s.send(ing, stored([H3], B, parent=H2))  # seq 4; buffer holds 3, 4 only
    assert ing.resyncs == {reason: 1}
    assert r.hget(keys.instance_key("pod-a"), "resync:0") == reason
    assert layout(client, A, "locations", "ranks") == {}
    assert ing.rejected == {"unknown_parent": 1}  # seq 4's parent was cleared with the rest
    assert layout(client, B, "locations", "ranks") == ({"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})} if replay else {})
    s.send(ing, stored([H1, H2], A))  # live events after the resync are indexed
    assert layout(client, A, "locations", "ranks")["pod-a"][1] == 32


def test_engine_restart_clears(store, r, client):
    s = Stream()
    ing = VllmIngest(store, "pod-a", replay=s.replay)
    s.send(ing, stored([H1, H2], A))
    s.send(ing, stored([H3], B, parent=H2))
    s.restart()
    s.send(ing, stored([7], B))
    assert ing.resyncs == {"engine_restart": 1}
    assert r.hget(keys.worker_key("pod-a", 0), "epoch") == "2"  # first contact, then the restart
    assert layout(client, A, "locations", "ranks") == {}
    assert layout(client, B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
    assert r.hget(keys.instance_key("pod-a"), "resync:0") is None


def test_late_join_is_rebuilt_from_seq_zero(store, r, client):
    s = Stream()
    s.send(None, stored([H1, H2], A))
    s.send(None, stored([H3], B, parent=H2))
    ing = VllmIngest(store, "pod-a", replay=s.replay)
    s.send(ing, removed([H1]), stored([H1], A[:16]))
    assert s.replays == [0] and ing.resyncs == {}
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 48, {"GPU": 48}, {"0": 48})}


def test_sidecar_restart_resumes_or_clears(store, r, client):
    s = Stream()
    first = VllmIngest(store, "pod-a", replay=s.replay)
    s.send(first, stored([H1, H2], A))
    s.send(first, stored([H3], B, parent=H2))
    s.send(None, removed([H3]))  # published while no sidecar listens
    again = VllmIngest(Store(r), "pod-a", replay=s.replay)
    s.send(again, stored([9], A[16:], parent=H1))
    assert s.replays == [1] and again.resyncs == {}  # replayed from the persisted seq, digest matched
    assert r.hget(keys.worker_key("pod-a", 0), "epoch") == "1"
    assert layout(client, A + B, "locations", "ranks") == {"pod-a": ("GPU", 32, {"GPU": 32}, {"0": 32})}
    s.restart()  # engine restarted while the sidecar was down: seq 1's digest differs now
    s.send(None, stored([H1, H2], A[:16] + B))
    third = VllmIngest(Store(r), "pod-a", replay=s.replay)
    s.send(third, removed([H2]))
    assert s.replays[1:] == [3, 0] and third.resyncs == {}
    assert r.hget(keys.worker_key("pod-a", 0), "epoch") == "2"  # cleared, rebuilt from the new seq 0
    assert layout(client, A, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}  # was 32
    assert layout(client, A[:16] + B, "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}


def test_key_strings():
    assert keys.engine_map_key("pod-a", 1) == "kvl:v2:blocks:pod-a:1"
    assert keys.vllm_space(16) == "v16"
    assert keys.chunk_key(5, keys.vllm_space(16)) == "kvl:v2:chunk:v16:5"
    assert keys.block_sizes_key() == "kvl:v2:{r}:block_sizes"
    assert keys.rank_field("seq", 0) == "seq:0"


def test_block_sizes_of_gone_ranks_leave_the_walk(store, r):
    """One instance with block_size 1 must not make every lookup hash a 1M-token chain for
    good: the walk covers the block sizes of registered ranks with a live lease only."""
    chains = VllmChains(r, refresh_s=0)
    odd, usual = VllmIngest(store, "odd"), VllmIngest(store, "usual")
    Stream().send(odd, stored([H1], A[:1], bs=1))
    Stream().send(usual, stored([H1, H2], A))
    assert chains.block_sizes() == [1, 16]
    r.zadd(keys.alive_key(), {"odd": 0})  # its sidecar stopped renewing the lease
    assert chains.block_sizes() == [16]
    store.touch_instance("odd")
    assert chains.block_sizes() == [1, 16]
    store.deregister_worker("odd", 0)
    assert chains.block_sizes() == [16]
    assert r.hgetall(keys.block_sizes_key()) == {"0\tusual": "16"}


def _calls(r, name: str) -> int:
    """Calls of command ``name`` the one Redis has served."""
    return int(r.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@pytest.mark.single_node  # counts commands on the one server
def test_the_engine_map_is_not_read_per_batch(store, r, client):
    """A rank this sidecar started fresh keeps its engine map in a mirror: continuing chains,
    removing and re-storing blocks read nothing of the map; each batch is one round trip of
    records and map writes. A sidecar resuming the stream reads the map once."""
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([H1, H2], A))
    before = _calls(r, "hmget") + _calls(r, "hgetall")
    s.send(ing, stored([H3], B, parent=H2))
    s.send(ing, removed([H3]))
    s.send(ing, stored([H3], B, parent=H2))
    s.send(ing, stored([H3], medium="CPU"))  # token-less: resolved from the mirror
    assert _calls(r, "hmget") + _calls(r, "hgetall") == before
    assert layout(client, A + B + [7], "locations", "ranks") == {
        "pod-a": ("GPU", 48, {"GPU": 48, "CPU": 16}, {"0": 48})}
    assert r.hget(keys.engine_map_key("pod-a", 0), str(H3)).endswith("|CPU,GPU|v16")
    resumed = VllmIngest(Store(r, instance_ttl_s=0, purge_grace_s=0), "pod-a", replay=s.replay)
    reads = (_calls(r, "hgetall"), _calls(r, "hmget"))
    s.send(resumed, removed([H3], medium="CPU"))
    s.send(resumed, removed([H3]))
    # first contact reads the persisted rank fields (HGETALL of the instance hash), then the map once
    assert (_calls(r, "hgetall") - reads[0], _calls(r, "hmget") - reads[1]) == (2, 0)
    assert layout(client, A + B + [7], "locations", "ranks") == {"pod-a": ("GPU", 32, {"GPU": 32}, {"0": 32})}


def test_batches_read_together_are_applied_as_one_and_keep_the_sequence(store, r, client):
    """Messages the SUB handler read together: a consecutive run is one write (the last seq and
    digest persisted); a bad frame and a gap are handled as when they come alone."""
    ing, s = VllmIngest(store, "pod-a"), Stream()
    s.send(ing, stored([H1], A[:16]))
    msgs = []
    for ev in (stored([H2], A[16:], parent=H1), stored([H3], B, parent=H2)):
        seq = s.send(None, ev, deliver=False)
        msgs.append([b"kv@pod-a", seq.to_bytes(8, "big"), s.buffer[-1][1]])
    msgs.append([b"kv@pod-a", b"\x00"])  # a broken frame
    ing.handle_live_many(0, msgs)
    assert layout(client, A + B + [7], "locations", "ranks") == {"pod-a": ("GPU", 48, {"GPU": 48}, {"0": 48})}
    assert r.hget(keys.instance_key("pod-a"), keys.rank_field("seq", 0)) == "2"
    assert r.hget(keys.instance_key("pod-a"), keys.rank_field("digest", 0)) == digest(s.buffer[-1][1])
    assert sum(ing.rejected.values()) == 1
    s.send(None, removed([H3]), deliver=False)  # seq 3 lost
    seq = s.send(None, removed([H2]), deliver=False)
    ing.replay = s.replay
    ing.handle_live_many(0, [[b"kv@pod-a", seq.to_bytes(8, "big"), s.buffer[-1][1]]])  # gap: replays 3..4
    assert s.replays == [3]
    assert layout(client, A + B + [7], "locations", "ranks") == {"pod-a": ("GPU", 16, {"GPU": 16}, {"0": 16})}
