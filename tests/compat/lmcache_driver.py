"""Drive the real LMCache engine and worker on a CPU, one op at a time (runs in .venv-lmcache).

    .venv-lmcache/bin/python tests/compat/lmcache_driver.py --pull-url H:P --reply-url H:P \\
        --instance-id ID [--worker-ports P[,P...]] [--tp N] [--chunk-size 256] [--cpu-chunks 8] \\
        [--heartbeat-s S] [--ops FILE|-]

What is real: LMCache's own ``LMCacheEngine`` per TP rank (store/lookup/clear), its
``ChunkedTokenDatabase`` (the chunk hashes), ``StorageManager`` + ``LocalCPUBackend`` (the LRU
pool; ``--cpu-chunks`` sizes it in full chunks so overflows evict for real),
``BatchedMessageSender`` (seq_num per location) and ``LMCacheWorker`` (DEALER registration,
PUSH of ``BatchedKVOperationMsg``, REP socket for /health and /clear, heartbeats, full sync).
The GPU connector is LMCache's ``MockGPUConnector`` (``EngineType.MOCK``): KV bytes are never
copied. The model is a fake 2-layer, 1-head, head-size-16 fp16 shape (32 KiB per 256-token
chunk). Built the way ``lmcache.v1.standalone`` builds an engine without a GPU. Works on LMCache
0.5.6 and 0.5.7 (0.5.7 moved the in-process stack under ``lmcache.inprocess``; same wire).

Changed around the worker (each wraps one attribute, the original still runs):
  * the advertised IP is 127.0.0.1 and the REP socket binds 127.0.0.1 (stock: the primary
    interface's address, bind ``*``) -- loopback only;
  * registration replies are observed, so ``ready`` says which ranks registered (rc 3 if not);
  * heartbeats can be paused: at exit they stop before ``DeRegisterMsg``, because a heartbeat
    landing after it makes the controller register the worker again.

Exit: flush the senders, pause heartbeats, ``LMCacheWorker.deregister()``, wait until the
worker's queue reached the socket, then ``LMCacheEngine.close()``. Stock ``close()`` alone
loses ``DeRegisterMsg`` about half the time (docs/lmcache-protocol.md, "Known LMCache bugs").

Protocol: ops are JSON lines (from ``--ops`` or stdin); each answers one JSON line on stdout
once its messages were handed to the PUSH socket. First line ``{"event":"ready",...}``, last
``{"event":"exit","rc":N}``. Ops (every op takes ``"ranks":[...]`` to act on some ranks):
  store {tokens, skip_cached?}  evict {tokens, locations?}  clear {locations?}
  lookup {tokens, pin?}  hashes {tokens}  keys {}  sleep {s}  touch {path}
  wait_for_file {path, timeout_s?}
Exit codes: 0 ok, 1 an op failed (later ops still run), 3 registration not answered,
130 SIGTERM/SIGINT. LMCache's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # before lmcache is imported: no
os.environ.setdefault("DO_NOT_TRACK", "1")             # ~/.config/lmcache/machine_id
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import asyncio  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from importlib import import_module  # noqa: E402

import torch  # noqa: E402


def _lmcache(path: str):
    """``lmcache.<path>`` on 0.5.6, ``lmcache.inprocess.<path>`` on 0.5.7."""
    try:
        return import_module(f"lmcache.{path}")
    except ImportError:
        return import_module(f"lmcache.inprocess.{path}")


worker_mod = _lmcache("v1.cache_controller.worker")
message = _lmcache("v1.cache_controller.message")
LMCacheEngine = _lmcache("v1.cache_engine").LMCacheEngine
ChunkedTokenDatabase = _lmcache("v1.token_database").ChunkedTokenDatabase
CreateGPUConnector = _lmcache("v1.gpu_connector").CreateGPUConnector
from lmcache.integration.vllm.utils import get_size_bytes  # noqa: E402
from lmcache.utils import EngineType, mock_up_broadcast_fn, mock_up_broadcast_object_fn  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

KV_LAYERS, KV_HEADS, HEAD_SIZE, KV_DTYPE = 2, 1, 16, torch.float16


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Registrations:
    """Which (instance, worker) pairs got their RegisterRetMsg; wraps the worker class once."""

    def __init__(self) -> None:
        self.done: set[tuple[str, int]] = set()
        self.cv = threading.Condition()
        cls = worker_mod.LMCacheWorker
        original = cls._process_register_response

        def observed(worker, ret_msg):
            original(worker, ret_msg)
            with self.cv:
                self.done.add((worker.lmcache_instance_id, worker.worker_id))
                self.cv.notify_all()

        cls._process_register_response = observed

    def wait(self, want: set[tuple[str, int]], timeout: float) -> list[int]:
        """Ranks of ``want`` registered within ``timeout`` seconds."""
        with self.cv:
            self.cv.wait_for(lambda: want <= self.done, timeout)
            return sorted(rank for inst, rank in want & self.done)


def loopback_only() -> None:
    """Advertise 127.0.0.1 and bind the REP socket there instead of every interface."""
    worker_mod.get_ip = lambda: "127.0.0.1"
    original = worker_mod.get_zmq_socket

    def get_zmq_socket(context, path, protocol, role, bind_or_connect):
        if bind_or_connect == "bind" and path.startswith("*:"):
            path = "127.0.0.1:" + path[2:]
        return original(context, path, protocol, role, bind_or_connect)

    worker_mod.get_zmq_socket = get_zmq_socket


def pausable_heartbeats() -> None:
    """A worker with ``heartbeats_paused`` set answers its own heartbeat instead of sending it."""
    cls = worker_mod.LMCacheWorker
    original = cls._send_heartbeat_msg

    async def send(worker, msg):
        if getattr(worker, "heartbeats_paused", False):
            return message.HeartbeatRetMsg()
        return await original(worker, msg)

    cls._send_heartbeat_msg = send


def engine_config(args) -> tuple[LMCacheEngineConfig, int]:
    """The engine's config and the bytes of one full chunk."""
    shape = torch.Size([2, KV_LAYERS, args.chunk_size, KV_HEADS * HEAD_SIZE])
    chunk_bytes = get_size_bytes([shape], [KV_DTYPE])
    extra = {}
    if args.heartbeat_s:
        extra = {"lmcache_worker_heartbeat_time": args.heartbeat_s, "lmcache_worker_heartbeat_delay_time": 1}
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=args.chunk_size, local_cpu=True,
        max_local_cpu_size=(args.cpu_chunks * chunk_bytes + 0.5) / 1024**3,  # +0.5 B: LMCache's int() rounds down
        save_unfull_chunk=True, enable_controller=True, lmcache_instance_id=args.instance_id,
        controller_pull_url=args.pull_url.removeprefix("tcp://"),
        controller_reply_url=args.reply_url.removeprefix("tcp://"),
        lmcache_worker_ports=args.ports, py_enable_gc=True, **extra)
    config.validate()
    return config, chunk_bytes


class Rank:
    """One TP rank: a real LMCacheEngine with its LMCacheWorker."""

    def __init__(self, args, config, rank: int):
        self.rank, self.chunk_size = rank, args.chunk_size
        metadata = LMCacheMetadata(
            model_name="kvlookup-compat", world_size=args.tp, local_world_size=args.tp, worker_id=rank,
            local_worker_id=rank, kv_dtype=KV_DTYPE, kv_shape=(KV_LAYERS, 2, args.chunk_size, KV_HEADS, HEAD_SIZE),
            use_mla=False, role="worker", chunk_size=args.chunk_size)
        self.engine = LMCacheEngine(config, metadata, ChunkedTokenDatabase(config, metadata),
                                    CreateGPUConnector(config, metadata, EngineType.MOCK),
                                    mock_up_broadcast_fn, mock_up_broadcast_object_fn)
        self.worker = self.engine.lmcache_worker
        if self.worker is None:
            raise RuntimeError(f"rank {rank}: LMCache made no LMCacheWorker (enable_controller?)")
        self.engine.post_init()
        self.registered = False

    def backends(self) -> dict:
        manager = self.engine.storage_manager
        return dict(manager.storage_backends) if manager is not None else {}

    def chunks(self, tokens: list[int]) -> list[dict]:
        return [{"start": s, "end": e, "hash": h}
                for s, e, h in self.engine.token_database.process_tokens(tokens=tokens, make_key=False)]

    def keys(self) -> dict[str, list[int]]:
        out = {}
        for name, backend in self.backends().items():
            held = backend.get_keys() if hasattr(backend, "get_keys") else list(getattr(backend, "dict", {}))
            out[name] = [key.chunk_hash for key in held]
        return out

    def flush(self) -> None:
        """Hand every batched admit/evict to the worker's queue, then wait until it is on the socket."""
        for backend in self.backends().values():
            sender = getattr(backend, "batched_msg_sender", None)
            if sender is not None:
                sender.flush()
        self.drain()

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until the worker's asyncio loop has emptied its queue (its push loop runs only
        after registration was answered)."""
        if not self.registered:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.worker.loop.is_running():
            try:
                for _ in range(2):  # two turns of the loop: the push step ran after the last get
                    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.worker.loop).result(1.0)
            except Exception:  # noqa: BLE001  (the loop stopped)
                return
            if self.worker.msg_queue.qsize() == 0:
                return
            time.sleep(0.01)


def _tokens(op: dict) -> list[int]:
    return [int(t) for t in op["tokens"]]


def op_store(rank: Rank, op: dict) -> dict:
    tokens = torch.tensor(_tokens(op), dtype=torch.long)
    mask = None
    if op.get("skip_cached"):  # what vLLM does: do not save the chunk-aligned prefix already held
        held = rank.engine.lookup(tokens=tokens) // rank.chunk_size * rank.chunk_size
        if held >= len(tokens):
            return {"rank": rank.rank, "skipped": True, "cached": held}
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:held] = False
    rank.engine.store(tokens=tokens, mask=mask)
    return {"rank": rank.rank, "engine_lookup_after": rank.engine.lookup(tokens=tokens)}


def op_evict(rank: Rank, op: dict) -> dict:
    if not op["tokens"]:
        raise ValueError("evict needs tokens (op clear drops everything)")
    return {"rank": rank.rank, "removed": rank.engine.clear(tokens=_tokens(op), locations=op.get("locations"))}


def op_lookup(rank: Rank, op: dict) -> dict:
    if not op.get("pin"):
        return {"rank": rank.rank, "hit_tokens": rank.engine.lookup(tokens=_tokens(op))}
    lookup_id = f"compat-{time.time_ns()}"  # a vLLM hit: pinned (touches the LRU), then unpinned
    hit = rank.engine.lookup(tokens=_tokens(op), lookup_id=lookup_id, pin=True)
    rank.engine.lookup_unpin(lookup_id)
    return {"rank": rank.rank, "hit_tokens": hit}


PER_RANK = {
    "store": op_store,
    "evict": op_evict,
    "lookup": op_lookup,
    "clear": lambda rank, op: {"rank": rank.rank, "cleared_tokens": rank.engine.clear(locations=op.get("locations"))},
    "keys": lambda rank, op: {"rank": rank.rank, "keys": rank.keys()},
}


def wait_for_file(op: dict) -> None:
    deadline = time.monotonic() + float(op.get("timeout_s", 60))
    while not os.path.exists(op["path"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no file {op['path']}")
        time.sleep(0.05)


def run(op: dict, ranks: list[Rank]) -> dict:
    kind = op.get("op")
    chosen = [r for r in ranks if "ranks" not in op or r.rank in op["ranks"]]
    out: dict = {"op": kind}
    if "tokens" in op:
        out["chunks"] = ranks[0].chunks(_tokens(op))
    if kind in PER_RANK:
        out["ranks"] = [PER_RANK[kind](rank, op) for rank in chosen]
    elif kind == "sleep":
        time.sleep(float(op.get("s", 0)))
    elif kind == "touch":
        open(op["path"], "a").close()
    elif kind == "wait_for_file":
        wait_for_file(op)
    elif kind != "hashes":
        raise ValueError(f"unknown op {kind!r}")
    for rank in ranks:
        rank.flush()
    return out


def read_ops(source: str):
    stream = sys.stdin if source == "-" else open(source)
    with stream:
        for n, line in enumerate(stream, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                yield n, json.loads(line)


def stop(ranks: list[Rank]) -> None:
    """Flush, pause heartbeats, deregister every registered rank, let it reach the wire, close."""
    for rank in ranks:
        rank.flush()
        rank.worker.heartbeats_paused = True
    time.sleep(0.1)  # a heartbeat already on its way is answered before DeRegisterMsg goes
    for rank in ranks:
        if rank.registered:
            rank.worker.deregister()
            rank.drain()
    time.sleep(0.2)  # the PUSH socket closes with linger 0
    for rank in reversed(ranks):
        rank.engine.close()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="the real LMCache engine + worker, driven one op at a time")
    ap.add_argument("--pull-url", required=True, help="controller PULL host:port")
    ap.add_argument("--reply-url", required=True, help="controller ROUTER host:port (registration)")
    ap.add_argument("--instance-id", required=True)
    ap.add_argument("--worker-ports", default="8001", help="REP port per rank, comma list (a missing one is +1)")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks of the instance, each its own engine")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cpu-chunks", type=float, default=8, help="LocalCPUBackend pool, in full chunks")
    ap.add_argument("--heartbeat-s", type=int, default=None, help="worker heartbeat period")
    ap.add_argument("--register-timeout", type=float, default=15.0)
    ap.add_argument("--ops", default="-", help="JSON-lines file, or - for stdin")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error("--tp must be 1 or more")
    args.ports = [int(p) for p in args.worker_ports.split(",") if p.strip()]
    while len(args.ports) < args.tp:
        args.ports.append(args.ports[-1] + 1)
    return args


def interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    registrations = Registrations()
    loopback_only()
    pausable_heartbeats()
    config, chunk_bytes = engine_config(args)
    ranks: list[Rank] = []
    rc = 0
    try:
        ranks = [Rank(args, config, r) for r in range(args.tp)]
        registered = registrations.wait({(args.instance_id, r) for r in range(args.tp)}, args.register_timeout)
        for rank in ranks:
            rank.registered = rank.rank in registered
        say({"event": "ready", "instance_id": args.instance_id, "tp": args.tp, "worker_ports": args.ports[:args.tp],
             "chunk_size": args.chunk_size, "chunk_bytes": chunk_bytes, "registered": registered,
             "backends": list(ranks[0].backends())})
        if len(registered) < args.tp:
            say({"event": "error", "err": f"registration not answered for ranks "
                                          f"{sorted(set(range(args.tp)) - set(registered))}"})
            return (rc := 3)
        for line, op in read_ops(args.ops):
            try:
                result = run(op, ranks)
            except (KeyError, TypeError, ValueError, TimeoutError, RuntimeError) as exc:
                result, rc = {"op": op.get("op"), "error": f"{type(exc).__name__}: {exc}"}, 1
            say({**result, "line": line})
    except KeyboardInterrupt as exc:
        say({"event": "interrupted", "why": str(exc)})
        rc = 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(ranks)
        say({"event": "exit", "rc": rc})
    return rc


if __name__ == "__main__":
    sys.exit(main())
