"""Feed a controller the fleet's traffic as LMCache 0.5.6 workers send it, byte for byte.

Each instance registers over DEALER (RegisterMsg -> RegisterRetMsg) and then PUSHes
multipart messages of up to 50 ``BatchedKVOperationMsg`` frames, each with up to 50
operations of one location (LMCache's ``kv_msg_batch_size`` 50) and a per-location
``seq_num``, encoded by kvlookup.wire.lmcache (checked byte-exact against LMCache's own
classes, see docs). The same pre-encoded messages go to every controller.

Completion: every instance's stream ends with an admit of its own *sentinel* chunk (the first
256 tokens of a synthetic block); the instance's messages are ordered, so once a lookup of the
sentinel prompt names the instance, everything before it was applied.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from kvlookup.bench.workload import CHUNK, CPU, Op, synthetic_block
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.wire import lmcache as proto

OPS_PER_MSG = 50
FRAMES_PER_SEND = 50


@dataclass
class Encoded:
    """One instance's pre-encoded traffic."""

    instance_id: str
    port: int
    messages: list[list[bytes]]
    n_ops: int
    sentinel_tokens: list[int]


def sentinel_tokens(i: int) -> list[int]:
    """The 256-token prompt whose single chunk instance ``i`` admits last."""
    return list(synthetic_block(900_000 + i)[:CHUNK])


def encode_stream(instance_id: str, index: int, ops: Sequence[Op], port: int) -> Encoded:
    """Group ops into 50-op BatchedKVOperationMsg frames (one location each, per-location
    seq_num) and 50-frame multipart messages; appends the sentinel admit."""
    sent = sentinel_tokens(index)
    all_ops = [(o.location, o.op, o.key) for o in ops]
    all_ops.append((CPU, "admit", HashProfile().chunk_hashes(sent)[0]))
    seq: dict[str, int] = {}
    frames: list[bytes] = []
    i = 0
    while i < len(all_ops):
        loc = all_ops[i][0]
        events = []
        while i < len(all_ops) and all_ops[i][0] == loc and len(events) < OPS_PER_MSG:
            s = seq.get(loc, 0)
            seq[loc] = s + 1
            events.append(proto.OpEvent(all_ops[i][1], all_ops[i][2], s))
            i += 1
        frames.append(proto.encode(proto.BatchedKVOperationMsg(instance_id, 0, loc, events)))
    messages = [frames[j:j + FRAMES_PER_SEND] for j in range(0, len(frames), FRAMES_PER_SEND)]
    return Encoded(instance_id, port, messages, len(all_ops), sent)


def register_and_push(streams: Sequence[Encoded], pull: str, reply: str,
                      progress: Callable[[int], None] | None = None) -> list[WorkerSim]:
    """Register every instance, then push every stream, interleaving instances message by
    message. Returns the workers (caller closes them after completion)."""
    ctx = zmq.Context.instance()
    workers = []
    for enc in streams:
        w = WorkerSim(enc.instance_id, 0, era="0.5", pull_url=pull, reply_url=reply, port=enc.port, ctx=ctx)
        w.push.setsockopt(zmq.SNDHWM, 100_000)
        reply_msg = w.register()
        if reply_msg.get("type") != "RegisterRetMsg":
            raise RuntimeError(f"registration of {enc.instance_id} answered {reply_msg}")
        workers.append(w)
    longest = max(len(e.messages) for e in streams)
    for j in range(longest):
        for w, enc in zip(workers, streams, strict=True):
            if j < len(enc.messages):
                w.push.send_multipart(enc.messages[j], copy=False)
                if progress:
                    progress(sum(len(f) for f in enc.messages[j]))
    return workers


def post_lookup(url: str, tokens: list[int], timeout: float = 30) -> dict:
    """POST /lookup; returns the layout_info dict."""
    req = urllib.request.Request(url + "/lookup", data=json.dumps({"tokens": tokens}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())["layout_info"]


def wait_sentinels(url: str, streams: Sequence[Encoded], timeout: float = 600) -> float:
    """Poll /lookup until every instance's sentinel is visible; returns the wait (s).

    Raises TimeoutError naming the instances still missing."""
    start = time.monotonic()
    missing = list(streams)
    while missing:
        missing = [e for e in missing if e.instance_id not in post_lookup(url, e.sentinel_tokens)]
        if not missing:
            break
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"sentinels of {[e.instance_id for e in missing]} not visible at {url}")
        time.sleep(0.05)
    return time.monotonic() - start
