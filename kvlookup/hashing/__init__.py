"""Chunk hashes: LMCache's profiles (``lmcache``) and kvlookup's own chain for vLLM blocks (``vllm``).

The names most callers want are re-exported here.
"""

from kvlookup.hashing.lmcache import EXTRA_KEYS_MODES, HashProfile, profile_from_lmcache_yaml

__all__ = ["EXTRA_KEYS_MODES", "HashProfile", "profile_from_lmcache_yaml"]
