"""vLLM event streams through real ZMQ sockets into the sidecar, and one /lookup answering for
a mixed fleet (an LMCache instance and a vLLM instance)."""

from __future__ import annotations

import pytest

import kvlookup.app as app
from kvlookup.client import Client, VllmChains
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.sidecar.vllm_zmq import VllmSource
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.sidecar.test_sidecar_lmcache import S600, S600_HASHES
from tests.support.helpers import vllm_sidecar, wait_for
from tests.support.vllm_helpers import LoopbackPublisher, dp_publishers, layout, payload, removed, stored

A = list(range(1000, 1032))
B = list(range(2000, 2016))


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


@pytest.mark.parametrize("replay_topic", [False, True], ids=["replay-0.25", "replay-0.26"])
def test_live_gap_and_replay_over_zmq(r, client, replay_topic):
    pub = LoopbackPublisher(replay_topic=replay_topic)
    sc = vllm_sidecar(r, VllmSource("pod-a", pub.endpoint, pub.replay_endpoint, replay_timeout_s=1.0))
    try:
        pub.publish(payload(stored([1, 2], A)))
        assert wait_for(lambda: layout(client, A + B), {"pod-a": ("GPU", 32)}) == {"pod-a": ("GPU", 32)}
        pub.publish(payload(stored([3], B, parent=2)), send=False)  # dropped on the way
        pub.publish(payload(removed([1]), stored([1], A[:16])))
        assert wait_for(lambda: layout(client, A + B), {"pod-a": ("GPU", 48)}) == {"pod-a": ("GPU", 48)}
        ing = sc.ingest("pod-a")
        state = lambda: (ing.ranks[0].last, dict(ing.resyncs), dict(ing.rejected))  # noqa: E731
        assert wait_for(state, (2, {}, {})) == (2, {}, {})
    finally:
        sc.close()
        pub.close()


def test_replay_unavailable_marks_resync(r, client):
    pub = LoopbackPublisher(replay=False)
    sc = vllm_sidecar(r, VllmSource("pod-a", pub.endpoint, "tcp://127.0.0.1:1", replay_timeout_s=0.3))
    try:
        pub.publish(payload(stored([1, 2], A)))
        assert wait_for(lambda: layout(client, A), {"pod-a": ("GPU", 32)}) == {"pod-a": ("GPU", 32)}
        pub.publish(payload(stored([3], B)), send=False)
        pub.publish(payload(stored([4], A[:16])))
        ing = sc.ingest("pod-a")
        assert wait_for(lambda: dict(ing.resyncs), {"no_replay": 1}) == {"no_replay": 1}
        # cleared, then seq 2 applied
        assert wait_for(lambda: layout(client, A), {"pod-a": ("GPU", 16)}) == {"pod-a": ("GPU", 16)}
        assert r.hget(keys.instance_key("pod-a"), "resync:0") == "no_replay"
    finally:
        sc.close()
        pub.close()


def test_data_parallel_ranks_and_detail(r, redis_settings):
    pubs = dp_publishers(replay=False)  # rank r: port + r
    sc = None
    try:
        sc = vllm_sidecar(r, VllmSource("pod-dp", pubs[0].endpoint, dp_size=2))
        pubs[0].publish(payload(stored([1], A[:16])))
        pubs[1].publish(payload(stored([1, 2], A, rank=1), rank=1))
        flask_app = app.create_app(redis_settings)
        http = flask_app.test_client()
        expected = {"pod-dp": ["GPU", 32]}
        got = wait_for(lambda: {k: v for k, v in http.post("/lookup", json={"tokens": A}).json.items()
                                if k != "event_id"}, expected)
        assert got == expected
        want = {"pod-dp": {"location": "GPU", "matched_prefix_length": 32, "locations": {"GPU": 32},
                           "ranks": {"0": 16, "1": 32},
                           "reusable_prefix_length": 16}}  # vLLM recomputes the last token: 31 -> 16
        # rank 1 alone already gives the flat answer: wait until rank 0's batch is in too
        assert wait_for(lambda: http.post("/lookup?detail=1", json={"tokens": A}).json["detail"], want) == want
    finally:
        if sc:
            sc.close()
        for p in pubs:
            p.close()


def test_mixed_fleet_one_lookup(r, redis_settings):
    """An LMCache instance and a vLLM instance, both answered by one POST /lookup."""
    pub = LoopbackPublisher()
    from kvlookup.proc.redis_server import free_port

    pull_url = f"127.0.0.1:{free_port()}"
    sc = vllm_sidecar(r, VllmSource("vllm-pod", pub.endpoint, pub.replay_endpoint), pull_url=pull_url)
    worker = WorkerSim("lmcache-pod", era="0.3", pull_url=pull_url)
    try:
        worker.register()
        worker.admit([SEED_HASH])
        worker.admit(S600_HASHES[:2])
        pub.publish(payload(stored([7, 8], S600[:32])))
        pub.publish(payload(stored([9], list(range(16)), lora_name="x", lora_id=1)))
        http = app.create_app(redis_settings).test_client()
        want600 = {"lmcache-pod": ["LocalCPUBackend", 512], "vllm-pod": ["GPU", 32]}

        def ask(body):
            out = http.post("/lookup", json=body).json
            assert out.pop("event_id").startswith("Lookup")
            return out

        assert wait_for(lambda: ask({"tokens": S600}), want600) == want600
        assert list(ask({"tokens": S600})) == ["lmcache-pod", "vllm-pod"]  # longest first
        assert ask({"tokens": SEED_TOKENS}) == {"lmcache-pod": ["LocalCPUBackend", 12]}
        want = {"vllm-pod": ["GPU", 16]}
        assert wait_for(lambda: ask({"tokens": list(range(16)), "lora_name": "x"}), want) == want
        assert ask({"tokens": list(range(16))}) == {}
        assert http.post("/lookup", json={"tokens": [1], "lora_name": 5}).status_code == 400
    finally:
        worker.close()
        sc.close()
        pub.close()


def test_settings_and_cli_flags(r):
    from kvlookup import config as kvconfig
    from kvlookup.cli import build_parser, main

    env = {"KVLOOKUP_VLLM_ENDPOINT": "tcp://127.0.0.1:5557", "KVLOOKUP_INSTANCE_ID": "p",
           "KVLOOKUP_VLLM_BIND": "true", "KVLOOKUP_VLLM_DP_SIZE": "2"}
    s = kvconfig.load(None, env=env)
    got = (s.vllm_endpoint, s.instance_id, s.vllm_bind, s.vllm_dp_size)
    assert got == ("tcp://127.0.0.1:5557", "p", True, 2)
    with pytest.raises(ValueError, match="vllm_endpoint needs instance_id"):
        kvconfig.load(None, overrides={"vllm_endpoint": "tcp://127.0.0.1:5557"}, env={})
    with pytest.raises(ValueError, match="vllm_bind: 'maybe' is not true or false"):
        kvconfig.load(None, env={"KVLOOKUP_VLLM_BIND": "maybe"})
    args = build_parser().parse_args([
        "sidecar", "--vllm-endpoint", "tcp://h:5557", "--vllm-replay-endpoint", "tcp://h:5558",
        "--vllm-dp-size", "4", "--vllm-bind", "--instance-id", "x"])
    assert (args.vllm_endpoint, args.vllm_replay_endpoint, args.vllm_dp_size, args.vllm_bind) == (
        "tcp://h:5557", "tcp://h:5558", 4, True)
    no_id = ["sidecar", "--vllm-endpoint", "tcp://127.0.0.1:5557", "--redis-url", "redis://127.0.0.1:1"]
    assert main(no_id) == 2


def test_sidecar_vouches_for_its_vllm_instance(r):
    pub = LoopbackPublisher(replay=False)
    sc = vllm_sidecar(r, VllmSource("pod-quiet", pub.endpoint))
    try:
        assert wait_for(lambda: r.zscore(keys.alive_key(), "pod-quiet") is not None, True) is True
    finally:
        sc.close()
        pub.close()
