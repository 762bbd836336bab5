"""The tokens form of POST /directory/lookup decoded two ways (kvlookup.wire.mp_tokens: pysimdjson +
numpy to packed big-endian uint32; or msgspec's list[int], the pure-Python fallback): the same
request, the same chunk hashes (the research doc's worked example, pinned), the same answer bytes
and the same errors, on plain and odd bodies."""

from __future__ import annotations

import random

import msgspec
import pytest

from kvlookup import native
from kvlookup.app.coordinator import directory_lookup
from kvlookup.hashing import mp as mphash
from kvlookup.index.mp import MPDirectory
from kvlookup.wire import lmcache_mp as W
from kvlookup.wire import mp_tokens

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
C0 = "d526d88f0c387e4049f866a4c572cbf658276fcae250b069051fd1fff3ad0579"
C1 = "8be5f115945ff3c4eb943172f8edfdcdf3432274c3d3dbd2436fed9a9fe494f5"
TOP = 2**32 - 1
RANDOM = [random.Random(5).randrange(0, 2**32) for _ in range(1024)]


def body(**kw) -> bytes:
    return msgspec.json.encode({"token_ids": list(range(1000, 1512)), "model_name": MODEL, **kw})


#: bodies the fast path answers (the plain shape)
PLAIN = [body(), body(world_size=2, cache_salt="s1"), body(token_ids=[0, TOP, 5] * 300),
         body(token_ids=RANDOM), body(token_ids=[7] * 3), body(model_name="m\u00e9\\\"x"),
         b' {"model_name": "m", "token_ids": [1, 2 ,3]} ']
#: bodies it leaves to msgspec (which answers them, or names the error)
ODD = [body(token_ids=[1, [2]]), body(token_ids=[[1, 2]]), body(token_ids=[1, -2]), body(token_ids=[1, 2.0]),
       body(token_ids=[1, 2**32] * 200), body(token_ids=[1, 2**64]), body(token_ids=[1, "2"]),
       body(token_ids=[1, True]), body(token_ids=[1, None]), body(token_ids=[1, {"a": 1}]), body(token_ids=[]),
       body(world_size=0), body(world_size=True), body(world_size="2"), body(cache_salt=1), body(model_name=None),
       body(model_name=3), body(keys=[]), body(extra=1), body(model_name="a[b"),
       b'{"token_ids": [1], "token_ids": [2], "model_name": "m"}', b'{"token_ids": [1, 2', b"[1, 2]", b"3", b"", b"{}",
       b'{"token_ids": [1e3], "model_name": "m"}',
       b'\xef\xbb\xbf{"token_ids": [1, 2], "model_name": "m"}',  # a UTF-8 BOM: msgspec refuses it, simdjson skipped it
       msgspec.json.encode({"token_ids": list(range(300)), "model_name": "m"}).replace(b"m", b"\xff")]


@pytest.fixture(autouse=True, params=["simdjson", "native"])
def every_size(request, monkeypatch):
    """The packed decode for small bodies too (pysimdjson's leaves those under MIN_BYTES to
    msgspec), by pysimdjson + numpy (the C extension off) or by the C extension."""
    monkeypatch.setattr(mp_tokens, "MIN_BYTES", 0)
    if request.param == "native":
        if not native.available():
            pytest.skip("the C extension is not built")
        monkeypatch.setattr(native, "ext", native._MODULE)
    else:
        monkeypatch.setattr(native, "ext", None)
    return request.param


def test_small_bodies_are_left_to_msgspec(monkeypatch, every_size):
    if every_size == "native":
        pytest.skip("the C extension decodes every size")
    monkeypatch.setattr(mp_tokens, "MIN_BYTES", 32 * 1024)
    assert mp_tokens.decode_tokens_form(body()) is None
    assert mp_tokens.decode_tokens_form(body(token_ids=RANDOM * 4)) is not None  # ~43 KB


def test_plain_bodies_decode_to_msgspecs_request_packed():
    for raw in PLAIN:
        got = mp_tokens.decode_tokens_form(raw)
        want = W.decode(raw, W.DirectoryLookupRequest)
        assert got is not None, raw[:80]
        assert (mphash.unpack_ids(got.packed), got.n_ids, got.model_name, got.world_size, got.cache_salt) == \
               (want.token_ids, len(want.token_ids), want.model_name, want.world_size, want.cache_salt)
        assert mphash.chunk_hashes_packed(got.packed, 256) == mphash.chunk_hashes(want.token_ids, 256)


def test_odd_bodies_are_left_to_msgspec(every_size):
    """None, except where the C extension reads a body msgspec reads the same (a '[' in a string)."""
    got = [raw for raw in ODD if mp_tokens.decode_tokens_form(raw) is not None]
    assert got == ([] if every_size == "simdjson" else [body(model_name="a[b")])
    for raw in got:
        form, want = mp_tokens.decode_tokens_form(raw), W.decode(raw, W.DirectoryLookupRequest)
        assert (mphash.unpack_ids(form.packed), form.model_name) == (want.token_ids, want.model_name)


#: more bodies for the C extension's scanner: strings with escapes and brackets, nested values
#: skipped, members in any order; and ones it must refuse
NATIVE_PLAIN = [b'{"model_name": "a\\\\", "token_ids": [3]}', b'{"model_name": "q\\"],{", "token_ids": [3, 4]}',
                b'{"cache_salt": "", "world_size": 3, "token_ids": [0], "model_name": "m"}',
                b'{"token_ids":[4294967295,0,1],"model_name":"m"}']
NATIVE_ODD = [b'{"token_ids": [1], "model_name": "m", "keys": [{"a": [1, {"b": "]"}]}]}',
              b'{"token_ids": [1], "model_name": "m", "x": {"token_ids": [2]}}',
              b'{"t\\u006fken_ids": [1], "model_name": "m"}', b'{"token_ids": [1], "model_name": "m"} x',
              b'{"token_ids": [1], "model_name": "m",}', b'{"token_ids": [01], "model_name": "m"}',
              b'{"token_ids": [1 2], "model_name": "m"}', b'{"model_name": "m"}',
              b'{"token_ids": [1], "model_name": "m',
              b'{"token_ids": [1], "model_name": m}', b'{"token_ids": [4294967296], "model_name": "m"}']


def test_native_scanner(every_size):
    if every_size != "native":
        pytest.skip("the C extension's own cases")
    for raw in NATIVE_PLAIN:
        form, want = mp_tokens.decode_tokens_form(raw), W.decode(raw, W.DirectoryLookupRequest)
        assert form is not None, raw
        assert (mphash.unpack_ids(form.packed), form.model_name, form.world_size, form.cache_salt) == \
               (want.token_ids, want.model_name, want.world_size, want.cache_salt)
    assert [raw for raw in NATIVE_ODD if mp_tokens.decode_tokens_form(raw) is not None] == []


def test_packed_hash_is_the_worked_example():
    """LMCache's own worked example (tokens range(1000, 1512), chunk size 256), through the fast decode."""
    got = mp_tokens.decode_tokens_form(body(token_ids=list(range(1000, 1600))))
    assert [h.hex() for h in mphash.chunk_hashes_packed(got.packed)] == [C0, C1]
    assert mphash.chunk_hashes_packed(memoryview(b""), 256) == []
    with pytest.raises(ValueError, match="chunk_size"):
        mphash.chunk_hashes_packed(got.packed, 0)


def test_route_answers_the_same_bytes_either_way(r, monkeypatch):
    """directory_lookup with the fast decode and with msgspec's (pysimdjson unavailable): the same
    status and bytes for every body, stored prompts, misses and errors alike."""
    from tests.index.test_mp_index import batch, entry, post

    d = MPDirectory(r)
    toks = list(range(1000, 2024))
    h = mphash.chunk_hashes_hex(toks)
    post(d, batch(1, entries=[entry(h[0], tokens=toks[:256], offset=0), entry(h[1]), entry(h[2])]),
         batch(2, tier="l2", backend="fs", entries=[entry(h[0], size=7)]))
    bodies = [body(token_ids=toks), body(token_ids=toks + [1, 2], world_size=2), body(token_ids=toks, cache_salt="x"),
              body(token_ids=toks, cache_salt="a/b"), body(token_ids=RANDOM), *PLAIN, *ODD]
    fast = [directory_lookup(d, raw) for raw in bodies]
    monkeypatch.setattr(native, "ext", None)
    monkeypatch.setattr(mp_tokens, "simdjson", None)
    assert mp_tokens.decode_tokens_form(body()) is None
    assert [directory_lookup(d, raw) for raw in bodies] == fast
    assert fast[0][0] == 200 and [len(x["placements"]) for x in msgspec.json.decode(fast[0][1])["results"]] == \
           [2, 1, 1, 0]
    assert fast[3][0] == 400 and {s for s, _ in fast[-len(ODD):]} == {200, 400, 422}
