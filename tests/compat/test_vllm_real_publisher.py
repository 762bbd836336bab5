"""The sidecar against vLLM's REAL KV event publisher (vLLM's own kv_events.py, several
versions), driven by tests/compat/vllm_publisher.py. Needs KVLOOKUP_VLLM_PYTHON and KVLOOKUP_VLLM_SRC
(scripts/real-peers.sh builds them); skipped otherwise."""

from __future__ import annotations

import subprocess
import time

import pytest

import kvlookup.app as app
from kvlookup.client import Client, VllmChains
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port, port_free
from kvlookup.sidecar.vllm_zmq import VllmSource
from tests.sidecar.test_sidecar_lmcache import S600, S600_HASHES
from tests.support.helpers import vllm_sidecar, wait_for
from tests.support.vllm_helpers import FIXTURES, PUBLISHER, RealPublisher, Relay, layout, real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    real_vllm() is None, reason="KVLOOKUP_VLLM_PYTHON / KVLOOKUP_VLLM_SRC not set")]

A = list(range(1000, 1032))
B = list(range(2000, 2016))


def free_pair() -> int:
    """A port P with P+1 free too (rank 1 of a data-parallel engine binds P+1)."""
    while True:
        port = free_port()
        if port < 65535 and port_free(port + 1):
            return port


def u64(h) -> int:
    return int.from_bytes(bytes.fromhex(h[4:])[-8:], "big") if isinstance(h, str) else h


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


@pytest.mark.parametrize("version,int_hashes", [("0.25.1", True), ("0.33.0", False), ("0.10.2", False)])
def test_late_join_live_offload_and_removal(r, client, version, int_hashes):
    port, rport = free_port(), free_port()
    pub = RealPublisher(version, port, rport, int_hashes=int_hashes)
    sc = None
    try:
        first = pub.send({"stored": {"token_ids": A, "block_size": 16}})["batch"]["events"][0]
        # published before the sidecar listens: replayed from seq 0 at first contact
        second = pub.send({"stored": {"token_ids": B, "block_size": 16, "prefix_token_ids": A}})
        sc = vllm_sidecar(r, VllmSource("pod-a", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"))
        pub.send({"stored": {"token_ids": [], "hash_token_ids": A, "block_size": 16, "medium": "CPU"}})
        want = {"pod-a": ("GPU", 48)}
        assert wait_for(lambda: layout(client, A + B), want) == want
        pub.send({"removed": {"token_ids": A, "block_size": 16}})  # GPU copies of A go, CPU stays
        want = {"pod-a": ("CPU", 48)}  # blocks 0-1 now on CPU only, block 2 on GPU
        assert wait_for(lambda: layout(client, A + B), want) == want
        engine_hashes = [u64(h) for h in first["block_hashes"] + second["batch"]["events"][0]["block_hashes"]]
        assert sorted(int(h) for h in r.hkeys(keys.engine_map_key("pod-a", 0))) == sorted(engine_hashes)
        ing = sc.ingest("pod-a")
        pub.send({"cleared": {}})
        assert wait_for(lambda: layout(client, A), {}) == {}
        # the sidecar notes seq 4 just after its write is visible to lookups
        state = wait_for(lambda: (dict(ing.resyncs), dict(ing.rejected), ing.ranks[0].last), ({}, {}, 4))
        assert state == ({}, {}, 4)
        assert r.hget(keys.instance_key("pod-a"), "resync:0") is None
    finally:
        if sc:
            sc.close()
        assert pub.close() == 0


def test_lossy_gap_replay_then_engine_restart(r, client):
    port, rport = free_port(), free_port()
    pub = RealPublisher("0.33.0", port, rport)
    relay = Relay(f"tcp://127.0.0.1:{port}", drop={1})
    sc = vllm_sidecar(r, VllmSource("pod-a", f"tcp://127.0.0.1:{relay.port}", f"tcp://127.0.0.1:{rport}"))
    try:
        pub.send({"stored": {"token_ids": A, "block_size": 16}})
        pub.send({"stored": {"token_ids": B, "block_size": 16, "prefix_token_ids": A}})  # relay drops it
        pub.send({"removed": {"token_ids": A[:16], "block_size": 16}})
        ing = sc.ingest("pod-a")
        assert wait_for(lambda: ing.ranks[0].last if 0 in ing.ranks else None, 2) == 2
        assert 1 not in relay.forwarded
        # block 0 removed: nothing matches from token 0, but the healed chain is there
        assert layout(client, A + B) == {}
        assert r.hlen(keys.engine_map_key("pod-a", 0)) == 2
        pub.close()
        pub = RealPublisher("0.33.0", port, rport)  # engine restart: seq back to 0, same ports
        time.sleep(0.5)  # the relay's SUB reconnects to the new PUB (setup, not an assertion)
        pub.send({"stored": {"token_ids": B, "block_size": 16}})
        want = {"pod-a": ("GPU", 16)}
        assert wait_for(lambda: layout(client, B), want) == want
        # a batch a catch-up on connect replayed before its live copy arrived is applied once and
        # counted as a duplicate when the live copy comes
        assert dict(ing.resyncs) == {"engine_restart": 1} and ing.duplicates <= 1
        assert r.hlen(keys.engine_map_key("pod-a", 0)) == 1
    finally:
        sc.close()
        relay.close()
        assert pub.close() == 0


def test_dp_rank_and_mixed_fleet_over_http(r, redis_settings):
    port, rport, pull = free_pair(), free_pair(), f"127.0.0.1:{free_port()}"
    pub = RealPublisher("0.26.0", port, rport, dp_rank=1, int_hashes=False)  # binds port+1, rport+1
    sc = vllm_sidecar(r, VllmSource("vllm-pod", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", dp_size=2),
                 pull_url=pull)
    worker = WorkerSim("lmcache-pod", era="0.3", pull_url=pull)
    try:
        worker.register()
        worker.admit(S600_HASHES[:2])
        pub.send({"stored": {"token_ids": S600[:48], "block_size": 16, "lora_name": None}})
        pub.send({"stored": {"token_ids": S600[:16], "block_size": 16, "lora_id": 3, "lora_name": "sql-lora",
                             "block_hashes": [11]}})
        http = app.create_app(redis_settings).test_client()
        want = {"lmcache-pod": ["LocalCPUBackend", 512], "vllm-pod": ["GPU", 48]}

        def ask(body, q=""):
            out = http.post("/lookup" + q, json=body).json
            out.pop("event_id")
            return out

        assert wait_for(lambda: ask({"tokens": S600}), want) == want
        assert ask({"tokens": S600}, "?detail=1")["detail"]["vllm-pod"] == {
            "location": "GPU", "matched_prefix_length": 48, "locations": {"GPU": 48}, "ranks": {"1": 48},
            "reusable_prefix_length": 48}
        assert ask({"tokens": S600[:20], "lora_name": "sql-lora"}) == {"vllm-pod": ["GPU", 16]}
        assert ask({"tokens": S600[:20], "lora_name": "other"}) == {}
    finally:
        worker.close()
        sc.close()
        assert pub.close() == 0


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.25.1", "0.26.0", "0.33.0"])
def test_fixtures_are_what_vllms_encoder_writes(tmp_path, version):
    """tests/fixtures/vllm is reproduced byte for byte by vLLM's own structs and encoder."""
    py, src = real_vllm()
    for int_hashes in ("1", "0"):
        subprocess.run([py, str(PUBLISHER), "golden", "--vllm-src", f"{src}/x/vllm-{version}", "--out", str(tmp_path),
                        "--int-hashes", int_hashes], check=True, capture_output=True, timeout=120)
    for made in sorted(tmp_path.glob("*.msgpack")):
        assert made.read_bytes() == (FIXTURES / made.name).read_bytes(), made.name
    assert len(list(tmp_path.glob("*.msgpack"))) == 2
