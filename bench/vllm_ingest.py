"""``kvlookup bench vllm-ingest``: vLLM ``BlockStored`` blocks per second one sidecar applies.

In process, no sockets: a :class:`kvlookup.sidecar.vllm_ingest.VllmIngest` on a Redis of its own
is handed live messages (``[topic, seq, payload]``, msgpack batches in vLLM's array form) as
its SUB socket would hand them over. Two shapes, both chains of 16-token blocks continuing
earlier ones (every store names its parent, as vLLM does) with 10% of the stored blocks
removed again later:

- ``prefill``: 32 blocks per BlockStored, 4 stores per batch (prompts being prefilled);
- ``decode``: 1 block per BlockStored, 16 stores per batch (sequences growing token by token);
- ``decode-map``: the same with each event a map under ``"type"`` (vLLM 0.25+'s encoding; the
  two above use the positional form of vLLM <= 0.25, which the others relay too).

Each shape is delivered one message per call (``handle_live``: the sidecar keeps up) and in
groups of 8 and 32 (``handle_live_many``: what the sidecar's SUB handler reads at once when it
is behind, up to ``sidecar.vllm_zmq.MAX_BATCHES_PER_READ`` = 32; consecutive batches are
written as one). Writes are left in flight while the next call decodes (``vllm_overlap_writes``,
the sidecar's default: sidecar.vllm_writer) unless ``run(overlap=False)``; the last one is waited
for before the clock stops, and the CPU columns count the writer's thread too.

Reported: blocks/s (wall), the ingesting process's CPU per block (``time.process_time``) and
Redis's: ``redis_cpu_us_per_block`` from ``INFO commandstats`` usec (every command: a script's
own ``redis.call``s are counted again beside its ``EVALSHA``, and a descheduled command's wait is
in it) and ``redis_proc_cpu_us_per_block`` from ``INFO cpu`` (the server process's CPU, this
Redis serves nothing else), per shape and delivery.
"""

from __future__ import annotations

import inspect
import random
import time

import msgspec

from kvlookup.bench.holders import redis_cpu_s, redis_usec
from kvlookup.bench.procs import Procs
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect
from kvlookup.sidecar.vllm_ingest import VllmIngest

SHAPES = {"prefill": (32, 4), "decode": (1, 16), "decode-map": (1, 16)}
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
BLOCK = 16


def batches(shape: str, n_blocks: int, seed: int = 1) -> list[bytes]:
    """Payloads storing about ``n_blocks`` blocks in chains (see the module docstring)."""
    per_store, per_batch = SHAPES[shape]
    as_map = shape.endswith("-map")
    rng = random.Random(seed)
    next_hash = 1
    tips: list[int] = []  # chain ends a store may continue
    stored: list[int] = []
    out, done = [], 0
    while done < n_blocks:
        events = []
        for _ in range(per_batch):
            parent = rng.choice(tips) if tips and rng.random() < 0.9 else None
            hashes = list(range(next_hash, next_hash + per_store))
            next_hash += per_store
            tokens = [rng.randrange(32_000) for _ in range(per_store * BLOCK)]
            events.append(["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"])
            if parent in tips:
                tips.remove(parent)
            tips.append(hashes[-1])
            tips = tips[-64:]
            stored += hashes
            done += per_store
        if len(stored) > 2000 and rng.random() < 0.1:  # evict some old blocks
            gone, stored = stored[:200], stored[200:]
            tips = [t for t in tips if t not in set(gone)]
            events.append(["BlockRemoved", gone, "GPU"])
        if as_map:
            events = [{"type": e[0], **dict(zip(STORED_FIELDS if e[0] == "BlockStored" else ("block_hashes", "medium"),
                                                e[1:], strict=True))} for e in events]
        out.append(msgspec.msgpack.encode([1_700_000_000.5 + len(out), events, 0]))
    return out


def run(blocks: int = 100_000, groups: tuple[int, ...] = (1, 8, 32), overlap: bool = True) -> dict:
    """Blocks/s and CPU per block per ``shape/group`` (see the module docstring). overlap: the
    ``vllm_overlap_writes`` setting (ignored by checkouts without it)."""
    out: dict = {"blocks_per_shape": blocks, "shapes": {}}
    kw = {"overlap": overlap} if "overlap" in inspect.signature(VllmIngest).parameters else {}
    with Procs() as procs:
        url = procs.start_redis()
        r = connect(url)
        for shape, group in [(s, g) for s in SHAPES for g in groups]:
            payloads = batches(shape, blocks)
            ingest = VllmIngest(Store(connect(url), instance_ttl_s=0), f"bench-{shape}-{group}", **kw)
            msgs = [[b"kv@bench", seq.to_bytes(8, "big"), p] for seq, p in enumerate(payloads)]
            u0, p0, c0, t0 = redis_usec(r), redis_cpu_s(r), time.process_time(), time.perf_counter()
            many = getattr(ingest, "handle_live_many", None)  # older checkouts: one message a call
            for i in range(0, len(msgs), group):
                if many is not None:
                    many(0, msgs[i:i + group])
                else:
                    for msg in msgs[i:i + group]:
                        ingest.handle_live(0, msg)
            if hasattr(ingest, "settle"):
                ingest.settle()  # the last write, left in flight
            wall, cpu, busy = time.perf_counter() - t0, time.process_time() - c0, redis_usec(r) - u0
            proc = redis_cpu_s(r) - p0
            rejected = dict(ingest.rejected)
            out["shapes"][f"{shape}/{group}"] = {"blocks": blocks, "batches": len(payloads), "seconds": round(wall, 3),
                                    "blocks_per_s": round(blocks / wall),
                                    "sidecar_cpu_us_per_block": round(cpu * 1e6 / blocks, 2),
                                    "redis_cpu_us_per_block": round(busy / blocks, 2),
                                    "redis_proc_cpu_us_per_block": round(proc * 1e6 / blocks, 2), "rejected": rejected}
            if hasattr(ingest, "close"):
                ingest.close()
        r.close()
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000), indent=1))
