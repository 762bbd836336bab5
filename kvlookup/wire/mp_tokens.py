"""``POST /directory/lookup``'s tokens form decoded straight to the bytes the MP chunk hash reads.

:func:`decode_tokens_form` parses the body with pysimdjson and narrows the ids with numpy (when
both are installed) to one buffer of big-endian uint32 (:func:`kvlookup.hashing.mp.chunk_hashes_packed`
hashes it in place): no Python int per id, no list, no ``array`` built from one. At 32k ids that
is ~0.9 ms less CPU a lookup here than msgspec's ``list[int]`` plus packing (docs/benchmarks-notes.md
"MP /directory/lookup at 32k tokens").

It answers only bodies of at least :data:`MIN_BYTES` of the plain shape (one JSON array in the
body, ``token_ids`` non-empty with
every id in 0..2**32-1, ``model_name`` a string, ``world_size`` an int >= 1, ``cache_salt`` a string,
no ``keys``, no repeated field, no UTF-8 BOM); for anything else, and when either library is missing, it returns
None and the caller decodes with :func:`kvlookup.wire.lmcache_mp.decode`, which gives the same
request or the exact error. So the answer never depends on which decoder ran
(tests/wire/test_mp_tokens.py compares them on valid and invalid bodies).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, NamedTuple

import msgspec

from kvlookup import native
from kvlookup.wire import lmcache_mp as W

try:  # optional: without them every body takes msgspec's path
    import numpy
    import simdjson
except ImportError:  # pragma: no cover - the tests run both paths (monkeypatching simdjson to None)
    simdjson = None  # type: ignore[assignment]

#: Smaller bodies take msgspec's path: below ~5k ids pysimdjson's per-call set-up costs more than
#: the ints it saves (256 ids: 0.32 vs 0.25 ms CPU; 4k: even; 32k: 2.14 vs 2.86; bench/mp_decode.py).
MIN_BYTES = 32 * 1024
_FIELDS = frozenset(("token_ids", "model_name", "world_size", "cache_salt"))


class TokensForm(NamedTuple):
    """A tokens-form ``/directory/lookup`` body: ``packed`` holds ``n_ids`` ids as big-endian uint32."""

    packed: memoryview
    n_ids: int
    model_name: str
    world_size: int
    cache_salt: str


_local = threading.local()  # one parser a thread: a parser is reused only once its documents are gone


def decode_tokens_form(body: bytes) -> TokensForm | None:
    """The tokens form of ``body`` (JSON) when it has the plain shape (module docstring); None
    otherwise (decode it with ``lmcache_mp.decode``). Never raises for bad input. With the C
    extension (kvlookup.native) the ids are read by it at any size (:func:`_native_form`)."""
    ext = native.ext
    if ext is not None and sys.byteorder == "little":
        return _native_form(ext, body)
    if simdjson is None or len(body) < MIN_BYTES or sys.byteorder != "little" \
            or body.find(b"[", body.find(b"[") + 1) != -1 or body.startswith(b"\xef\xbb\xbf"):
        # at most one '[' (find uses memchr: ~30x cheaper than count on a 200 KB body): token_ids
        # holds no nested array (as_buffer would flatten one); a BOM: simdjson
        # skips it, msgspec refuses the body (400), so the generic path must answer it
        return None
    try:
        ids = _ids(body)
    except RuntimeError:  # a parser still referenced (it never should be): a new one next time
        _local.parser = None
        return None
    if ids is None:
        return None
    model, ws, salt, raw = ids
    wide = numpy.frombuffer(raw, dtype="<u8")
    if not wide.size or int(wide.max()) >= 1 << 32:  # empty, or an id MP cannot hash: msgspec's path says so
        return None
    return TokensForm(wide.astype(">u4").data.cast("B"), int(wide.size), model, ws, salt)


def _native_form(ext: Any, body: bytes) -> TokensForm | None:
    """:func:`decode_tokens_form` by the C extension's ``decode_mp_ids`` (the ids, big-endian, and
    where their array lies) and msgspec for the rest of the body (the array cut out): ~10x less
    CPU than pysimdjson + numpy at 32k ids, and no set-up cost for small bodies."""
    got = ext.decode_mp_ids(body)
    if got is None:
        return None
    packed, start, end, members = got
    try:
        rest = msgspec.json.decode(body[:start] + b"0" + body[end:])
    except msgspec.DecodeError:
        return None
    if type(rest) is not dict or len(rest) != members or not _FIELDS.issuperset(rest):  # a repeated or other member
        return None
    model, salt, ws = rest.get("model_name"), rest.get("cache_salt", ""), rest.get("world_size", 1)
    if type(model) is not str or type(salt) is not str or type(ws) is not int or not 1 <= ws <= W.MAX_WORLD_SIZE:
        return None
    return TokensForm(memoryview(packed), len(packed) // 4, model, ws, salt)


def _ids(body: bytes) -> tuple[str, int, str, Any] | None:
    """(model_name, world_size, cache_salt, the ids as a uint64 buffer) of a plain body, else None."""
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    try:
        doc = parser.parse(body)
        if not isinstance(doc, simdjson.Object):
            return None
        names = list(doc.keys())
        if len(names) != len(set(names)) or not _FIELDS.issuperset(names) or "token_ids" not in names:
            return None
        model, salt, ws = doc.get("model_name"), doc.get("cache_salt", ""), doc.get("world_size", 1)
        ids = doc["token_ids"]
        if type(model) is not str or type(salt) is not str or type(ws) is not int or not 1 <= ws <= W.MAX_WORLD_SIZE \
                or not isinstance(ids, simdjson.Array):
            return None
        return model, ws, salt, ids.as_buffer(of_type="u")  # uint64, native (little-endian) order; flat
    except (ValueError, TypeError, KeyError):  # not JSON, or an id not a uint64
        return None
