"""The C extension (kvlookup._native) against the pure-Python code it replaces, value for value.

The Python chains are themselves checked against the real LMCache and vLLM code (tests/compat,
the goldens in test_hashing.py); here the C chain must give exactly their values for every token
and prefix CPython can hash: ints of any size and sign (hash(-1) == -2, values modulo 2^61 - 1),
bools, floats, a NONE_HASH outside 64 bits, and the uint32 buffer the /lookup fast path hands it.
The /lookup body fast path must decode exactly what msgspec decodes, or decline.
"""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlookup import native
from kvlookup.app.errors import ApiError
from kvlookup.app.lookup import LookupRequest, parse_request
from kvlookup.hashing import vllm as vh
from kvlookup.hashing.lmcache import HASH_OF_NONE, HashProfile, _builtin_chain
from tests.support import native as native_impl

P61 = 2**61 - 1
EDGE_INTS = [0, 1, -1, -2, 2, P61 - 1, P61, P61 + 1, -P61, -P61 - 1, 2**63 - 1, -(2**63), 2**64, -(2**64) - 1,
             2**32 - 1, 2**32, 2**31, 2**100 + 7, -(2**100) - 7]
prefixes = st.one_of(st.sampled_from(EDGE_INTS), st.integers(min_value=-(2**70), max_value=2**70))
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
token_lists = st.lists(st.one_of(uint32, st.sampled_from([0, 1, 2**32 - 1, 255, 256, 257])), max_size=80)
odd_tokens = st.lists(st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.booleans(),
                                st.floats(allow_nan=False)), max_size=40)
sizes = st.sampled_from([1, 2, 3, 7, 16, 256])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture()
def ext():
    """The extension module itself (whatever mode the test runs under)."""
    if not native.available():
        if native_impl.required():
            pytest.fail(f"KVLOOKUP_REAL_PEERS=1 / KVLOOKUP_REQUIRE_NATIVE=1 but {native.WHY_NOT}")
        pytest.skip(native.WHY_NOT)
    from kvlookup import _native  # type: ignore[attr-defined]
    return _native


def python_chain(prefix, tokens, size, tail, extra=None, absent=False):
    bounds = HashProfile(chunk_size=size, save_unfull_chunk=tail).chunk_bounds(len(tokens))
    mode = "absent" if absent else ("empty" if extra == () else "none")
    return _builtin_chain(tokens, bounds, prefix, mode)


@FUZZ
@given(prefix=prefixes, tokens=token_lists, size=sizes, tail=st.booleans())
def test_lmcache_chains_equal_python(ext, prefix, tokens, size, tail):
    for extra in ((), HASH_OF_NONE):
        want = python_chain(prefix, tokens, size, tail, extra)
        assert ext.chain(prefix, tokens, size, tail, extra) == want
        assert ext.chain(prefix, array("I", tokens), size, tail, extra) == want
        assert ext.chain(prefix, tuple(tokens), size, tail, extra) == want
    want = python_chain(prefix, tokens, size, tail, absent=True)
    assert ext.chain(prefix, tokens, size, tail) == want
    assert ext.chain(prefix, array("I", tokens), size, tail) == want


@FUZZ
@given(prefix=prefixes, tokens=odd_tokens, size=sizes, tail=st.booleans())
def test_any_hashable_tokens_equal_python(ext, prefix, tokens, size, tail):
    """Tokens outside uint32 (negative, huge, bools, floats) hash as tuple() + hash() would."""
    assert ext.chain(prefix, tokens, size, tail, ()) == python_chain(prefix, tokens, size, tail, ())
    assert ext.chain(prefix, tokens, size, tail) == python_chain(prefix, tokens, size, tail, absent=True)


@FUZZ
@given(prefix=prefixes, tokens=token_lists, size=sizes)
def test_vllm_plain_chain_equals_python(ext, prefix, tokens, size, monkeypatch):
    monkeypatch.setattr(native, "ext", None)
    want = vh.chain(prefix, tokens, size)
    assert want == vh.plain_chain(prefix, tokens, size)
    monkeypatch.setattr(native, "ext", ext)
    assert vh.plain_chain(prefix, tokens, size) == want
    assert vh.plain_chain(prefix, array("I", tokens), size) == want
    assert vh.plain_chain(prefix, iter(tokens), size) == want  # any iterable, as zip takes


def test_link_hash_of_minus_one_and_the_tuple_hash_sentinel(ext):
    """A chain whose prefix is -1 (hash -2) and a chunk of one -1 token; results stay ints."""
    for prefix in (-1, -2, P61, -P61):
        assert ext.chain(prefix, [-1], 1, True, ()) == [hash((prefix, (-1,), ()))]
        assert ext.chain(prefix, [-1, 2**64], 2, True) == [hash((prefix, (-1, 2**64)))]


def test_bad_arguments_raise_as_python_does(ext):
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        ext.chain(0, [[1]], 1, True, ())
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        ext.chain([0], [1], 1, True, ())
    with pytest.raises(ValueError, match="size must be >= 1"):
        ext.chain(0, [1], 0, True)
    with pytest.raises(TypeError):
        ext.chain(0, 5, 1, True)


def test_a_list_changed_while_hashed_is_an_error_not_a_crash(ext):
    tokens: list = []

    class Shrinks:
        def __hash__(self):
            tokens.clear()
            return 1

    tokens.extend([Shrinks(), 2, 3, 4])
    with pytest.raises(RuntimeError, match="tokens changed size while being hashed"):
        ext.chain(0, tokens, 2, True, ())


def test_self_check_rejects_a_disagreeing_module():
    class Wrong:
        @staticmethod
        def chain(prefix, tokens, size, tail, extra=None):
            return [0]
    assert not native._agrees(Wrong)
    if native.available():
        from kvlookup import _native  # type: ignore[attr-defined]
        assert native._agrees(_native)


def test_built_where_the_run_promises_it():
    """CI (KVLOOKUP_REAL_PEERS=1) and KVLOOKUP_REQUIRE_NATIVE=1 runs must have the extension."""
    if not native_impl.required():
        pytest.skip("neither KVLOOKUP_REAL_PEERS=1 nor KVLOOKUP_REQUIRE_NATIVE=1")
    assert native.available(), native.WHY_NOT


def test_profile_dispatches_to_the_extension(ext, impl):
    tokens = list(range(1000, 1600))
    assert (native.ext is ext) == (impl == "native")
    assert HashProfile().chunk_hashes(tokens) == [-9006915360733114755, 6249281391258955993, -8949972916775179974]
    assert HashProfile().chunk_hashes(array("I", tokens)) == HashProfile().chunk_hashes(tokens)


# -- the /lookup body fast path -----------------------------------------------------------------

def ref_tokens(body: bytes):
    try:
        return msgspec.json.decode(body, type=LookupRequest)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


DECLINED = [b"", b" ", b"{}", b"[]", b'{"tokens":[01]}', b'{"tokens":[1.0]}', b'{"tokens":[-1]}', b'{"tokens":[-0]}',
            b'{"tokens":[4294967296]}', b'{"tokens":[1],}', b'{"tokens":[1,]}', b'\xef\xbb\xbf{"tokens":[1]}',
            b'{"tokens":[1]} x', b'{"tokens":[1e3]}', b'{"tokens":[12345678901]}', b'{"tokens":[1', b'{"tokens":[1 2]}',
            b'{"tokens":[,1]}', b'{"tokens":[' + b"1" * 40 + b"]}", b'{"tokens":[' + b"1" * 40, b'{"tokens":[1]',
            b'{"tokens":1}', b'{"tokens":[true]}', b'{"tokens":["1"]}', b'{"tokens":[null]}', b'{"tok\\u0065ns":[1]}',
            b'{"tokens":[1],"tokens":[2]}', b'{"tokens":[1],"lora_name":"x"}', b'{"lora_name":"x","tokens":[1]}',
            b'{"tokens":[1]}\x00', b'{"tokens":[+1]}', b'{"tokens":[0x1]}', b'{"tokens":[1\x0b]}',
            b'{"tokens":[1],"model_name":null}']
ACCEPTED = [(b'{"tokens":[]}', []), (b'{"tokens":[ ]}', []), (b'{"tokens":[0]}', [0]), (b'{"tokens":[7]}', [7]),
            (b' {\n"tokens" :\t[ 0 , 4294967295 ]\r} ', [0, 2**32 - 1]), (b'{"tokens":[1234567890]}', [1234567890]),
            (b'{"tokens": [128000, 849, 21435]}', [128000, 849, 21435]),
            (b'{"tokens":[12345678,123456789,99999999]}', [12345678, 123456789, 99999999])]


@pytest.mark.parametrize("body", DECLINED)
def test_fast_path_declines_what_it_does_not_own(ext, body):
    assert ext.decode_tokens(body) is None


@pytest.mark.parametrize(("body", "ids"), ACCEPTED)
def test_fast_path_decodes_what_msgspec_decodes(ext, body, ids):
    got = array("I")
    got.frombytes(ext.decode_tokens(body))
    assert got.tolist() == ids == ref_tokens(body).tokens


@FUZZ
@given(ids=st.lists(st.one_of(uint32, st.integers(min_value=0, max_value=9)), max_size=60),
       sep=st.sampled_from([(",", ":"), (", ", ": ")]),
       edits=st.lists(st.tuples(st.integers(min_value=0, max_value=2000), st.sampled_from(
           [b"", b"0", b"9", b",", b" ", b"-", b".", b"e", b"]", b"[", b"}", b"\n", b'"', b"\xff", b"\x00"])),
           max_size=3))
def test_fast_path_agrees_with_msgspec_on_mangled_bodies(ext, ids, sep, edits):
    body = bytearray(json.dumps({"tokens": ids}, separators=sep).encode())
    for at, text in edits:
        at %= len(body) + 1
        body[at:at + (1 if text == b"" or at % 2 else 0)] = text
    body = bytes(body)
    got, want = ext.decode_tokens(body), ref_tokens(body)
    if got is not None:
        ids_got = array("I")
        ids_got.frombytes(got)
        assert want is not None and ids_got.tolist() == want.tokens
        assert (want.lora_name, want.cache_salt, want.model_name, want.world_size) == (None, None, None, 1)


def outcome(body: bytes, max_tokens: int = 8):
    """parse_request's answer as plain values: the request's fields, or the ApiError."""
    try:
        req = parse_request(body, max_tokens)
    except ApiError as exc:
        return ("error", exc.status, exc.message)
    return (list(req.tokens), req.lora_name, req.cache_salt, req.model_name, req.world_size)


@pytest.mark.parametrize("body", [b for b in DECLINED] + [b for b, _ in ACCEPTED] + [
    b'{"tokens":[1,2,3,4,5,6,7,8,9]}', b'{"tokens":[1,2,3,4,5,6,7,8,-9]}', b'{"tokens":[1],"world_size":0}',
    b'{"tokens":[1],"lora_name":"a","cache_salt":"s","model_name":"m","world_size":2}'])
def test_parse_request_is_the_same_with_and_without_the_extension(ext, body, monkeypatch):
    monkeypatch.setattr(native, "ext", None)
    want = outcome(body)
    monkeypatch.setattr(native, "ext", ext)
    assert outcome(body) == want


def test_fast_path_hands_the_hashes_a_buffer(ext, monkeypatch):
    monkeypatch.setattr(native, "ext", ext)
    req = parse_request(b'{"tokens":[1,2,3]}', 8)
    assert isinstance(req.tokens, array) and req.tokens.typecode == "I"
    monkeypatch.setattr(native, "ext", None)
    assert type(parse_request(b'{"tokens":[1,2,3]}', 8).tokens) is list
