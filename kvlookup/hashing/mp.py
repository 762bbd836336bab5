"""LMCache multiprocess (MP) chunk hashes: the BLAKE3 chain of ``lmcache.v1.multiprocess.token_hasher``.

Definition (LMCache 0.5.6 and 0.5.7, ``--hash-algorithm blake3``, the default)::

    none_hash = BLAKE3(12 zero bytes)        # int 0 as 8 big-endian bytes, then uint32 0
    hash_0    = BLAKE3(none_hash || tokens[0:C] as big-endian uint32)
    hash_i    = BLAKE3(hash_{i-1} || tokens[i*C:(i+1)*C] as big-endian uint32)

with C the chunk size (256 by default). Only complete chunks are hashed. Model name, rank and
cache salt are not part of the hash; they are separate fields of an MP object key. Worked
example (LMCache's own code): tokens ``range(1000, 1512)`` at C=256 give
``d526d88f…0579`` and ``8be5f115…94f5`` (tests/test_mp_hashing.py pins them).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from blake3 import blake3

#: BLAKE3 of 12 zero bytes: the prefix of chunk 0.
NONE_HASH = blake3(b"\0" * 12).digest()
#: LMCache's default chunk size (tokens).
DEFAULT_CHUNK_SIZE = 256


def chunk_hashes(tokens: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """The 32-byte digest of every complete chunk of ``tokens`` (from token 0), in order.

    tokens: token ids, each 0 <= id < 2**32 (ValueError otherwise: MP cannot hash them);
    chunk_size: tokens per chunk (> 0). A trailing partial chunk has no hash.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, not {chunk_size}")
    n = len(tokens) // chunk_size
    if n == 0:
        return []
    try:
        packed = array("I", tokens if len(tokens) == n * chunk_size else tokens[: n * chunk_size])
    except OverflowError:
        raise ValueError("token ids must be 0 <= id < 2**32 for the MP chunk hash") from None
    if sys.byteorder == "little":
        packed.byteswap()
    return chunk_hashes_packed(memoryview(packed).cast("B"), chunk_size)


def chunk_hashes_packed(data: memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[bytes]:
    """:func:`chunk_hashes` of ids already packed as big-endian uint32 (``data``: bytes, 4 a token;
    kvlookup.wire.mp_tokens decodes a body to this). BLAKE3 reads the chunks in place."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, not {chunk_size}")
    step = 4 * chunk_size
    out: list[bytes] = []
    prev = NONE_HASH
    for i in range(0, len(data) - step + 1, step):
        prev = blake3(prev).update(data[i:i + step]).digest()
        out.append(prev)
    return out


def unpack_ids(data: memoryview) -> list[int]:
    """The token ids of big-endian uint32 bytes (the inverse of the packing in :func:`chunk_hashes`)."""
    ids = array("I")
    ids.frombytes(data)
    if sys.byteorder == "little":
        ids.byteswap()
    return ids.tolist()


def chunk_hashes_hex(tokens: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[str]:
    """:func:`chunk_hashes` as lowercase hex (``chunk_hash_hex`` on the wire)."""
    return [h.hex() for h in chunk_hashes(tokens, chunk_size)]


def kv_rank(world_size: int, rank: int) -> int:
    """LMCache's packed ``kv_rank`` for one worker: ``(ws << 24) | (rank << 16) | (ws << 8) | rank``
    (MP passes local world size = world size and local rank = rank)."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


def world_size_of(packed_rank: int) -> int:
    """The world size inside a packed ``kv_rank`` (``(kv_rank >> 24) & 0xFF``), as the coordinator reads it."""
    return (packed_rank >> 24) & 0xFF
