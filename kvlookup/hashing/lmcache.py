"""Chunk hash profiles: compute exactly the chunk hashes LMCache engines send.

LMCache's ``ChunkedTokenDatabase`` splits a prompt into chunks of ``chunk_size`` tokens and
chains them: ``h_i = H(h_{i-1}, chunk_i)`` with ``h_-1 = NONE_HASH``. With
``save_unfull_chunk`` the trailing partial chunk gets its own hash. What ``H`` and NONE_HASH
are depends on the LMCache version (docs/lmcache-protocol.md §4):

====================  ==========================================  ===================
extra_keys / algo     H(prefix, chunk)                            LMCache versions
====================  ==========================================  ===================
``empty``             ``hash((prefix, tuple(chunk), ()))``        0.4.x - 0.5.6
``none``              ``hash((prefix, tuple(chunk), None))``      0.3.4 - 0.3.15
``absent``            ``hash((prefix, tuple(chunk)))``            0.3.3
``sha256``            sha256 hex of prefix str + uint32-LE tokens 0.3.0 - 0.3.2
====================  ==========================================  ===================

The builtin variants run CPython's tuple hash in C, one call per chunk; with the C extension
(kvlookup.native) the whole chain is one call, the same values.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlookup import native

#: CPython 3.12+'s constant ``hash(None)``. On 3.11 and older ``hash(None)`` is derived from an
#: address, so the ``none`` profile substitutes this int, whose hash is the same value.
HASH_OF_NONE = 0xFCA86420

EXTRA_KEYS_MODES = ("empty", "none", "absent")
ALGORITHMS = ("builtin", "sha256")
ChunkHash = int | str


@functools.lru_cache(maxsize=32)
def seeded_str_hash(seed: str) -> int:
    """CPython's ``hash(seed)`` in a process started with ``PYTHONHASHSEED=seed``.

    This is the NONE_HASH that vLLM's ``init_none_hash(hash)`` produces for LMCache's builtin
    hash (Python >= 3.11, SipHash-1-3). Runs a real interpreter once per seed (cached).
    Raises ValueError when the seed is not an integer in [0, 4294967295].
    """
    if not seed.isdigit() or int(seed) > 4294967295:
        raise ValueError(f"PYTHONHASHSEED must be an integer in [0, 4294967295], got {seed!r}")
    env = dict(os.environ, PYTHONHASHSEED=seed)
    code = f"print(hash({seed!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def resolve_none_hash(none_hash: Any, hash_seed: str | int | None = None) -> int:
    """Turn a ``none_hash`` setting into the integer NONE_HASH.

    none_hash: ``0``/``"0"``, ``"seed"`` (hash of the PYTHONHASHSEED string, as vLLM sets it),
    or any integer (given as int or decimal string). hash_seed: the engines' PYTHONHASHSEED,
    required for ``"seed"``. Raises ValueError on anything else.
    """
    if isinstance(none_hash, bool):
        raise ValueError("none_hash must be 0, 'seed' or an integer, not a boolean")
    if isinstance(none_hash, int):
        return none_hash
    text = str(none_hash).strip()
    if text == "seed":
        if hash_seed is None or str(hash_seed) == "":
            raise ValueError("none_hash 'seed' needs hash_seed (the engines' PYTHONHASHSEED)")
        return seeded_str_hash(str(hash_seed))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"none_hash must be 0, 'seed' or an integer, got {none_hash!r}") from None


@dataclass(frozen=True)
class HashProfile:
    """How one fleet's engines hash chunks.

    chunk_size: tokens per chunk (LMCache ``chunk_size``, 256 by default).
    save_unfull_chunk: hash the trailing partial chunk too (LMCache 0.3.x default True).
    none_hash: the resolved NONE_HASH (int); ignored by the sha256 algorithm, whose
    first prefix is "".
    extra_keys: ``empty`` | ``none`` | ``absent``, see the module table.
    algorithm: ``builtin`` | ``sha256``.
    """

    chunk_size: int = 256
    save_unfull_chunk: bool = True
    none_hash: int = 0
    extra_keys: str = "empty"
    algorithm: str = "builtin"

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.extra_keys not in EXTRA_KEYS_MODES:
            raise ValueError(f"extra_keys must be one of {EXTRA_KEYS_MODES}, got {self.extra_keys!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> HashProfile:
        """Build a profile from config keys chunk_size, save_unfull_chunk, none_hash, hash_seed,
        extra_keys (or ``sha256``, meaning the 0.3.0-0.3.2 algorithm) and algorithm."""
        extra = str(settings.get("extra_keys", "empty"))
        algorithm = str(settings.get("algorithm", "builtin"))
        if extra == "sha256":
            extra, algorithm = "empty", "sha256"
        return cls(
            chunk_size=settings.get("chunk_size", 256),
            save_unfull_chunk=_as_bool(settings.get("save_unfull_chunk", True), "save_unfull_chunk"),
            none_hash=resolve_none_hash(settings.get("none_hash", 0), settings.get("hash_seed")),
            extra_keys=extra,
            algorithm=algorithm,
        )

    def hashed_length(self, n_tokens: int) -> int:
        """Tokens of an ``n_tokens`` prompt that fall in hashed chunks (the partial tail only
        with ``save_unfull_chunk``): where the last chunk ends."""
        return n_tokens if self.save_unfull_chunk else n_tokens - n_tokens % self.chunk_size

    def chunk_bounds(self, n_tokens: int) -> list[tuple[int, int]]:
        """(start, end) token offsets of every hashed chunk of an ``n_tokens`` prompt."""
        end = self.hashed_length(n_tokens)
        return [(i, min(i + self.chunk_size, n_tokens)) for i in range(0, end, self.chunk_size)]

    def chunk_hashes(self, tokens: Sequence[int]) -> list[int] | list[str]:
        """Chained chunk hashes of ``tokens`` (token ids, ints in [0, 2^32)).

        Returns one hash per chunk of :meth:`chunk_bounds`: ints for the builtin algorithm,
        lowercase hex strings for sha256. Mirrors LMCache ``ChunkedTokenDatabase.process_tokens``.
        """
        if self.algorithm == "sha256":
            return _sha256_chain(tokens, self.chunk_bounds(len(tokens)))
        ext = native.ext
        if ext is not None:  # the same chain in C (kvlookup._native), bit-exact with _builtin_chain
            if self.extra_keys == "absent":
                return ext.chain(self.none_hash, tokens, self.chunk_size, self.save_unfull_chunk)
            extra = () if self.extra_keys == "empty" else HASH_OF_NONE
            return ext.chain(self.none_hash, tokens, self.chunk_size, self.save_unfull_chunk, extra)
        return _builtin_chain(tokens, self.chunk_bounds(len(tokens)), self.none_hash, self.extra_keys)


def _builtin_chain(tokens: Sequence[int], bounds: list[tuple[int, int]], none_hash: int, mode: str) -> list[int]:
    out: list[int] = []
    prefix = none_hash
    if mode == "absent":
        for start, end in bounds:
            prefix = hash((prefix, tuple(tokens[start:end])))
            out.append(prefix)
        return out
    extra: Any = () if mode == "empty" else HASH_OF_NONE
    for start, end in bounds:
        prefix = hash((prefix, tuple(tokens[start:end]), extra))
        out.append(prefix)
    return out


def _sha256_chain(tokens: Sequence[int], bounds: list[tuple[int, int]]) -> list[str]:
    out: list[str] = []
    prefix = ""
    for start, end in bounds:
        data = prefix.encode("ascii") + array("I", tokens[start:end]).tobytes()
        prefix = hashlib.sha256(data).hexdigest()
        out.append(prefix)
    return out


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def profile_from_lmcache_yaml(data: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> HashProfile:
    """Profile for engines configured by an LMCache YAML (already parsed).

    Reads ``chunk_size``, ``save_unfull_chunk`` and ``pre_caching_hash_algorithm``; other
    settings (none_hash, hash_seed, extra_keys) come from ``base``. Raises ValueError when the
    engines use a hash algorithm other than ``builtin``, which no controller can reproduce.
    """
    settings = dict(base or {})
    if "chunk_size" in data:
        try:
            settings["chunk_size"] = int(data["chunk_size"])
        except (TypeError, ValueError):
            raise ValueError(f"chunk_size: {data['chunk_size']!r} is not an integer") from None
    if "save_unfull_chunk" in data:
        settings["save_unfull_chunk"] = data["save_unfull_chunk"]
    algo = str(data.get("pre_caching_hash_algorithm", "builtin"))
    if algo != "builtin":
        raise ValueError(
            f"pre_caching_hash_algorithm {algo!r} is not reproducible by a controller; "
            "configure the engines with 'builtin'"
        )
    return HashProfile.from_settings(settings)
