"""Value formats of the LMCache MP directory (kvlookup.index.mp): how a chunk hash, a space, a
token binding and an object key's record are written in the ``{mp}`` hashes (docs/redis-schema.md).
Pure functions: no Redis here."""

from __future__ import annotations

import base64
import binascii
from array import array
from dataclasses import dataclass, field

from blake3 import blake3

from kvlookup.wire import lmcache_mp as W


def chunk_b64(chunk_hash_hex: str) -> str:
    """A chunk hash as it appears in MP fields: unpadded base64url of its bytes (43 chars for 32)."""
    return raw_b64(bytes.fromhex(chunk_hash_hex))


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def raw_b64(raw: bytes) -> str:
    """Unpadded base64url of raw bytes (binascii directly: ~3x cheaper than base64.urlsafe_b64encode,
    which ingest calls once per entry)."""
    return binascii.b2a_base64(raw, newline=False).rstrip(b"=").translate(_URLSAFE).decode()


def many_b64(digests) -> list[str]:
    """:func:`raw_b64` of each 32-byte digest, in one base64 call: a digest with a zero byte after
    it is 44 base64 characters whose first 43 are its unpadded base64 (33 bytes: 11 whole groups)."""
    text = binascii.b2a_base64(b"".join(d + b"\0" for d in digests), newline=False).translate(_URLSAFE).decode()
    return [text[i:i + 43] for i in range(0, len(text), 44)]


def canon(chunk_hash_hex: str) -> str:
    """A wire ``chunk_hash_hex`` as the coordinator reads it (``bytes.fromhex``), as lowercase hex."""
    return bytes.fromhex(chunk_hash_hex).hex()


def chunk_hex(b64: str) -> str:
    """Inverse of :func:`chunk_b64`."""
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def space_text(key: W.EncodedObjectKey) -> str:
    """The interned part of an object key besides its chunk: model, salt, kv_rank, group."""
    return f"{key.model_name}\t{key.cache_salt}\t{key.kv_rank}\t{key.object_group_id}"


def tokens_text(token_ids: list[int], offset: int) -> str:
    """A token binding as stored: ``<offset>\\t<base64 little-endian uint32>`` ('' when any id is outside uint32)."""
    try:
        packed = array("I", token_ids)
    except OverflowError:
        return ""
    if packed.itemsize != 4:  # pragma: no cover
        return ""
    return f"{offset}\t{base64.b64encode(packed.tobytes()).decode()}"


def parse_tokens(text: str | None) -> tuple[list[int], int]:
    """(token_ids, token_offset) from :func:`tokens_text`'s text; ([], -1) for none."""
    if not text:
        return [], -1
    off, _, b64 = text.partition("\t")
    ids = array("I")
    ids.frombytes(base64.b64decode(b64))
    return ids.tolist(), int(off)


@dataclass
class Record:
    """One object key's stored state: key id, access count, placements ``(tb, epoch, size)``."""

    kid: int
    access_count: int
    placements: list[tuple[str, str, int]] = field(default_factory=list)


def parse_record(value: str) -> Record:
    """The :class:`Record` of a stored value ``<key id>,<access count>|<tb>,<epoch>,<size>|...``."""
    head, *rest = value.split("|")
    kid, acc = head.split(",")
    return Record(int(kid), int(acc), [(tb, ep, int(sz)) for tb, ep, sz in (p.split(",") for p in rest)])


def fingerprint(window: bytes) -> str:
    """The blend index's fingerprint of one chunk's tokens (little-endian uint32 bytes)."""
    return blake3(window).digest(8).hex()


def key_dict(key: W.EncodedObjectKey) -> dict:
    """An object key as the coordinator's JSON shows it."""
    return {"chunk_hash_hex": key.chunk_hash_hex, "model_name": key.model_name, "kv_rank": key.kv_rank,
            "object_group_id": key.object_group_id, "cache_salt": key.cache_salt}


def placement_dict(p: dict) -> dict:
    """A placement as the coordinator's JSON shows it."""
    return {"instance_id": p["instance_id"], "incarnation": p["incarnation"], "tier": p["tier"],
            "backend": p["backend"], "size_bytes": p["size_bytes"], "shared": p["shared"]}
