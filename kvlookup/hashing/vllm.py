"""kvlookup's own hash chain for vLLM blocks, independent of vLLM's hash algorithm and seed.

vLLM's block hashes (sha256 of a pickle, seeded by PYTHONHASHSEED or os.urandom) cannot be
reproduced outside the engine (docs/vllm-events.md §3), so the sidecar recomputes a
chain of its own from the ``token_ids`` carried by BlockStored, and lookups compute the same
chain from a request's tokens::

    root  = blake2b-64(msgpack(["kvlookup-vllm/1", block_size, lora, namespace_extras]))
    h_0   = hash((root, tuple(block_0_tokens)))
    h_i   = hash((h_{i-1}, tuple(block_i_tokens)))              # plain text block
    h_i   = hash((h_{i-1}, tuple(block_i_tokens), stable(ek_i)))  # block with extra keys

``hash`` of a tuple of ints is CPython's C tuple hash: it does not depend on PYTHONHASHSEED, so
every process computes the same values. Strings (LoRA names, cache salts, multimodal ids) only
ever enter through :func:`stable_id` (blake2b), never through ``hash``.

EAGLE lookahead (vLLM 0.33 ``num_hash_lookahead_tokens`` L > 0, vllm/config/vllm.py:677-692;
vllm/v1/core/kv_cache_utils.py:966-1019): vLLM's hash of a block then also covers the L tokens
after it, so the block serves only prompts that continue with them. kvlookup's step for such a
block takes them as an extra: ``extra = (LOOKAHEAD_TAG, ek_i, tuple(next_L_tokens))``, and a
lookup walks the lookahead chain (:func:`chain` with ``lookahead=L``) beside the plain one.

Namespaces: the root covers the block size, the LoRA adapter and the first block's extra keys
(vLLM puts ``cache_salt`` there), so a prompt under adapter X never matches blocks stored under
adapter Y or the base model. Only full blocks are hashed (vLLM caches full blocks only).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

from kvlookup import native

ROOT_TAG = "kvlookup-vllm/1"

_encode = msgspec.msgpack.Encoder().encode


def stable_id(value: Any) -> int:
    """A signed 64-bit id of a msgpack-able value, the same in every process."""
    digest = hashlib.blake2b(_encode(value), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def namespace_root(block_size: int, lora: str | None = None, extras: Sequence[Any] = ()) -> int:
    """Root of a chain: block size (tokens), LoRA adapter name (None = base model) and the
    namespace extra keys of the first block (e.g. ``(cache_salt,)``)."""
    return stable_id([ROOT_TAG, int(block_size), lora, list(extras)])


def request_root(block_size: int, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Root for a lookup request: what vLLM puts in its first block's extra keys for a
    text prompt is ``cache_salt`` (the LoRA name is part of the root on its own)."""
    return namespace_root(block_size, lora_name or None, (cache_salt,) if cache_salt else ())


def chain_step(parent: int, block_tokens: Sequence[int], extra: Any = None) -> int:
    """The next hash of a chain; ``extra``: that block's non-namespace extra keys (None = none)."""
    if extra is None:
        return hash((parent, tuple(block_tokens)))
    return hash((parent, tuple(block_tokens), stable_id(extra)))


LOOKAHEAD_TAG = "kvlookup-la"


def with_lookahead(extra: Any, lookahead: Sequence[int]) -> tuple:
    """A block's step extra when its hash also covers the ``lookahead`` tokens after it."""
    return (LOOKAHEAD_TAG, extra, tuple(lookahead))


def chain(parent: int, tokens: Sequence[int], block_size: int,
          extras: Sequence[Any] | None = None, lookahead: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens`` chained from ``parent`` (a root or a hash).

    extras: one entry per block (None = plain block) or None for all plain. A trailing partial
    block is not hashed. lookahead: L > 0 hashes each block with the L tokens after it
    (:func:`with_lookahead`), and only blocks followed by L tokens, as vLLM does.
    """
    out: list[int] = []
    h = parent
    usable = len(tokens) - lookahead
    full = max(0, usable - usable % block_size)
    for i, start in enumerate(range(0, full, block_size)):
        extra = extras[i] if extras else None
        end = start + block_size
        if lookahead:
            extra = with_lookahead(extra, tokens[end:end + lookahead])
        h = chain_step(h, tokens[start:end], extra)
        out.append(h)
    return out


def plain_chain(parent: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """:func:`chain` of plain blocks (no extras, no lookahead), the same values, faster: the
    blocks are cut by ``zip`` at C speed (``zip(*[iter(tokens)] * block_size)`` yields each block
    as the tuple :func:`chain_step` would build), so a step is one 2-tuple and one C hash, no
    slice or call per block; with the C extension (kvlookup.native) the whole chain is one call.
    tokens: any iterable of ints (list, ``array('I')``)."""
    ext = native.ext
    if ext is not None:
        return ext.chain(parent, tokens, block_size, False)
    out: list[int] = []
    append = out.append
    h = parent
    for block in zip(*[iter(tokens)] * block_size, strict=False):  # a partial tail is dropped
        h = hash((h, block))
        append(h)
    return out


def split_extra_keys(extra: Any, lora_name: str | None) -> tuple:
    """One block's vLLM extra keys without the LoRA name (which vLLM lists first); () if none."""
    if extra is None:
        return ()
    items = tuple(extra) if isinstance(extra, (tuple, list)) else (extra,)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    return items
