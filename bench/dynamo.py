"""``python -m kvlookup.bench.dynamo``: kvlookup beside NVIDIA Dynamo's standalone indexer on the
same vLLM events.

One ZMQ PUB socket plays a vLLM engine (bound, as vLLM binds ``tcp://*:5557``); Dynamo's indexer
(``python -m dynamo.indexer`` from ``ai-dynamo-runtime==1.6.1`` in the venv named by
``$KVLOOKUP_DYNAMO_PYTHON``) is told of it with ``POST /register`` and a kvlookup sidecar
subscribes to it (``--vllm-endpoint``), writing to its Redis; a kvlookup controller (defaults)
answers lookups. Prompts of each length are stored as chains of 16-token blocks
(``BlockStored`` in vLLM's array form). Then each length is looked up sequentially over HTTP
keep-alive, targets alternating in rounds: Dynamo ``POST /query {token_ids, model_name}`` (JSON),
kvlookup ``POST /lookup {tokens}`` as JSON and as packed uint32 (``application/octet-stream``).
Two workloads: ``hot`` (the stored prompt, the same body every request) and ``fresh`` (the
stored prompt with a new last block each request, as a new turn: nothing kept for it applies;
the same bodies to both targets). Reported: p50/p99 per target, workload and length, each the
best of ``rounds`` rounds (``$KVLOOKUP_DYNAMO_ROUNDS``, 2; ``$KVLOOKUP_DYNAMO_N`` requests each),
and CPU time per request of that round (kvlookup: controller tree + sidecar + Redis; Dynamo: the
indexer's tree), steadier than latency on a loaded box. Both
targets must answer every stored prompt in full first (else it raises).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import time
import urllib.request
from array import array
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from kvlookup.bench.fresh import design_env, tree_cpu_s
from kvlookup.bench.loadgen import percentile
from kvlookup.bench.procs import Procs
from kvlookup.proc.redis_server import free_port

BLOCK = 16


def post(conn: http.client.HTTPConnection, path: str, body: bytes,
         content_type: str = "application/json") -> tuple[int, bytes]:
    conn.request("POST", path, body, {"Content-Type": content_type})
    resp = conn.getresponse()
    return resp.status, resp.read()


def time_posts(port: int, path: str, make_body: Callable[[int], bytes], n: int,
               content_type: str = "application/json") -> dict:
    """``n`` requests, body ``make_body(i)`` (built before its request is timed), after 5 warm-up
    requests (bodies ``make_body(-1)``..)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for i in range(5):
        post(conn, path, make_body(-1 - i), content_type)
    lat = []
    for i in range(n):
        body = make_body(i)
        t = time.perf_counter()
        status, _ = post(conn, path, body, content_type)
        lat.append(time.perf_counter() - t)
        assert status == 200, status
    conn.close()
    lat.sort()
    return {"n": n, "p50_ms": round(percentile(lat, 50) * 1000, 3), "p99_ms": round(percentile(lat, 99) * 1000, 3)}


def packed(tokens: list[int]) -> bytes:
    """Token ids as /lookup's ``application/octet-stream`` body (little-endian uint32)."""
    ids = array("I", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def prompt_of(tokens: list[int], workload: str, rng: random.Random) -> list[int]:
    """``hot``: the stored prompt; ``fresh``: it with a new last block (never sent before)."""
    if workload == "hot":
        return tokens
    return tokens[:len(tokens) - BLOCK] + [rng.randrange(32_000, 2**31) for _ in range(BLOCK)]


ENCODERS: dict[str, tuple[str, Callable[[list[int]], bytes], str]] = {
    "kvlookup_json": ("/lookup", lambda t: json.dumps({"tokens": t}).encode(), "application/json"),
    "kvlookup_packed": ("/lookup", lambda t: packed(t), "application/octet-stream"),
    "dynamo": ("/query", lambda t: json.dumps({"token_ids": t, "model_name": "bench"}).encode(), "application/json"),
}


def stored_batches(tokens: list[int], first_hash: int, per_batch: int = 64) -> list[bytes]:
    """vLLM-shaped batches storing ``tokens`` as one chain of 16-token blocks."""
    out, parent, h = [], None, first_hash
    n_blocks = len(tokens) // BLOCK
    for b0 in range(0, n_blocks, per_batch):
        hashes = list(range(h + b0, h + min(b0 + per_batch, n_blocks)))
        toks = tokens[b0 * BLOCK:(b0 + len(hashes)) * BLOCK]
        ev = ["BlockStored", hashes, parent, toks, BLOCK, None, "GPU"]
        out.append(msgspec.msgpack.encode([time.time(), [ev], 0]))
        parent = hashes[-1]
    return out


def wait_answered(kv_port: int, dyn_port: int, prompts: dict[int, list[int]], out: dict, deadline: float) -> None:
    """Until both targets answer every stored prompt in full; RuntimeError past ``deadline``."""
    for port, path, field in ((kv_port, "/lookup", "tokens"), (dyn_port, "/query", "token_ids")):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for L, tokens in prompts.items():
            want = str(L // BLOCK * BLOCK).encode()
            body = json.dumps({field: tokens, "model_name": "bench"} if path == "/query" else {field: tokens}).encode()
            while True:
                _s, got = post(conn, path, body)
                if (b'"engine-1"' in got or b'"1"' in got) and want in got:
                    out.setdefault("answers", {}).setdefault(path, {})[L] = got.decode()[:300]
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} never answered the {L}-token prompt in full: {got[:300]!r}")
                time.sleep(0.2)
        conn.close()


def run(lengths=(64, 4096, 8192, 32768), n: int = 200, dynamo_python: str | None = None,
        workloads=("hot", "fresh"), rounds: int = 2, designs: tuple[str, ...] = ()) -> dict:
    """The rows above; designs: extra kvlookup controllers on the same Redis (target
    ``kvlookup_<design>_packed``, asked with the packed body), each as
    :func:`kvlookup.bench.fresh.design_env` says, alternating with the others."""
    py = dynamo_python or os.environ.get("KVLOOKUP_DYNAMO_PYTHON")
    if not py or not Path(py).exists():
        raise FileNotFoundError("set KVLOOKUP_DYNAMO_PYTHON to a venv python with ai-dynamo-runtime==1.6.1")
    rng = random.Random(11)
    prompts = {L: [rng.randrange(32_000) for _ in range(L)] for L in lengths}
    pub_port, dyn_port = free_port(), free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    out: dict = {"lengths": list(lengths), "requests_per_point": n, "rounds": rounds, "rows": [],
                 "load_before": os.getloadavg()}
    with Procs() as procs:
        procs.spawn("dynamo-indexer", [py, "-m", "dynamo.indexer", "--port", str(dyn_port), "--threads", "2"])
        redis_url = procs.start_redis()
        redis_proc = procs.redis[-1].proc
        assert redis_proc is not None  # started just above
        redis_pid = redis_proc.pid
        procs.spawn("sidecar-vllm", [sys.executable, "-m", "kvlookup", "sidecar", "--redis-url", redis_url,
                                     "--instance-id", "engine-1", "--vllm-endpoint", f"tcp://127.0.0.1:{pub_port}",
                                     "--log-level", "WARNING"])
        kv = procs.start_controller(redis_url)
        extra = {f"kvlookup_{d}_packed": procs.start_controller(redis_url, name=f"kvlookup-{d}", env=design_env(d))
                 for d in designs}
        deadline = time.monotonic() + 60
        while True:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{dyn_port}/register", headers={"Content-Type": "application/json"},
                    data=json.dumps({"instance_id": 1, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                                     "model_name": "bench", "block_size": BLOCK}).encode())
                with urllib.request.urlopen(req, timeout=2) as resp:
                    out["register"] = resp.read().decode()[:200]
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dynamo indexer: {exc}: {procs.log_tail('dynamo-indexer')}") from None
                time.sleep(0.3)
        time.sleep(2.0)  # both subscribers connected (PUB drops what is sent before)
        h, seq = 1, 0
        for tokens in prompts.values():
            for payload in stored_batches(tokens, h):
                pub.send_multipart([b"kv@bench", seq.to_bytes(8, "big"), payload])  # no gap: a gap is a loss
                seq += 1
            h += len(tokens)
        kv_port = int(kv.rsplit(":", 1)[1])
        wait_answered(kv_port, dyn_port, prompts, out, deadline + 60)
        for L, tokens in prompts.items():
            for workload in workloads:
                row: dict = {"tokens": L, "workload": workload}
                ports = {"kvlookup_json": kv_port, "kvlookup_packed": kv_port, "dynamo": dyn_port}
                kv_tree = [procs.pid("kvlookup-controller"), procs.pid("sidecar-vllm"), redis_pid]
                trees = {"kvlookup_json": kv_tree, "kvlookup_packed": kv_tree, "dynamo": [procs.pid("dynamo-indexer")]}
                encoders = dict(ENCODERS)
                for d in designs:
                    name = f"kvlookup_{d}_packed"
                    ports[name] = int(extra[name].rsplit(":", 1)[1])
                    trees[name] = [procs.pid(f"kvlookup-{d}"), procs.pid("sidecar-vllm"), redis_pid]
                    encoders[name] = ENCODERS["kvlookup_packed"]
                for rnd in range(rounds):
                    for name in (list(encoders) if rnd % 2 == 0 else list(encoders)[::-1]):
                        path, encode, ctype = encoders[name]
                        def body(_i: int, e=encode, t=tokens, w=workload) -> bytes:
                            return e(prompt_of(t, w, rng))
                        cpu0 = tree_cpu_s(trees[name])
                        got = time_posts(ports[name], path, body, n, ctype)
                        got["cpu_ms_per_request"] = round((tree_cpu_s(trees[name]) - cpu0) / (n + 5) * 1000, 3)
                        if name not in row or got["p50_ms"] < row[name]["p50_ms"]:
                            row[name] = got
                for name in ("kvlookup_json", "kvlookup_packed", *(f"kvlookup_{d}_packed" for d in designs)):
                    row[f"p50_ratio_{name}_over_dynamo"] = round(row[name]["p50_ms"] / row["dynamo"]["p50_ms"], 2)
                out["rows"].append(row)
                print(json.dumps(row), file=sys.stderr)
    pub.close(0)
    ctx.term()
    out["load_after"] = os.getloadavg()
    return out


if __name__ == "__main__":
    print(json.dumps(run(n=int(os.environ.get("KVLOOKUP_DYNAMO_N", "200")),
                         rounds=int(os.environ.get("KVLOOKUP_DYNAMO_ROUNDS", "2")),
                         designs=tuple(d for d in os.environ.get("KVLOOKUP_DYNAMO_DESIGNS", "").split(",") if d)),
                     indent=1))
