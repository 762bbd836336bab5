"""10,000+ malformed frames into a real sidecar over real ZMQ: no crash, no hang, nothing lost after.

Bulk frames come from random.Random (fixed seed) in categories that are invalid by
construction, so each must be counted as rejected exactly once; hypothesis adds arbitrary
msgpack/JSON structure (which may happen to be valid), where every frame must be either
handled or rejected. HTTP bytes hit both ZMQ ports. Afterwards valid traffic still applies.
"""

from __future__ import annotations

import random
import socket

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.wire import lmcache as proto
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import SidecarThread, wait_for

DECODE_REASONS = ("undecodable", "not_a_map", "unknown_type", "invalid_fields", "invalid_key")
BULK_FRAMES = 10_000


def _rejected(reasons=DECODE_REASONS) -> float:
    return sum(
        REGISTRY.get_sample_value("kvlookup_rejected_frames_total", {"source": "lmcache", "reason": r}) or 0
        for r in reasons
    )


def _handled() -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "kvlookup_messages":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def _valid_maps(rng: random.Random) -> dict:
    ops = [{"op_type": "admit", "key": rng.getrandbits(63), "seq_num": i} for i in range(rng.randint(1, 3))]
    return rng.choice(
        [
            {
                "type": "KVAdmitMsg",
                "instance_id": "f",
                "worker_id": 0,
                "key": rng.getrandbits(63),
                "location": "L",
            },
            {
                "type": "BatchedKVOperationMsg",
                "instance_id": "f",
                "worker_id": 0,
                "location": "L",
                "operations": ops,
            },
            {
                "type": "RegisterMsg",
                "instance_id": "f",
                "worker_id": 0,
                "ip": "1.2.3.4",
                "port": 1,
                "peer_init_url": None,
            },
            {
                "type": "FullSyncBatchMsg",
                "instance_id": "f",
                "worker_id": 0,
                "location": "L",
                "sync_id": "s",
                "batch_id": 0,
                "keys": [1, 2],
            },
        ]
    )


_WRONG = {
    "instance_id": [5, None, "", "x" * 300, ["a"]],
    "worker_id": ["0", -1, 2**40, 1.5, None],
    "location": [7, "", None, {"a": 1}],
    "key": [1.5, "not-hex", None, [1], 2**64 + 5, -(2**63) - 1],
    "operations": ["x", [{"op_type": "boom", "key": 1}], [1, 2], None],
    "keys": ["abc", [1.5], [None], [2**64 + 1]],
}


def bad_frame(rng: random.Random) -> bytes:
    """One frame that no LMCache message decodes from."""
    kind = rng.randrange(7)
    if kind == 0:  # truncated msgpack of a real message
        full = msgspec.msgpack.encode(_valid_maps(rng))
        return full[: rng.randrange(len(full))]
    if kind == 1:  # wrong field types (JSON so huge ints can travel too)
        m = _valid_maps(rng)
        field = rng.choice([f for f in _WRONG if f in m])
        m[field] = rng.choice(_WRONG[field])
        enc = (
            msgspec.json.encode if rng.random() < 0.5 or field in ("key", "keys") else msgspec.msgpack.encode
        )
        return enc(m)
    if kind == 2:  # unknown or missing tag
        m = _valid_maps(rng)
        m["type"] = rng.choice(["Nope", "", 5, None, "ClearWorkerMsg", "kvadmitmsg"])
        if rng.random() < 0.2:
            del m["type"]
        return msgspec.msgpack.encode(m)
    if kind == 3:  # HTTP bytes
        return rng.choice(
            [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b'POST /lookup HTTP/1.1\r\n\r\n{"tokens":[1]}']
        )
    if kind == 4:  # not a map
        return msgspec.msgpack.encode(rng.choice([[1, 2], "str", 5, None, 2**64 - 1, b"bin"]))
    if kind == 5:  # random bytes with a trailing byte that breaks any complete value
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 40))) + b"\xc1"
    return b"{" + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 30)))  # broken JSON


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
)
TAGS = st.sampled_from(sorted(proto.DECODE_TARGETS) + ["Bogus"])
FIELDS = st.sampled_from(
    [
        "instance_id",
        "worker_id",
        "location",
        "key",
        "operations",
        "keys",
        "sync_id",
        "ip",
        "port",
        "batch_id",
        "hashes",
    ]
)
structured = st.builds(
    lambda tag, extra: {"type": tag, **extra}, TAGS, st.dictionaries(FIELDS, values, max_size=6)
)
frames = st.lists(
    st.one_of(
        structured.map(msgspec.msgpack.encode), structured.map(msgspec.json.encode), st.binary(max_size=64)
    ),
    min_size=1,
    max_size=20,
)


def _http_garbage(addr: str) -> None:
    host, port = addr.rsplit(":", 1)
    for payload in (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, b"\xff" * 300):
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(payload)


def test_ten_thousand_bad_frames_then_valid_traffic(r):
    store = Store(r)
    client = Client(store=store)
    ctx = zmq.Context.instance()
    with SidecarThread(store) as sc:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect("tcp://" + sc.pull_url)
        _http_garbage(sc.pull_url)
        _http_garbage(sc.reply_url)
        rng = random.Random(20261129)
        before = _rejected()
        bulk = [bad_frame(rng) for _ in range(BULK_FRAMES)]
        for i in range(0, len(bulk), 50):
            push.send_multipart(bulk[i : i + 50])
        # the same on the request channel: every bad request gets an ErrorMsg back
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect("tcp://" + sc.reply_url)
        for frame in bulk[:300]:
            dealer.send_multipart([b"", frame])
            assert msgspec.msgpack.decode(dealer.recv_multipart()[-1])["type"] == "ErrorMsg"
        w = WorkerSim("sentinel", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        w.register()
        w.admit([SEED_HASH])
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"sentinel": ("LocalCPUBackend", 12)}) == {
            "sentinel": ("LocalCPUBackend", 12)
        }
        assert _rejected() - before == BULK_FRAMES + 300

        sent = {"frames": 0}

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(frames)
        def fuzz(batch):
            push.send_multipart(batch)
            sent["frames"] += len(batch)

        before_rejected, before_handled = _rejected(), _handled()
        fuzz()
        w.admit([SEED_HASH + 1])  # a marker after the fuzz: once it lands, every fuzz frame was read
        w2 = WorkerSim("sentinel2", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        w2.register()
        w2.admit([SEED_HASH])
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1].get("sentinel2"), ("LocalCPUBackend", 12)) == (
            "LocalCPUBackend",
            12,
        )
        w.admit([SEED_HASH])
        assert wait_for(lambda: r.zcard(keys.chunk_key(SEED_HASH + 1)), 1) == 1
        accounted = (_rejected() - before_rejected) + (_handled() - before_handled)
        assert accounted >= sent["frames"] >= 150
        assert sc.thread.is_alive()
        for s in (push, dealer):
            s.close()
        w.close()
        w2.close()
