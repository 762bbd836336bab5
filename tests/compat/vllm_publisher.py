"""vLLM's real KV-event publisher, on demand (runs in .venv-vllm; no GPU, no vLLM install).

    .venv-vllm/bin/python tests/compat/vllm_publisher.py serve --vllm-src .vllmsrc/x/vllm-0.33.0 \\
        --endpoint tcp://127.0.0.1:P [--replay-endpoint tcp://127.0.0.1:R] [--topic T] \\
        [--dp-rank N] [--int-hashes 1|0] [--buffer-steps N]
    .venv-vllm/bin/python tests/compat/vllm_publisher.py golden --vllm-src ... --out DIR [--int-hashes 0]

``serve`` builds vLLM's own ``ZmqEventPublisher`` through ``EventPublisherFactory.create
(KVEventsConfig(...))`` as the engine does, prints ``{"ready": true, "vllm_version": ...,
"config": ...}`` once bound (``config``: the publisher's resolved KVEventsConfig on 0.33+, what
``/kv_event_sources`` serves; ``tcp://*:0`` binds ``VLLM_HOST_IP``), then publishes one
``KVEventBatch`` per stdin line and answers ``{"published": seq, "batch": {...}}`` after vLLM's
publisher thread sent it (``{"error": ...}`` for a bad line; ``{"quit": true}`` or EOF stops it,
through vLLM's ``shutdown()``). Block hashes are vLLM's own (``hash_block_tokens`` with
``get_hash_fn_by_name("sha256")``, ``init_none_hash`` under PYTHONHASHSEED=0,
``maybe_convert_block_hash``); in the answer they are ints, or "hex:..." strings with
``--int-hashes 0`` (bytes hashes).

Lines (one batch each):
  {"stored": {"token_ids": [...], "block_size": 16, "prefix_token_ids"?: [...],
              "hash_token_ids"?: [...], "block_hashes"?: [int | "hex:.." | "0x.."], "medium"?: "GPU",
              "keep_blocks"?: [i, ...] (only these blocks' hashes: a sparse sliding-window/Mamba store),
              "lora_id"?, "lora_name"?, other fields of the version's BlockStored}}
  {"removed": {"token_ids": [...], "block_size": 16, "prefix_token_ids"?} | {"block_hashes": [...]}}
  {"cleared": {}}          {"batch": [{"stored": {...}}, {"cleared": {}}, ...]}

Bind or connect: vLLM binds when the endpoint holds ``*`` or ``::`` (or is ipc/inproc) and
connects otherwise, so ``tcp://127.0.0.1:P`` is passed as ``tcp://[::ffff:127.0.0.1]:P``: vLLM
binds, libzmq binds 127.0.0.1 only. ``--dp-rank N`` adds N to both ports (vLLM's own offset).

``golden`` writes ``vllm-<v>[-byteshash]-batch.msgpack`` (vLLM's encoder on a BlockStored of
tokens 1000..1031 in two 16-token blocks, a BlockRemoved of the second block, an
AllBlocksCleared; ts 1700000000.5, rank 0) and a ``.json`` with what it holds; tests/fixtures/vllm
was written this way and test_vllm_real_publisher.py checks it is reproduced byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_tree import load  # noqa: E402  (this folder, not an installed package)

GOLDEN_TOKENS = list(range(1000, 1032))
GOLDEN_TS = 1700000000.5


def jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return "hex:" + bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def literal_hash(value):
    """A hash written in a line: int, "0x.." (int) or "hex:.." (bytes)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, str) and value.startswith("hex:"):
        return bytes.fromhex(value[4:])
    if isinstance(value, str) and value.startswith("0x"):
        return int(value, 16)
    raise ValueError(f"bad hash {value!r}: an int, '0x..' or 'hex:..'")


class Events:
    """Builds vLLM's own event structs from lines, hashing tokens with vLLM's own functions."""

    def __init__(self, vllm, algo: str = "sha256"):
        self.v = vllm
        self.hash_fn = vllm.hashing.get_hash_fn_by_name(algo)
        vllm.kv_cache_utils.init_none_hash(self.hash_fn)  # what EngineCore does at start-up

    def chain(self, tokens: list[int], block_size: int) -> tuple[list, list]:
        """(raw, external) hashes of every full block of ``tokens``, chained from NONE_HASH."""
        kvu, raw, parent = self.v.kv_cache_utils, [], None
        for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
            parent = kvu.hash_block_tokens(self.hash_fn, parent, tokens[start:start + block_size])
            raw.append(parent)
        return raw, [kvu.maybe_convert_block_hash(h) for h in raw]

    def stored(self, spec: dict):
        spec = {"parent_block_hash": None, "lora_id": None, "medium": "GPU", "lora_name": None, **spec}
        prefix = spec.pop("prefix_token_ids", None) or []
        hashed = spec.pop("hash_token_ids", None)
        keep = spec.pop("keep_blocks", None)
        if spec.get("block_hashes") is None:
            size = int(spec["block_size"])
            _, ext = self.chain(list(prefix) + list(spec["token_ids"] if hashed is None else hashed), size)
            spec["block_hashes"] = ext[len(prefix) // size:]
            if prefix:
                spec["parent_block_hash"] = ext[len(prefix) // size - 1]
            if keep is not None:  # null/masked blocks skipped, token_ids kept whole (block_pool.py:277-317)
                spec["block_hashes"] = [spec["block_hashes"][i] for i in keep]
        else:
            spec["block_hashes"] = [literal_hash(h) for h in spec["block_hashes"]]
            spec["parent_block_hash"] = literal_hash(spec["parent_block_hash"])
        return self._struct(self.v.kv_events.BlockStored, spec)

    def removed(self, spec: dict):
        spec = {"medium": "GPU", **spec}
        if spec.get("block_hashes") is None:
            prefix = spec.pop("prefix_token_ids", None) or []
            size = int(spec.pop("block_size"))
            _, ext = self.chain(list(prefix) + list(spec.pop("token_ids")), size)
            spec["block_hashes"] = ext[len(prefix) // size:]
        else:
            spec["block_hashes"] = [literal_hash(h) for h in spec["block_hashes"]]
        return self._struct(self.v.kv_events.BlockRemoved, spec)

    def _struct(self, cls, spec: dict):
        fields = set(cls.__struct_fields__)
        spec = {k: v for k, v in spec.items() if k in fields or v is not None}  # lora_name: null on 0.10
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise ValueError(f"vLLM {self.v.version} {cls.__name__} has no field {unknown}: {cls.__struct_fields__}")
        return cls(**spec)

    def of(self, line: dict) -> list:
        items = line["batch"] if "batch" in line else [{k: v} for k, v in line.items() if k != "ts"]
        events = []
        for item in items:
            ((kind, spec),) = item.items()
            if kind == "cleared":
                events.append(self.v.kv_events.AllBlocksCleared())
            elif kind in ("stored", "removed"):
                events.append(getattr(self, kind)(spec))
            else:
                raise ValueError(f"unknown event {kind!r}: stored, removed, cleared or batch")
        return events


def batch_json(batch) -> dict:
    import msgspec

    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [{"type": type(e).__name__, **jsonable(msgspec.structs.asdict(e))} for e in batch.events]}


def bind_on_loopback(endpoint: str) -> str:
    """tcp://127.0.0.1:P -> tcp://[::ffff:127.0.0.1]:P, so vLLM's own code binds (see above)."""
    m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", endpoint)
    return f"tcp://[::ffff:127.0.0.1]:{m.group(1)}" if m else endpoint


def publisher(v, args):
    config = v.kv_events_config.KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=bind_on_loopback(args.endpoint),
        replay_endpoint=args.replay_endpoint, buffer_steps=args.buffer_steps, hwm=100_000,
        max_queue_size=100_000, topic=args.topic)
    pub = v.kv_events.EventPublisherFactory.create(config, data_parallel_rank=args.dp_rank)
    if not isinstance(pub, v.kv_events.ZmqEventPublisher):
        raise RuntimeError(f"vLLM's factory made a {type(pub).__name__}")
    return pub


def sent(pub, timeout: float = 5.0) -> bool:
    """True once vLLM's publisher thread has taken every queued batch off its queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pub._event_queue.unfinished_tasks == 0:
            return True
        time.sleep(0.01)
    return False


def shutdown(pub) -> None:
    import zmq

    pub.shutdown()  # vLLM's own: stops its thread, closes its sockets
    term = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    term.start()
    term.join(3)
    if term.is_alive():  # a socket left open: never hang the test that waits for us
        print("vllm_publisher: zmq context did not terminate", file=sys.stderr, flush=True)
        os._exit(1)


def resolved_config(pub) -> dict | None:
    """vLLM 0.33+: the publisher's resolved KVEventsConfig (what the engine hands the API server at
    its handshake and ``GET /kv_event_sources`` serves: ports offset by the rank, ``tcp://*:0``
    resolved to the node IP and port it bound), as JSON; None before 0.33."""
    import dataclasses

    get = getattr(pub, "get_publisher_config", None)
    config = get() if get is not None else None
    return dataclasses.asdict(config) if config is not None else None


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def setup(args):
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = str(args.int_hashes)
    os.environ["PYTHONHASHSEED"] = "0"  # init_none_hash reads it: the same hashes in every version
    v = load(args.vllm_src)
    return v, Events(v)


def serve(args) -> int:
    v, events = setup(args)
    pub = publisher(v, args)
    say({"ready": True, "vllm_version": v.version, "standins": v.standins, "config": resolved_config(pub)})
    seq = 0
    try:
        for raw in sys.stdin:
            if not raw.strip():
                continue
            line = json.loads(raw)
            if line.get("quit"):
                break
            try:
                batch = v.kv_events.KVEventBatch(ts=line.get("ts", time.time()), events=events.of(line),
                                                 data_parallel_rank=args.dp_rank)
            except (KeyError, TypeError, ValueError) as exc:
                say({"error": f"{type(exc).__name__}: {exc}"})
                continue
            pub.publish(batch)
            sent(pub)
            say({"published": seq, "batch": batch_json(batch)})
            seq += 1
    finally:
        shutdown(pub)
    return 0


def golden(args) -> int:
    import msgspec

    v, events = setup(args)
    ke = v.kv_events
    stored = events.stored({"token_ids": GOLDEN_TOKENS, "block_size": 16})
    removed = ke.BlockRemoved(block_hashes=[stored.block_hashes[1]], medium="GPU")
    batch = ke.KVEventBatch(ts=GOLDEN_TS, events=[stored, removed, ke.AllBlocksCleared()], data_parallel_rank=0)
    payload = msgspec.msgpack.Encoder().encode(batch)  # the call ZmqEventPublisher's thread makes
    name = f"vllm-{v.version}" + ("" if args.int_hashes else "-byteshash") + "-batch"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.msgpack").write_bytes(payload)
    meta = {"vllm_version": v.version, "int_hashes": bool(args.int_hashes), "hashing": "sha256, PYTHONHASHSEED=0",
            "event_encoding": "map" if isinstance(msgspec.msgpack.decode(payload)[1][0], dict) else "array",
            "kv_events_sha256": hashlib.sha256(Path(ke.__file__).read_bytes()).hexdigest(),
            "payload_sha256": hashlib.sha256(payload).hexdigest(), "batch": batch_json(batch),
            "standins": v.standins}
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: {len(payload)} bytes, events as {meta['event_encoding']}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="vLLM's real KV-event publisher, on demand")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "golden"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-src", required=True, help="a tree from tests/compat/fetch_vllm.py (holds vllm/)")
        p.add_argument("--int-hashes", type=int, choices=(0, 1), default=1,
                       help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (vLLM's default 1)")
    s = sub.choices["serve"]
    s.add_argument("--endpoint", required=True)
    s.add_argument("--replay-endpoint")
    s.add_argument("--topic", default="")
    s.add_argument("--dp-rank", type=int, default=0)
    s.add_argument("--buffer-steps", type=int, default=10_000)
    sub.choices["golden"].add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return serve(args) if args.cmd == "serve" else golden(args)


if __name__ == "__main__":
    sys.exit(main())
