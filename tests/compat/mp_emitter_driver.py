"""Drive LMCache's real MP cache-event emitter as a library (run with an LMCache venv's python).

The real classes do the work: ``init_event_bus`` + ``EventBus.start``, ``CacheEventSubscriber``
with ``HttpCacheEventSink`` (POST /events), ``keep_registered`` (POST /instances, heartbeats,
DELETE on cancel). Chunk hashes come from LMCache's own ``TokenHasher``. This script only
publishes storage events on the bus, one JSON command a line on stdin, and answers one JSON
line each on stdout::

    {"op": "store", "tokens": [...], "world_size": 1, "ranks": [0], "tier": "l1"|"l2",
     "backend": "dram"|"fs"|..., "shared": false, "size": 4096, "bind_tokens": true, "model": "m", "salt": ""}
    {"op": "delete" | "access", same key fields}
    {"op": "capacity", "modules": [["l1", "dram", 1073741824, false], ...]}
    {"op": "settle", "seconds": 1.5}     # ticks the bus so pending batches flush
    {"op": "quit"}                        # cancel keep_registered (DELETE), stop the bus

Arguments: --url, --instance-id, --incarnation, --http-port, --heartbeat, --flush, --chunk-size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
from lmcache.v1.distributed.api import CapacitySnapshot, L1BackendType, ModuleMemoryCapacity, ObjectKey, Tier
from lmcache.v1.distributed.internal_api import L1ObjectMeta
from lmcache.v1.mp_coordinator.cache_events import CacheEventSubscriber, HttpCacheEventSink
from lmcache.v1.mp_coordinator.registrar import keep_registered
from lmcache.v1.mp_observability.event import Event, EventType
from lmcache.v1.mp_observability.event_bus import EventBusConfig, init_event_bus
from lmcache.v1.multiprocess.token_hasher import TokenHasher


def kv_rank(ws: int, rank: int) -> int:
    return (ws << 24) | (rank << 16) | (ws << 8) | rank


class Driver:
    def __init__(self, args):
        self.args = args
        self.hasher = TokenHasher(args.chunk_size, "blake3")
        self.bus = init_event_bus(EventBusConfig(enabled=True))
        self.sub = CacheEventSubscriber(sink=HttpCacheEventSink(args.url), instance_id=args.instance_id,
                                        incarnation=args.incarnation, flush_interval=args.flush)
        self.bus.register_subscriber(self.sub)
        self.bus.start()
        self.capacity = CapacitySnapshot(modules=(ModuleMemoryCapacity(Tier.L1, "dram", 8 << 30),))

    def keys(self, cmd):
        hashes = self.hasher.compute_chunk_hashes(cmd["tokens"])
        ws = cmd.get("world_size", 1)
        ranks = cmd.get("ranks", list(range(ws)))
        return hashes, [ObjectKey(chunk_hash=h, model_name=cmd.get("model", "test-model"), kv_rank=kv_rank(ws, r),
                                  cache_salt=cmd.get("salt", "")) for h in hashes for r in ranks]

    def publish(self, etype, **meta):
        self.bus.publish(Event(event_type=etype, metadata=meta))

    def op(self, cmd) -> dict:
        kind = cmd["op"]
        if kind == "capacity":
            self.capacity = CapacitySnapshot(modules=tuple(
                ModuleMemoryCapacity(Tier(t), b, c, shared=s) for t, b, c, s in cmd["modules"]))
            self.publish(EventType.SM_CAPACITY_CHANGED, snapshot=self.capacity)
            return {"ok": True}
        if kind == "settle":
            end = time.monotonic() + cmd.get("seconds", 1.0)
            while time.monotonic() < end:
                self.publish(EventType.L1_EVICTION_LOOP_TICK)
                time.sleep(0.1)
            return {"ok": True}
        hashes, keys = self.keys(cmd)
        tier = cmd.get("tier", "l1")
        if kind == "store" and cmd.get("bind_tokens", True):
            cs = self.args.chunk_size
            self.publish(EventType.MP_TOKENS, chunk_hashes=hashes,
                         token_chunks=[cmd["tokens"][i * cs:(i + 1) * cs] for i in range(len(hashes))],
                         token_offsets=[i * cs for i in range(len(hashes))])
        size = cmd.get("size", 4096)
        if tier == "l1":
            medium = L1BackendType(cmd.get("backend", "dram"))
            meta = [L1ObjectMeta(size_bytes=size if kind == "store" else 0, backend=medium) for _ in keys]
            etype = {"store": EventType.L1_WRITE_FINISHED, "delete": EventType.L1_KEYS_EVICTED,
                     "access": EventType.L1_KEYS_ACCESSED}[kind]
            self.publish(etype, keys=keys, meta=meta) if kind != "access" else self.publish(etype, keys=keys)
        else:
            backend, shared = cmd.get("backend", "fs"), cmd.get("shared", False)
            if kind == "store":
                self.publish(EventType.L2_KEYS_STORED, keys=keys, sizes=[size] * len(keys), backend=backend,
                             shared=shared)
            else:
                etype = EventType.L2_KEYS_DELETED if kind == "delete" else EventType.L2_KEYS_ACCESSED
                self.publish(etype, keys=keys, backend=backend, shared=shared)
        return {"ok": True, "chunk_hashes": [h.hex() for h in hashes]}


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--instance-id", required=True)
    p.add_argument("--incarnation", type=int, default=int(time.time()))
    p.add_argument("--http-port", type=int, default=19514)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--flush", type=float, default=0.2)
    p.add_argument("--chunk-size", type=int, default=256)
    args = p.parse_args()
    d = Driver(args)
    client = httpx.AsyncClient(timeout=10.0)
    task = asyncio.create_task(keep_registered(
        client, args.url, http_port=args.http_port, instance_id=args.instance_id, advertise_ip="127.0.0.1",
        heartbeat_interval=args.heartbeat,
        on_registered=lambda: d.publish(EventType.SM_CAPACITY_CHANGED, snapshot=d.capacity)))
    loop = asyncio.get_running_loop()
    print(json.dumps({"event": "ready"}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or json.loads(line)["op"] == "quit":
            break
        out = await loop.run_in_executor(None, d.op, json.loads(line))
        print(json.dumps(out), flush=True)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await client.aclose()
    d.bus.stop()
    print(json.dumps({"event": "stopped"}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
