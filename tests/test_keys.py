"""The Redis key schema is a public API: pin every key string (docs/redis-schema.md)."""

from kvlookup import keys


def test_key_strings():
    assert keys.chunk_key(4690244967161877535) == "kvl:v1:chunk:4690244967161877535"
    assert keys.chunk_key(-5, space="v16") == "kvl:v1:chunk:v16:-5"
    assert keys.chunk_prefix() == "kvl:v1:chunk:"
    assert keys.holder_key(7) == "kvl:v1:holder:7"
    assert keys.holder_chunks_key(7, 1234) == "kvl:v1:holder:7:chunks:1234"
    assert keys.chunk_bucket(4690244967161877535) == 940
    assert keys.chunk_bucket(5) == 53 and keys.HOLDER_CHUNK_BUCKETS == 2048
    assert keys.holder_seq_key() == "kvl:v1:holders:seq"
    assert keys.dead_holders_key() == "kvl:v1:holders:dead"
    assert keys.instances_key() == "kvl:v1:instances"
    assert keys.instance_key("lmcache_default_instance") == "kvl:v1:instance:lmcache_default_instance"
    assert keys.instance_workers_key("a") == "kvl:v1:instance:a:workers"
    assert keys.instance_alive_key("a") == "kvl:v1:instance:a:alive"
    assert keys.worker_key("a", 1) == "kvl:v1:worker:a:1"
    assert keys.ip_index_key("10.0.0.1") == "kvl:v1:ip:10.0.0.1"
    assert keys.block_sizes_key() == "kvl:v1:vllm:block_sizes"
    assert keys.engine_map_key("a", 1) == "kvl:v1:instance:a:blocks:1"
    assert keys.vllm_space(16) == "v16"
    assert keys.chunk_key(42, keys.vllm_space(16)) == "kvl:v1:chunk:v16:42"
    assert keys.rank_field("seq", 2) == "seq:2"
    assert keys.location_field("LocalCPUBackend") == "loc:LocalCPUBackend"
    assert keys.instance_workers_key("a:workers") == "kvl:v1:instance:a%3Aworkers:workers"
    assert keys.worker_key("pod:8000", 1) == "kvl:v1:worker:pod%3A8000:1"
    assert keys.key_name("50%:x") == "50%25%3Ax"
    assert keys.event_key("Clear1234") == "kvl:v1:event:Clear1234"


def test_prefixes_used_by_lua_match_builders():
    assert keys.holder_key(3) == keys.HOLDER_PREFIX + "3"
    assert keys.worker_key("i", 0) == keys.WORKER_PREFIX + "i:0"
    assert keys.instance_alive_key("i") == keys.INSTANCE_PREFIX + "i:alive"
    assert keys.instance_workers_key("i") == keys.INSTANCE_PREFIX + "i:workers"
    assert keys.PREFIX == "kvl:v1:"
