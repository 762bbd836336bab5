"""``python -m kvlookup.bench.dynamo``: kvlookup beside NVIDIA Dynamo's standalone indexer on the
same vLLM events.

One ZMQ PUB socket plays a vLLM engine (bound, as vLLM binds ``tcp://*:5557``); Dynamo's indexer
(``python -m dynamo.indexer`` from ``ai-dynamo-runtime==1.6.1`` in the venv named by
``$KVLOOKUP_DYNAMO_PYTHON``) is told of it with ``POST /register`` and a kvlookup sidecar
subscribes to it (``--vllm-endpoint``), writing to its Redis; a kvlookup controller (defaults)
answers lookups. Prompts of each length are stored as chains of 16-token blocks
(``BlockStored`` in vLLM's array form). Then each length is looked up sequentially over HTTP
keep-alive, targets alternating: Dynamo ``POST /query {token_ids, model_name}``, kvlookup
``POST /lookup {tokens}`` (JSON both). Reported: p50/p99 per target and length.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq

from kvlookup.bench.loadgen import percentile
from kvlookup.bench.procs import Procs
from kvlookup.proc.redis_server import free_port

BLOCK = 16


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def time_posts(port: int, path: str, body: bytes, n: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(5):
        post(conn, path, body)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        status, _ = post(conn, path, body)
        lat.append(time.perf_counter() - t)
        assert status == 200, status
    conn.close()
    lat.sort()
    return {"n": n, "p50_ms": round(percentile(lat, 50) * 1000, 3), "p99_ms": round(percentile(lat, 99) * 1000, 3)}


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


def run(lengths=(64, 4096, 8192, 32768), n: int = 200, dynamo_python: str | None = None) -> dict:
    py = dynamo_python or os.environ.get("KVLOOKUP_DYNAMO_PYTHON")
    if not py or not Path(py).exists():
        raise FileNotFoundError("set KVLOOKUP_DYNAMO_PYTHON to a venv python with ai-dynamo-runtime==1.6.1")
    rng = random.Random(11)
    prompts = {L: [rng.randrange(32_000) for _ in range(L)] for L in lengths}
    pub_port, dyn_port = free_port(), free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    out: dict = {"lengths": list(lengths), "requests_per_point": n, "rows": []}
    with Procs() as procs:
        procs.spawn("dynamo-indexer", [py, "-m", "dynamo.indexer", "--port", str(dyn_port), "--threads", "2"])
        redis_url = procs.start_redis()
        procs.spawn("sidecar-vllm", [sys.executable, "-m", "kvlookup", "sidecar", "--redis-url", redis_url,
                                     "--instance-id", "engine-1", "--vllm-endpoint", f"tcp://127.0.0.1:{pub_port}",
                                     "--log-level", "WARNING"])
        kv = procs.start_controller(redis_url)
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
        h = 1
        for tokens in prompts.values():
            for payload in stored_batches(tokens, h):
                pub.send_multipart([b"kv@bench", h.to_bytes(8, "big"), payload])
                h += 1
            h += len(tokens)
        kv_port = int(kv.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", kv_port, timeout=30)
        for L, tokens in prompts.items():  # wait until kvlookup has every prompt
            want = L // BLOCK * BLOCK
            body = json.dumps({"tokens": tokens}).encode()
            while time.monotonic() < deadline + 60:
                _s, got = post(conn, "/lookup", body)
                if b'"engine-1"' in got and str(want).encode() in got:
                    break
                time.sleep(0.2)
        conn.close()
        dconn = http.client.HTTPConnection("127.0.0.1", dyn_port, timeout=30)
        for L, tokens in prompts.items():
            _s, got = post(dconn, "/query", json.dumps({"token_ids": tokens, "model_name": "bench"}).encode())
            out.setdefault("dynamo_answers", {})[L] = got.decode()[:300]
        dconn.close()
        for L, tokens in prompts.items():
            row: dict = {"tokens": L}
            kv_body = json.dumps({"tokens": tokens}).encode()
            dyn_body = json.dumps({"token_ids": tokens, "model_name": "bench"}).encode()
            for rnd in range(2):
                order = [("kvlookup", kv_port, "/lookup", kv_body), ("dynamo", dyn_port, "/query", dyn_body)]
                for name, port, path, body in (order if rnd == 0 else order[::-1]):
                    got = time_posts(port, path, body, n)
                    if name not in row or got["p50_ms"] < row[name]["p50_ms"]:
                        row[name] = got
            row["p50_ratio_kvlookup_over_dynamo"] = round(row["kvlookup"]["p50_ms"] / row["dynamo"]["p50_ms"], 2)
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr)
    pub.close(0)
    ctx.term()
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
