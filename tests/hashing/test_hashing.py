"""Golden chunk hashes for every LMCache era (values: docs/lmcache-protocol.md §4)."""

from __future__ import annotations

import pytest

from kvlookup.config import load
from kvlookup.hashing.lmcache import HASH_OF_NONE, HashProfile, profile_from_lmcache_yaml, seeded_str_hash
from tests.conftest import SEED_TOKENS

SEED_YAML = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
enable_controller: True
lmcache_instance_id: "lmcache_default_instance"
controller_pull_url: "localhost:9001"
lmcache_worker_ports: 8001
p2p_host: "localhost"
p2p_init_ports: 8200
"""


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, 4690244967161877535),
    ({"none_hash": "seed", "hash_seed": "123"}, 1501800476258242596),
    ({"none_hash": "seed", "hash_seed": 123, "extra_keys": "none"}, 9123220531798569477),
    ({"extra_keys": "none"}, 910950237627509625),
    ({"extra_keys": "absent"}, -6070459947100449250),
    ({"extra_keys": "sha256"}, "61c2b0ee121bc0763dbbeea739151226a766c47730c3a57bb614a91f1734493d"),
    ({"none_hash": -6197052367682486848}, 1501800476258242596),
])
def test_seed_golden(settings, expected):
    assert HashProfile.from_settings(settings).chunk_hashes(SEED_TOKENS) == [expected]


def test_multi_chunk_golden():
    profile = HashProfile()
    assert profile.chunk_bounds(600) == [(0, 256), (256, 512), (512, 600)]
    assert profile.chunk_hashes(list(range(1000, 1600))) == [
        -9006915360733114755, 6249281391258955993, -8949972916775179974]


def test_seeded_none_hash_is_cpython_hash_of_seed_string():
    assert seeded_str_hash("123") == -6197052367682486848
    assert HASH_OF_NONE == 4238894112


def test_save_unfull_chunk_off_drops_partial_tail():
    profile = HashProfile(save_unfull_chunk=False)
    assert profile.chunk_hashes(SEED_TOKENS) == []
    assert profile.chunk_hashes(list(range(1000, 1600))) == [-9006915360733114755, 6249281391258955993]


def test_chunks_chain_on_the_whole_prefix():
    profile = HashProfile(chunk_size=4)
    a = profile.chunk_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = profile.chunk_hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]
    assert profile.chunk_hashes([1, 2, 3, 4]) == a[:1]


def test_profile_from_seed_yaml(tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(SEED_YAML)
    settings = load(None, overrides={"lmcache_config": str(path)}, env={})
    profile = settings.profile()
    assert (profile.chunk_size, profile.save_unfull_chunk, profile.algorithm) == (256, True, "builtin")
    assert profile.chunk_hashes(SEED_TOKENS) == [4690244967161877535]


def test_profile_yaml_overrides_chunk_size_and_unfull():
    profile = profile_from_lmcache_yaml({"chunk_size": 512, "save_unfull_chunk": False})
    assert (profile.chunk_size, profile.save_unfull_chunk) == (512, False)


def test_profile_yaml_rejects_unreproducible_algorithm():
    with pytest.raises(ValueError, match="pre_caching_hash_algorithm 'sha256_cbor'"):
        profile_from_lmcache_yaml({"pre_caching_hash_algorithm": "sha256_cbor"})


@pytest.mark.parametrize(("settings", "message"), [
    ({"chunk_size": 0}, "chunk_size must be a positive integer"),
    ({"extra_keys": "tuple"}, "extra_keys must be one of"),
    ({"none_hash": "seed"}, "needs hash_seed"),
    ({"none_hash": "seed", "hash_seed": "abc"}, "PYTHONHASHSEED must be an integer"),
    ({"none_hash": "zero"}, "none_hash must be 0, 'seed' or an integer"),
    ({"save_unfull_chunk": "maybe"}, "save_unfull_chunk must be a boolean"),
])
def test_bad_profile_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        HashProfile.from_settings(settings)


def test_env_sets_profile():
    settings = load(None, env={"KVLOOKUP_HASH__EXTRA_KEYS": "none", "KVLOOKUP_HASH__NONE_HASH": "seed",
                               "KVLOOKUP_HASH__HASH_SEED": "123"})
    assert settings.profile().chunk_hashes(SEED_TOKENS) == [9123220531798569477]
