"""The Redis key schema is a public API: pin every key string (docs/redis-schema.md)."""

from redis.crc import key_slot

from kvlookup.index import keys


def test_record_keys():
    assert keys.chunk_key(4690244967161877535) == "kvl:v2:chunk:4690244967161877535"
    assert keys.chunk_key(-5, space="v16") == "kvl:v2:chunk:v16:-5"
    assert keys.chunk_prefix() == "kvl:v2:chunk:"
    assert keys.chunk_key(42, keys.vllm_space(16)) == "kvl:v2:chunk:v16:42"
    assert keys.holder_chunks_key(7, 1234) == "kvl:v2:holder:7:chunks:1234"
    assert keys.holder_buckets_key(7) == "kvl:v2:holder:7:buckets"
    assert keys.chunk_bucket(4690244967161877535) == 940
    assert keys.chunk_bucket(5) == 53 and keys.HOLDER_CHUNK_BUCKETS == 2048
    assert keys.engine_map_key("a", 1) == "kvl:v2:blocks:a:1"
    assert keys.event_key("Clear1234") == "kvl:v2:event:Clear1234"



def test_chunk_digest_member():
    """The digest member of a chunk set (docs/redis-schema.md) and its arithmetic, as the scripts
    compute it (redis.sha1hex): SHA-1("1") starts 356a192b7913."""
    assert keys.CHUNK_DIGEST_MEMBER == "#" and keys.DIGEST_MOD == 2**48
    assert keys.holder_digest("1") == 0x356A192B7913 == 58729805084947
    assert keys.set_digest(["#", "1", "2"]) == (58729805084947 + 240018110528204) % 2**48 == 17272938902495
    assert keys.holders_of(["#", "1", "2"]) == ["1", "2"] and keys.holders_of(["7"]) == ["7"]

def test_registry_keys():
    assert keys.holders_key() == "kvl:v2:{r}:holders"
    assert keys.claims_key() == "kvl:v2:{r}:claims"
    assert keys.holder_seq_key() == "kvl:v2:{r}:holders:seq"
    assert keys.holder_gen_key() == "kvl:v2:{r}:holders:gen"
    assert keys.records_key() == "kvl:v2:{r}:records"
    assert keys.dead_holders_key() == "kvl:v2:{r}:dead"
    assert keys.purge_key() == "kvl:v2:{r}:purge"
    assert keys.instances_key() == "kvl:v2:{r}:instances"
    assert keys.instance_key("lmcache_default_instance") == "kvl:v2:{r}:instance:lmcache_default_instance"
    assert keys.instance_workers_key("a") == "kvl:v2:{r}:instance:a:workers"
    assert keys.worker_key("a", 1) == "kvl:v2:{r}:worker:a:1"
    assert keys.rules_key() == "kvl:v2:{r}:rules"
    assert keys.alive_key() == "kvl:v2:{r}:alive"
    assert keys.lease_clock_key() == "kvl:v2:{r}:leases:clock"
    assert keys.health_probe_key() == "kvl:v2:{r}:health:probe"
    assert keys.heartbeats_key() == "kvl:v2:{r}:heartbeats"
    assert keys.suspects_key() == "kvl:v2:{r}:suspects"
    assert keys.ip_index_key("10.0.0.1") == "kvl:v2:{r}:ip:10.0.0.1"
    assert keys.block_sizes_key() == "kvl:v2:{r}:block_sizes"
    assert keys.owners_key() == "kvl:v2:{r}:owners"
    assert keys.sidecar_instances_key("host:9001") == "kvl:v2:{r}:sidecar:host%3A9001:instances"
    assert keys.sidecars_key() == "kvl:v2:{r}:sidecars"
    assert keys.sidecar_status_key("s") == "kvl:v2:{r}:sidecar:s:status"


def test_packed_values():
    assert keys.holder_value("a", 0, "LocalCPUBackend") == "a\t0\tLocalCPUBackend\t"
    assert keys.parse_holder("a\t3\tGPU\tv16") == ("a", "3", "GPU", "v16")
    assert keys.worker_member("a", 2) == "2\ta"
    assert keys.vllm_space(16) == "v16"
    assert keys.rank_field("seq", 2) == "seq:2"
    assert keys.location_field("LocalCPUBackend") == "loc:LocalCPUBackend"
    assert keys.location_field("GPU", "v16g1") == "loc:GPU@v16g1"
    assert keys.vllm_group_space(16, 1) == "v16g1"
    assert keys.engine_field(7) == keys.engine_field(7, 0) == "7" and keys.engine_field(7, 2) == "7@2"
    assert keys.group_field(1, 2) == "group:1:2"
    assert (keys.vllm_chain(16), keys.vllm_chain(16, 1)) == ("16", "16+1")
    assert keys.parse_vllm_chains("16,256,16+1,x,0") == [(16, 0), (256, 0), (16, 1)]


def test_instance_ids_are_encoded_inside_keys():
    assert keys.instance_workers_key("a:workers") == "kvl:v2:{r}:instance:a%3Aworkers:workers"
    assert keys.worker_key("pod:8000", 1) == "kvl:v2:{r}:worker:pod%3A8000:1"
    assert keys.key_name("50%:x") == "50%25%3Ax"


def test_registry_is_one_slot_and_records_spread():
    registry = [keys.holders_key(), keys.dead_holders_key(), keys.worker_key("a{b}", 0),
                keys.instance_key("{x}"), keys.ip_index_key("1.2.3.4"), keys.sidecar_instances_key("s")]
    assert {key_slot(k.encode()) for k in registry} == {key_slot(b"r")}
    chunks = {key_slot(keys.chunk_key(h).encode()) for h in range(10_000)}
    assert len(chunks) > 4000  # chunk records land on slots all over the cluster
