"""Schema-less decoding of vLLM KV event payloads: every fixture vLLM's own encoder wrote
(tests/fixtures/vllm, by tests/compat/vllm_publisher.py golden), both encodings, int and bytes
hashes; edge shapes; kvlookup's own chain hash."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array

import msgspec
import pytest

from kvlookup.hashing import vllm as vh
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Malformed,
    block_hash,
    decode_batch,
    decode_generic,
    decode_typed,
    parse_live,
    parse_replay,
)
from tests.support.vllm_helpers import FIXTURES, as_array, payload, removed, stored

FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("vllm-*-batch.msgpack"))
TOKENS = tuple(range(1000, 1032))
INT_HASHES = (16823396573910764246, 9852303496387231819)


def _expected_hash(value) -> int:
    return int.from_bytes(bytes.fromhex(value[4:])[-8:], "big") if isinstance(value, str) else value


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_decodes_to_recorded_fields(name):
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    expected = meta["batch"]
    batch = decode_batch((FIXTURES / f"{name}.msgpack").read_bytes())
    assert batch.ts == expected["ts"] == 1700000000.5
    assert batch.data_parallel_rank == expected["data_parallel_rank"] == 0
    ev_stored, ev_removed, ev_cleared = expected["events"]
    assert batch.events == (
        BlockStored(block_hashes=tuple(_expected_hash(h) for h in ev_stored["block_hashes"]),
                    parent_block_hash=None, token_ids=tuple(ev_stored["token_ids"]),
                    block_size=ev_stored["block_size"], lora_id=None, medium=ev_stored["medium"],
                    lora_name=ev_stored.get("lora_name"), extra_keys=None, group_idx=None),
        BlockRemoved(block_hashes=tuple(_expected_hash(h) for h in ev_removed["block_hashes"]), medium="GPU"),
        AllBlocksCleared(),
    )
    # bytes hashes reduce to exactly vLLM's int form (low 64 bits, big-endian)
    assert batch.events[0].block_hashes == INT_HASHES
    assert batch.events[0].token_ids == TOKENS
    assert batch.events[1].block_hashes == INT_HASHES[1:]


def test_fixtures_cover_both_encodings_and_hash_types():
    shapes = {}
    for name in FIXTURE_NAMES:
        meta = json.loads((FIXTURES / f"{name}.json").read_text())
        shapes[name] = meta["event_encoding"]
    assert shapes["vllm-0.10.2-batch"] == shapes["vllm-0.11.0-byteshash-batch"] == "array"
    assert shapes["vllm-0.25.1-batch"] == shapes["vllm-0.33.0-byteshash-batch"] == "map"
    assert len(FIXTURE_NAMES) == 10


def test_map_batch_and_trailing_fields():
    raw = msgspec.msgpack.encode({"ts": 5.0, "events": [
        ["BlockStored", [1], None, list(range(16)), 16],  # lora_id and medium missing
        ["BlockRemoved", [2]],
        {"type": "BlockStored", "block_hashes": [3], "token_ids": [], "block_size": 16, "medium": "CPU",
         "extra_keys": [["a", ["mm", 0]]], "group_idx": 0, "locality": "x", "future_field": 1},
        ["AllBlocksCleared"]]})
    batch = decode_batch(raw)
    assert batch.ts == 5.0 and batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((1,), None, tuple(range(16)), 16),
        BlockRemoved((2,), None),
        BlockStored((3,), None, (), 16, None, "CPU", None, (("a", ("mm", 0)),), 0, locality="x"),
        AllBlocksCleared(),
    )


def test_hash_forms():
    assert block_hash(2**64 - 1) == 2**64 - 1
    assert block_hash(-1) == 2**64 - 1  # a relay's signed int64
    assert block_hash(-(2**63)) == 2**63
    assert block_hash(b"\x01" * 24 + (5).to_bytes(8, "big")) == 5
    assert block_hash(b"\x07") == 7
    for bad in (True, 2**64, -(2**63) - 1, b"", "12", 1.5, None):
        with pytest.raises(ValueError):
            block_hash(bad)


def test_bad_events_are_malformed_not_fatal():
    raw = payload(stored([1], range(16)), {"type": "Mystery"}, {"no": "type"}, 42,
                  {"type": "BlockStored", "block_hashes": "x", "token_ids": [], "block_size": 16},
                  {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 16},
                  {"type": "BlockRemoved", "block_hashes": [1.5]})
    events = decode_batch(raw).events
    assert events[0] == BlockStored((1,), None, tuple(range(16)), 16, None, "GPU")
    assert [type(e) for e in events[1:]] == [Malformed] * 6
    assert [e.reason for e in events[1:]] == ["unknown_type"] + ["event_shape"] * 5


@pytest.mark.parametrize("raw,reason", [
    (b"\xc1", "msgpack"), (msgspec.msgpack.encode(7), "batch_shape"),
    (msgspec.msgpack.encode([1.0, "events", 0]), "batch_shape"),
    (msgspec.msgpack.encode([1.0, [], "rank"]), "batch_shape"), (b"", "msgpack")])
def test_unreadable_batches(raw, reason):
    with pytest.raises(WireError) as err:
        decode_batch(raw)
    assert err.value.reason == reason


def test_array_form_round_trip():
    ev = stored([1, 2], range(32), lora_name="sql")
    assert as_array(ev) == ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", "sql"]
    a, m = decode_batch(payload(ev, form="array")), decode_batch(payload(ev))
    assert a == m


def test_frames():
    assert parse_live([b"kv@a", (7).to_bytes(8, "big"), b"p"]) == (b"kv@a", 7, b"p")
    assert parse_replay([b"", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    assert parse_replay([b"", b"kv@a", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    assert parse_replay([b"", b"\xff" * 8, b""]) == (REPLAY_END, b"")
    assert parse_replay([b"", b"", b"\xff" * 8, b""]) == (REPLAY_END, b"")
    for bad in ([b"kv", b"\x00" * 7, b"p"], [b"x", b"y"], [b"a", b"b", b"c", b"d"]):
        with pytest.raises(WireError):
            parse_live(bad)
    for bad in ([(3).to_bytes(8, "big"), b"p"], [b"x", (3).to_bytes(8, "big"), b"p"]):
        with pytest.raises(WireError):
            parse_replay(bad)


def test_own_chain_is_process_independent():
    code = ("from kvlookup.hashing import vllm as vh; "
            "print(vh.chain(vh.request_root(16, 'sql-lora', 'salt'), list(range(1000, 1032)), 16))")
    outs = set()
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {str(vh.chain(vh.request_root(16, "sql-lora", "salt"), TOKENS, 16))}


def test_own_chain_namespaces_and_blocks():
    base = vh.chain(vh.request_root(16), TOKENS, 16)
    assert len(base) == 2 and len(vh.chain(vh.request_root(16), TOKENS + (1,) * 15, 16)) == 2
    assert vh.chain(base[0], TOKENS[16:], 16) == base[1:]  # chaining from a parent continues the chain
    others = [vh.chain(vh.request_root(16, "x"), TOKENS, 16), vh.chain(vh.request_root(16, "y"), TOKENS, 16),
              vh.chain(vh.request_root(16, None, "salt"), TOKENS, 16),
              vh.chain(vh.request_root(32), TOKENS, 32)]
    assert len({h for chain in [base, *others] for h in chain}) == 2 + 2 + 2 + 2 + 1
    assert vh.request_root(16, "x") == vh.namespace_root(16, "x", ())
    assert vh.split_extra_keys(("x", "salt"), "x") == ("salt",)
    assert vh.split_extra_keys(None, "x") == ()


@pytest.mark.usefixtures("impl")
def test_plain_chain_is_chain():
    """The lookup's fast chain (vh.plain_chain) gives chain's values: pinned, and equal over
    block sizes, partial tails, roots and input types (list, array('I'), tuple)."""
    assert vh.plain_chain(vh.request_root(16, "sql-lora", "salt"), list(TOKENS), 16) == \
        [-8958035894212774435, 1083750489175896309]
    assert vh.plain_chain(vh.request_root(16), list(TOKENS), 16) == [-3101933210439555288, -6188482805661908530]
    rng = random.Random(5)
    tokens = [rng.randrange(2**32) for _ in range(1000)]
    for bs in (1, 2, 16, 32, 256):
        for n in (0, 1, bs - 1, bs, bs + 1, 3 * bs + 5, 1000):
            for root in (vh.request_root(bs), vh.request_root(bs, "x", "salt"), -1, 0):
                want = vh.chain(root, tokens[:n], bs)
                assert vh.plain_chain(root, tokens[:n], bs) == want
                assert vh.plain_chain(root, array("I", tokens[:n]), bs) == want
                assert vh.plain_chain(root, tuple(tokens[:n]), bs) == want


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_typed_path_takes_every_vllm_fixture_and_agrees_with_the_generic_one(name):
    raw = (FIXTURES / f"{name}.msgpack").read_bytes()
    typed = decode_typed(raw)
    assert typed is not None  # vLLM's own encodings (array and map events, int and bytes hashes)
    assert typed == decode_generic(raw) == decode_batch(raw)
    assert typed.events[0].block_hashes == INT_HASHES


def test_empty_bytes_hash_is_malformed_on_the_typed_path_too():
    """An empty bytes hash (block or parent) decodes by msgspec as bytes: the typed path must leave
    the batch to the generic one (a Malformed event), not raise out of decode_batch (the sidecar's
    apply loop catches WireError only)."""
    for events in ([["BlockStored", [b""], None, [1, 2], 16]], [["BlockStored", [5], b"", [1, 2], 16]],
                   [{"type": "BlockRemoved", "block_hashes": [7, b""]}]):
        raw = msgspec.msgpack.encode([1.0, events, 0])
        assert decode_typed(raw) is None
        assert decode_batch(raw) == decode_generic(raw) == EventBatch(
            1.0, (Malformed("event_shape", "block hash b'' is not an int or bytes"),), 0)


def test_typed_path_leaves_odd_shapes_to_the_generic_one():
    tokens = list(range(16))
    # extra trailing fields, missing trailing ones, both event forms: typed, same as generic
    for events in ([["BlockStored", [1], None, tokens, 16, None, "GPU", None, None, 0, "x", 9, "LOCAL", None,
                     "s1", None, "future"], ["BlockRemoved", [1]]],
                   [stored([1], tokens, extra_keys=[["salt", ["mm", 0]]]), removed([1])]):
        raw = msgspec.msgpack.encode([2, events])
        typed = decode_typed(raw)
        assert typed is not None and typed == decode_generic(raw)
        assert typed.ts == 2.0 and typed.data_parallel_rank is None
    assert decode_typed(msgspec.msgpack.encode([1.0, [stored([1], tokens, extra_keys=[["a", ["mm", 0]]])]])
                        ).events[0].extra_keys == (("a", ("mm", 0)),)
    # a relay's negative hash, a map batch, a mixed batch, a bad name: generic (and exact)
    for raw in (msgspec.msgpack.encode([1.0, [["BlockRemoved", [-1]]], 0]),
                msgspec.msgpack.encode({"ts": 1.0, "events": [["BlockRemoved", [3]]]}),
                msgspec.msgpack.encode([1.0, [["BlockRemoved", [3]], removed([4])], 0]),
                msgspec.msgpack.encode([1.0, [removed([4], medium="G\tPU")], 0])):
        assert decode_typed(raw) is None
    assert decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [-1]]], 0])).events == (
        BlockRemoved((2**64 - 1,)),)
    assert decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [3]], removed([4])], 0])).events == (
        BlockRemoved((3,)), BlockRemoved((4,), "GPU"))
    assert isinstance(decode_batch(msgspec.msgpack.encode([1.0, [removed([4], medium="G\tPU")], 0])).events[0],
                      Malformed)
