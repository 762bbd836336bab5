"""Publish vLLM KV event batches on demand through vLLM's REAL publisher (test helper).

Runs under the vLLM publisher venv (KVLOOKUP_VLLM_PYTHON), loading vLLM's own
``kv_events.py`` through ../shared/tools/vllm_real_publisher.py as a library. Protocol:
stdout line 1 ``{"ready": true, ...}`` once the sockets are bound; then for each stdin line
(one row in the tool's JSON-lines format) one ``{"published": seq, "batch": {...}}`` after
vLLM's publisher thread has sent it, or ``{"error": "..."}``. ``{"quit": true}`` or EOF stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--vllm-src", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint")
    ap.add_argument("--topic", default="")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--int-hashes", default="1")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_PUB_STUB_TORCH", "1")
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = args.int_hashes
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.tool)))
    import vllm_real_publisher as tool

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    vllm = tool.Vllm(args.vllm_src)
    vllm.init_hashing("sha256", "0")
    pub = vllm.make_publisher(tool.rewrite_loopback_bind(args.endpoint), args.replay_endpoint, args.topic,
                              dp_rank=args.dp_rank, buffer_steps=args.buffer_steps)
    say({"ready": True, "vllm_version": vllm.version})
    seq = 0
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("quit"):
                break
            try:
                batch = vllm.make_batch(tool._row_events(vllm, row), ts=row.get("ts"),
                                        dp_rank=args.dp_rank)
            except SystemExit as exc:
                say({"error": str(exc)})
                continue
            pub.publish(batch)
            tool._queue_drain(pub)
            say({"published": seq, "batch": tool._batch_json(batch)})
            seq += 1
    finally:
        tool._shutdown(pub)
    return 0


if __name__ == "__main__":
    sys.exit(main())
