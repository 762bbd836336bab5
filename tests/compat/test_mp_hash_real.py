"""The MP chunk hash of kvlookup's both token decodes (kvlookup.wire.mp_tokens: pysimdjson + numpy to
packed big-endian uint32; msgspec's list[int]) bit for bit against LMCache's own ``TokenHasher``
(blake3, chunk size 256) in the real LMCache venvs (KVLOOKUP_LMCACHE_PYTHON, KVLOOKUP_LMCACHE057_PYTHON)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile

import msgspec
import pytest

from kvlookup.hashing import mp as mphash
from kvlookup.wire import lmcache_mp as W
from kvlookup.wire import mp_tokens

PYTHONS = [p for p in (os.environ.get("KVLOOKUP_LMCACHE_PYTHON"), os.environ.get("KVLOOKUP_LMCACHE057_PYTHON")) if p]
pytestmark = [pytest.mark.lmcache,
              pytest.mark.skipif(not PYTHONS, reason="KVLOOKUP_LMCACHE_PYTHON is not set (a venv with LMCache)")]

PROMPTS = [list(range(1000, 1512)), [0, 2**32 - 1, 2**31] * 300,
           [random.Random(9).randrange(0, 2**32) for _ in range(2048 + 100)],
           [random.Random(10).randrange(0, 128000) for _ in range(32768)]]
HASHER = """import json, sys
from lmcache.v1.multiprocess.token_hasher import TokenHasher
h = TokenHasher(256, "blake3")
print(json.dumps([[x.hex() for x in h.compute_chunk_hashes(p)] for p in json.load(sys.stdin)]))
"""


@pytest.mark.parametrize("python", PYTHONS or [None])
def test_both_decodes_hash_as_lmcache(python, monkeypatch):
    monkeypatch.setattr(mp_tokens, "MIN_BYTES", 0)  # the packed decode for the small prompts too
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "NUMBA_CACHE_DIR": scratch}
        out = subprocess.run([python, "-c", HASHER], input=json.dumps(PROMPTS), capture_output=True, text=True,
                             env=env, timeout=300, check=True).stdout
    theirs = json.loads(out.strip().splitlines()[-1])
    for prompt, want in zip(PROMPTS, theirs, strict=True):
        raw = msgspec.json.encode({"token_ids": prompt, "model_name": "m"})
        fast = mp_tokens.decode_tokens_form(raw)
        assert fast is not None
        assert [h.hex() for h in mphash.chunk_hashes_packed(fast.packed)] == want
        assert mphash.chunk_hashes_hex(W.decode(raw, W.DirectoryLookupRequest).token_ids) == want
        assert len(want) == len(prompt) // 256
