"""Fixes for what an adversarial review found: bounded script runs, Redis errors, reaped
workers coming back, forgotten instances, deep nesting, bad addresses, endless replays."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import redis
import zmq

from kvlookup.app import create_app
from kvlookup.client import MAX_BLOCK_SIZES, Client, VllmChains
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index import single as records_mod
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.proc.redis_server import free_port
from kvlookup.sidecar.lmcache_ingest import MAX_REDIS_FAILURES, LMCacheIngest
from kvlookup.sidecar.vllm_zmq import ReplayClient
from kvlookup.wire import lmcache as proto
from kvlookup.wire.errors import WireError
from tests.conftest import SEED_HASH, SEED_TOKENS

CPU = "LocalCPUBackend"


@pytest.mark.single_node  # APPLY_OPS is the single-node script; the cluster writes plain commands
def test_huge_batches_run_in_bounded_slices(store, r, monkeypatch):
    monkeypatch.setattr(records_mod, "MAX_OPS_PER_CALL", 1000)
    calls = []
    real = store.records.io.send  # the write is sent, its replies read after (SingleIO.send)

    def spy(commands):
        calls.extend((len(c) - 12) // 3 for c in commands)  # EVALSHA sha n, 4 keys, 5 args, then 3 per op
        return real(commands)

    monkeypatch.setattr(store.records.io, "send", spy)
    store.register_worker("a", 0)
    hashes = HashProfile(chunk_size=1).chunk_hashes(list(range(4500)))
    assert store.apply([("a", 0, CPU, [(ADMIT, h) for h in hashes])]) == 4500
    assert calls == [1000, 1000, 1000, 1000, 500]
    assert r.hget(keys.records_key(), "1") == "4500"
    assert r.zrange(keys.chunk_key(hashes[-1]), 0, -1) == ["1"]


@pytest.mark.single_node  # APPLY_OPS's steps
def test_a_call_of_many_evictions_logs_them_in_steps(store, r):
    """4,500 evictions in one APPLY_OPS call: logged by one ZADD per 2,000, trimmed to EVICTED_MAX,
    every record gone from its chunk set and reverse index."""
    store.register_worker("a", 0)
    hashes = [str(h) for h in HashProfile(chunk_size=1).chunk_hashes(list(range(4500)))]
    assert store.apply([("a", 0, CPU, [(ADMIT, h) for h in hashes])], now_ms=1_000) == 4500
    assert store.apply([("a", 0, CPU, [(EVICT, h) for h in hashes])], now_ms=2_000) == 4500
    logged = r.zrange(keys.holder_evicted_key("1"), 0, -1, withscores=True)
    assert len(logged) == keys.EVICTED_MAX
    assert {s for _h, s in logged} == {2000.0} and {h for h, _s in logged} <= set(hashes)
    assert r.hget(keys.records_key(), "1") == "0"
    assert not any(r.exists(keys.chunk_key(h)) for h in hashes[::97])
    assert sum(r.scard(keys.holder_chunks_key("1", b)) for b in range(keys.HOLDER_CHUNK_BUCKETS)) == 0


def test_redis_errors_keep_ops_pending_then_drop_them(store, monkeypatch):
    ingest = LMCacheIngest(store)
    store.register_worker("busy", 0)
    frame = proto.encode(proto.KVAdmitMsg("busy", 0, SEED_HASH, CPU))
    real, failures = store.apply_prepare, [1]  # the ingest's write (built, sent, then its replies read)

    def flaky(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise redis.ResponseError("BUSY Valkey is busy running a script")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "apply_prepare", flaky)
    ingest.handle_push([frame])
    with pytest.raises(redis.ResponseError):
        ingest.flush()
    assert ingest.queued_ops == 1  # kept for the next flush
    ingest.flush()
    assert Client(store=store).lookup(SEED_TOKENS)[1] == {"busy": (CPU, 12)}
    failures[0] = MAX_REDIS_FAILURES
    ingest.handle_push([frame])
    for _ in range(MAX_REDIS_FAILURES - 1):
        with pytest.raises(redis.ResponseError):
            ingest.flush()  # failures 1..4: still queued
    assert ingest.queued_ops == 1
    ingest.flush()  # failure 5 drops the batch instead of wedging the sidecar
    assert ingest.queued_ops == 0 and not ingest.queue


def test_worker_reaped_elsewhere_is_registered_again_by_a_03_admit(store):
    ingest = LMCacheIngest(store, "sc")
    ingest.handle_push([proto.encode(proto.RegisterMsgV3("old", 0, "127.0.0.1", 8001, "localhost:8200"))])
    store.deregister_worker("old", 0)  # e.g. another sidecar's reaper, while this one stalled
    ingest.handle_push([proto.encode(proto.KVAdmitMsg("old", 0, SEED_HASH, CPU))])
    ingest.flush()
    assert Client(store=store).lookup(SEED_TOKENS)[1] == {"old": (CPU, 12)}


def test_ops_of_unregistered_workers_are_dropped_and_counted(store, r):
    """LMCache 0.5 drops batches of unknown workers; so do we (evicts of any era too), and no
    instance appears for them. Only a 0.3-era admit registers its worker implicitly."""
    ingest = LMCacheIngest(store, "sc")
    before = _ops("unregistered")
    frames = [proto.encode(proto.BatchedKVOperationMsg("ghost", 0, CPU, [proto.OpEvent("admit", 1, 0)])),
              proto.encode(proto.KVEvictMsg("ghost03", 0, 2, CPU)),
              proto.encode(proto.FullSyncBatchMsg("ghost", 0, CPU, "s", 0, [3, 4]))]
    ingest.handle_push(frames)
    ingest.flush()
    assert _ops("unregistered") - before == 4
    assert r.smembers(keys.instances_key()) == set() and r.hgetall(keys.owners_key()) == {}


def _ops(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return sum(REGISTRY.get_sample_value("kvlookup_ingest_ops_total", {"kind": k, "outcome": outcome}) or 0
               for k in ("admit", "evict"))


def test_deregistered_instances_leave_their_sidecar(store, r):
    ingest = LMCacheIngest(store, "sc")
    store.own("sc", "mine")
    for inst in ("x", "y"):
        ingest.handle_push([proto.encode(proto.RegisterMsgV3(inst, 0, "127.0.0.1", 8001, "h:1"))])
    assert store.owned("sc") == {"mine", "x", "y"}
    ingest.handle_push([proto.encode(proto.DeRegisterMsg("x", 0, "127.0.0.1", 8001))])
    assert store.owned("sc") == {"mine", "y"}
    assert r.hgetall(keys.owners_key()) == {"mine": "sc", "y": "sc"}


def test_deep_nesting_is_a_clear_rejection(redis_settings):
    bomb = b"\x91" * 100_000 + b"\x01"
    with pytest.raises(WireError) as info:
        proto.decode_frame(bomb)
    assert info.value.reason == "undecodable"
    http = create_app(redis_settings).test_client()
    body = b'{"x":' + b"[" * 200_000 + b"]" * 200_000 + b',"tokens":[1]}'
    resp = http.post("/lookup", data=body, content_type="application/json")
    assert (resp.status_code, resp.get_json()) == (400, {"error": "body is not valid JSON: nested too deeply"})


@pytest.mark.parametrize(("fields", "message"), [
    ({"port": -5}, "port -5 out of range"),
    ({"port": 70000}, "port 70000 out of range"),
    ({"ip": "not an ip!"}, "ip must be a host"),
    ({"instance_id": "a\nb"}, "instance_id must be 1..256 printable characters"),
])
def test_registrations_with_unusable_fields_are_rejected(fields, message):
    msg = {"type": "RegisterMsg", "instance_id": "p", "worker_id": 0, "ip": "127.0.0.1", "port": 8001,
           "distributed_url": "x:1", **fields}
    with pytest.raises(WireError, match=message):
        proto.decode_frame(msgpack.packb(msg))


def test_unusable_worker_address_is_an_error_code_not_a_500(redis_settings, store):
    store.register_worker("p2", 0, "bad host!", 8001)
    # '*': let it reach the connect (the default worker_networks refuses it first: -1006)
    app = create_app({**redis_settings, "control_timeout_s": 0.2, "control_retries": 0, "worker_networks": "*"})
    resp = app.test_client().post("/health", json={"instance_id": "p2"})
    assert resp.status_code == 200
    assert resp.get_json()["error_codes"] == {"0": -1005}
    app.extensions["kvlookup"]["control"].close()


def test_endless_replay_gives_up_in_bounded_time():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def flood():
        ident = router.recv_multipart()[0]
        seq = 0
        while not stop.is_set():
            router.send_multipart([ident, b"", seq.to_bytes(8, "big"), msgpack.packb([0.0, [], 0])])
            seq += 1
            time.sleep(0.0005)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    client = ReplayClient(ctx, f"tcp://127.0.0.1:{port}", timeout_s=0.1)
    start = time.monotonic()
    assert client(0, 0) is None  # never sent its end marker
    assert time.monotonic() - start < 5
    stop.set()
    t.join(2)
    client.close()
    router.close(0)


def test_lookups_walk_a_bounded_number_of_block_sizes(r):
    r.hset(keys.block_sizes_key(), mapping={keys.worker_member(f"v{bs}", 0): bs for bs in range(1, 40)})
    assert VllmChains(r, check_alive=False).block_sizes() == list(range(1, MAX_BLOCK_SIZES + 1))
    assert len(VllmChains(r, check_alive=False)(list(range(64)))) == MAX_BLOCK_SIZES


def test_store_caches_holders_per_worker(store):
    store.register_worker("a", 0)
    hid = store.holder_id("a", 0, CPU)
    assert store._holders == {("a", "0"): {(CPU, ""): hid}}
    store.register_worker("a", 0)
    assert store._holders == {}
    assert Store(store.r).holder_id("a", 0, CPU) != hid
