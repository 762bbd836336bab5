"""The sidecar against vLLM 0.33.0's REAL KV event publisher (its own kv_events.py structs,
encoder, PUB and replay ROUTER; tests/vllm_pub_driver.py): hybrid models' groups, GPU blocks
beside LMCache MP connector CPU chunks, EAGLE lookahead, tiers, catch-up on connect. Needs
KVLOOKUP_VLLM_PYTHON and KVLOOKUP_VLLM_SRC (scripts/real-peers.sh builds them)."""

from __future__ import annotations

import time

import pytest

from kvlookup.client import Client, VllmChains
from kvlookup.proc.redis_server import free_port
from kvlookup.sidecar.vllm_zmq import VllmSource
from tests.sidecar.test_vllm_discovery import MODEL, FakeVllmServer
from tests.sidecar.test_vllm_hybrid import FULL, MAMBA, SW, WORKED_HELD, A, P
from tests.support.helpers import vllm_sidecar, wait_for
from tests.support.procs import ControllerProc, SidecarProc
from tests.support.vllm_helpers import RealPublisher, detail, layout, real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    real_vllm() is None, reason="KVLOOKUP_VLLM_PYTHON / KVLOOKUP_VLLM_SRC not set")]

V = "0.33.0"
B = list(range(2000, 2016))
T = list(range(7000, 7100))  # 100 tokens: 6 full blocks of 16


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


class Pod:
    """One real 0.33.0 publisher and a sidecar subscribed to it."""

    def __init__(self, r):
        self.port, self.rport = free_port(), free_port()
        self.pub = RealPublisher(V, self.port, self.rport)
        self.source = VllmSource("pod-a", f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.rport}",
                                 replay_timeout_s=1.0)
        self.sc = vllm_sidecar(r, self.source)

    def ingest(self):
        return self.sc.ingest("pod-a")

    def close(self) -> None:
        self.sc.close()
        assert self.pub.close() == 0


@pytest.fixture()
def pod(r):
    p = Pod(r)
    yield p
    p.close()


def block(i: int, group: int, kind: dict) -> dict:
    return {"stored": {"token_ids": T[16 * i:16 * i + 16], "prefix_token_ids": T[:16 * i], "block_size": 16,
                       "group_idx": group, "extra_keys": [None], **kind}}


def test_hybrid_group0_sliding_window_group1_full_attention(pod, client):
    for kind_group in ((0, SW), (1, FULL)):  # vLLM's hashes, the same in both groups
        pod.pub.send({"stored": {"token_ids": A, "block_size": 16, "group_idx": kind_group[0],
                                 "extra_keys": [None, None], **kind_group[1]}})
    want = {"pod-a": ("GPU", 32, {"GPU": 32})}
    assert wait_for(lambda: layout(client, A + [7], "locations"), want) == want
    pod.pub.send({"removed": {"token_ids": A, "block_size": 16, "group_idx": 0}})
    ing = pod.ingest()
    assert wait_for(lambda: ing.ranks[0].last, 2) == 2
    assert layout(client, A + [7], "locations") == want  # the sliding-window group's remove leaves full attention's
    pod.pub.send({"removed": {"token_ids": A[16:], "prefix_token_ids": A[:16], "block_size": 16, "group_idx": 1}})
    want = {"pod-a": ("GPU", 16, {"GPU": 16})}
    assert wait_for(lambda: layout(client, A + [7], "locations"), want) == want
    assert (dict(ing.rejected), dict(ing.skipped)) == ({}, {})


def test_reusable_prefix_length_sliding_window_and_mamba(pod, client):
    """tests/sidecar/test_vllm_hybrid.py traces this example through vLLM's coordinator: 96 matched, 32 reusable."""
    for g, kind in ((0, SW), (1, FULL), (2, MAMBA)):
        pod.pub.send({"batch": [block(i, g, kind) for i in range(6)]})
    drops = [{"removed": {"token_ids": T[16 * i:16 * i + 16], "prefix_token_ids": T[:16 * i], "block_size": 16,
                          "group_idx": g}} for g in (0, 2) for i in range(6) if not WORKED_HELD[g][i]]
    pod.pub.send({"batch": drops})
    ing = pod.ingest()
    assert wait_for(lambda: ing.ranks[0].last, 3) == 3
    got = detail(client, T)["pod-a"]
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (96, 32)
    assert dict(ing.rejected) == {}


def test_gpu_blocks_and_mp_connector_cpu_chunks_one_stream(pod, client):
    pod.pub.send({"stored": {"token_ids": P[:48], "block_size": 16, "group_idx": 0, "extra_keys": [None] * 3,
                             **FULL}})
    c0, c1 = 0xB1A4E3000000000F, 0x0123456789ABCDEF  # LMCache BLAKE3 chunk hashes cut to 64 bits
    # what LMCacheMPConnector sends: medium CPU, one chunk of 256 per event, no group_idx
    pod.pub.send({"batch": [{"stored": {"block_hashes": [c0], "token_ids": P[:256], "block_size": 256,
                                        "medium": "CPU"}},
                            {"stored": {"block_hashes": [c1], "parent_block_hash": c0, "token_ids": P[256:],
                                        "block_size": 256, "medium": "CPU"}}]})
    want = {"pod-a": ("CPU", 512, {"GPU": 48, "CPU": 512})}
    assert wait_for(lambda: layout(client, P, "locations"), want) == want
    assert layout(client, P[:100], "locations") == {"pod-a": ("GPU", 48, {"GPU": 48})}
    # an LMCache server restart: the connector withdraws everything it announced
    pod.pub.send({"removed": {"block_hashes": [c0, c1], "medium": "CPU"}})
    want = {"pod-a": ("GPU", 48, {"GPU": 48})}
    assert wait_for(lambda: layout(client, P, "locations"), want) == want
    assert dict(pod.ingest().rejected) == {}


def test_lookahead_and_remote_tier(pod, client):
    pod.pub.send({"stored": {"block_hashes": [77], "token_ids": A[:16], "block_size": 16, "group_idx": 0,
                             "lookahead_token_ids": [[A[16]]], "session_id": "s-1", **FULL}})
    pod.pub.send({"stored": {"token_ids": [], "hash_token_ids": B, "block_size": 16, "medium": "STORAGE",
                             "locality": "REMOTE"}})
    want = {"pod-a": ("GPU", 16, {"GPU": 16})}
    assert wait_for(lambda: layout(client, A, "locations"), want) == want
    assert layout(client, A[:16] + [1], "locations") == {}
    ing = pod.ingest()
    assert wait_for(lambda: dict(ing.skipped), {"remote_tier": 1}) == {"remote_tier": 1}
    assert layout(client, B + [1], "locations") == {}


def test_restarted_publisher_one_batch_then_quiet(r, client):
    pod = Pod(r)
    try:
        pod.pub.send({"stored": {"token_ids": A, "block_size": 16}})
        pod.pub.send({"stored": {"token_ids": B, "block_size": 16}})
        want = {"pod-a": ("GPU", 32, {"GPU": 32})}
        assert wait_for(lambda: layout(client, A, "locations"), want) == want
        assert pod.pub.close() == 0
        pod.pub = RealPublisher(V, pod.port, pod.rport)  # seq back to 0
        start = time.monotonic()
        pod.pub.send({"stored": {"token_ids": B, "block_size": 16}})  # right away, then quiet
        want = ({}, {"pod-a": ("GPU", 16, {"GPU": 16})})
        both = lambda: (layout(client, A, "locations"), layout(client, B, "locations"))  # noqa: E731
        assert wait_for(both, want, timeout=3.0) == want
        assert time.monotonic() - start < 3.0
        ing = pod.ingest()
        assert (ing.ranks[0].last, dict(ing.resyncs)) == (0, {"engine_restart": 1})
    finally:
        pod.close()


def test_sidecar_restarted_while_engine_published(r, client):
    pod = Pod(r)
    try:
        pod.pub.send({"stored": {"token_ids": A, "block_size": 16}})
        want = {"pod-a": ("GPU", 32, {"GPU": 32})}
        assert wait_for(lambda: layout(client, A, "locations"), want) == want
        pod.sc.close()
        pod.pub.send({"stored": {"token_ids": B, "block_size": 16}})  # no sidecar listens
        start = time.monotonic()
        pod.sc = vllm_sidecar(r, pod.source)  # the engine stays quiet
        want = {"pod-a": ("GPU", 16, {"GPU": 16})}
        assert wait_for(lambda: layout(client, B, "locations"), want, timeout=3.0) == want
        assert time.monotonic() - start < 3.0
        ing = pod.ingest()
        assert (ing.ranks[0].last, dict(ing.resyncs), layout(client, A, "locations")) == (
            1, {}, {"pod-a": ("GPU", 32, {"GPU": 32})})
    finally:
        pod.close()


def test_vllm_url_alone_with_publishers_on_port_0(r, redis_args):
    """``--vllm-url`` in front of vLLM's own publishers started as ``tcp://*:0`` (the OS picks each
    port; ``/kv_event_sources`` is how a consumer learns them). What they report is vLLM's resolved
    KVEventsConfig: a concrete address it *bound* (kv_events.py ``_bind``), so the sidecar connects.
    Every DP rank, lookups scoped by the model, and an engine restart on new ports followed."""
    def engine() -> list[RealPublisher]:
        return [RealPublisher(V, "tcp://*:0", "tcp://*:0", dp_rank=rank, topic="kv@pod") for rank in (0, 1)]

    def sources(pubs: list[RealPublisher]) -> dict:
        return {str(rank): p.config for rank, p in enumerate(pubs)}

    pubs = engine()
    server = FakeVllmServer(sources(pubs))
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    inst = server.url.removeprefix("http://")
    sc = None
    ctl = ControllerProc(*redis_args, "--workers", "1").wait_ready()

    def http(tokens: list[int], model: str) -> dict:  # POST /lookup through the real controller
        body = ctl.session.post(f"{ctl.http}/lookup", json={"tokens": tokens, "model_name": model}, timeout=10).json()
        return {k: v for k, v in body.items() if k != "event_id"}

    try:
        assert [(p.config["endpoint"].rpartition(":")[0], p.config["replay_endpoint"].rpartition(":")[0],
                 p.config["topic"]) for p in pubs] == [("tcp://127.0.0.1", "tcp://127.0.0.1", "kv@pod")] * 2
        pubs[0].send({"stored": {"token_ids": A[:16], "block_size": 16}})  # before the sidecar listens
        sc = SidecarProc(*redis_args, "--vllm-url", server.url).start()
        pubs[1].send({"stored": {"token_ids": A, "block_size": 16}})
        want = {inst: ("GPU", 32, {"0": 16, "1": 32})}
        assert wait_for(lambda: layout(client, A, "ranks", model_name=MODEL), want) == want
        assert layout(client, A, "ranks", model_name="another-model") == {}
        assert wait_for(lambda: http(A, MODEL), {inst: ["GPU", 32]}) == {inst: ["GPU", 32]}
        assert http(A, "another-model") == {}
        for p in pubs:  # the engine restarts: new ports
            assert p.close() == 0
        pubs = engine()
        server.sources = sources(pubs)
        pubs[1].send({"stored": {"token_ids": B, "block_size": 16}})
        want = {inst: ("GPU", 16, {"1": 16})}
        assert wait_for(lambda: layout(client, B, "ranks", model_name=MODEL), want, timeout=10.0) == want
        assert layout(client, A, "ranks") == {}  # the restarted engine's cache is empty
    finally:
        if sc is not None:
            sc.stop()
        ctl.stop()
        server.close()
        for p in pubs:
            p.close()


def test_restarted_publisher_that_connects_to_a_bound_sidecar(r, client):
    """vLLM given a concrete address connects its PUB to the sidecar's bound SUB (kv_events.py
    ``_is_bind_endpoint``): its restart is seen as a new accepted connection, and the batch it
    published at once is caught up from replay with nothing published after it."""
    port, rport = free_port(), free_port()
    source = VllmSource("pod-a", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", bind=True,
                        replay_timeout_s=1.0)
    sc = vllm_sidecar(r, source)
    pub = RealPublisher(V, f"tcp://localhost:{port}", rport)  # no '*' or '::': vLLM connects
    try:
        pub.send({"stored": {"token_ids": A, "block_size": 16}})
        want = {"pod-a": ("GPU", 32, {"GPU": 32})}
        assert wait_for(lambda: layout(client, A, "locations"), want) == want
        assert pub.close() == 0
        pub = RealPublisher(V, f"tcp://localhost:{port}", rport)  # seq back to 0
        start = time.monotonic()
        pub.send({"stored": {"token_ids": B, "block_size": 16}})  # right away, then quiet
        want = ({}, {"pod-a": ("GPU", 16, {"GPU": 16})})
        both = lambda: (layout(client, A, "locations"), layout(client, B, "locations"))  # noqa: E731
        assert wait_for(both, want, timeout=3.0) == want
        assert time.monotonic() - start < 3.0
        ing = sc.ingest("pod-a")
        assert (ing.ranks[0].last, dict(ing.resyncs)) == (0, {"engine_restart": 1})
    finally:
        sc.close()
        pub.close()


def test_sparse_sliding_window_and_mamba_stores(pod, client):
    """vLLM 0.33 caches a sliding-window or Mamba group sparsely (Mamba's align mode keeps the
    last state of a step; sparse retention masks blocks): its BlockStored lists only the kept
    blocks' hashes while token_ids cover the whole range (v1/core/block_pool.py:277-317). One
    step of a 100-token prompt, groups cached in index order (the sliding-window group's store
    comes before full attention's), then a 132-token prompt continuing it after the
    sliding-window group lost block 5 (the parent of its next store)."""
    def step(tokens: list[int], start: int, end: int, keep: dict[int, list[int]]) -> list[dict]:
        rows = []
        for g, kind in ((0, SW), (1, FULL), (2, MAMBA)):
            spec = {"token_ids": tokens[16 * start:16 * end], "prefix_token_ids": tokens[:16 * start],
                    "block_size": 16, "group_idx": g, **kind}
            if g in keep:
                spec["keep_blocks"] = keep[g]
            spec["extra_keys"] = [None] * len(keep.get(g, range(end - start)))
            rows.append({"stored": spec})
        return rows

    pod.pub.send({"batch": step(T, 0, 6, {0: [4, 5], 2: [5]})})  # SW keeps its window's tail, Mamba its last state
    ing = pod.ingest()
    assert wait_for(lambda: ing.ranks[0].last, 0) == 0
    got = detail(client, T)["pod-a"]
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (96, 96)
    pod.pub.send({"removed": {"token_ids": T[80:96], "prefix_token_ids": T[:80], "block_size": 16, "group_idx": 0}})
    t2 = T[:96] + list(range(9000, 9036))  # 132 tokens: 8 full blocks
    pod.pub.send({"batch": step(t2, 6, 8, {2: [1]})})  # SW dense (parent: its evicted block 5), Mamba block 7
    assert wait_for(lambda: ing.ranks[0].last, 2) == 2
    got = detail(client, t2)["pod-a"]
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (128, 128)
    got = detail(client, T)["pod-a"]  # SW lost block 5: its window of 2 blocks ending at 96 is gone
    assert (got["matched_prefix_length"], got["reusable_prefix_length"]) == (96, 0)
    assert (dict(ing.rejected), dict(ing.skipped)) == ({}, {})
