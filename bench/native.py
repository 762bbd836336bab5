"""``python -m kvlookup.bench.native``: the C hot path (kvlookup._native) against pure Python and main.

Per lookup, in process, at each prompt length: the body decode (``parse_request``), the LMCache
chunk hashes alone, decode + hash, decode + hash + a vLLM block-16 chain, and the whole hot
``/lookup`` (``LookupRoute.respond`` + JSON encode + count, 8 holders, chunk sets cached as the
controller's default). Targets, alternating in rounds, each round a fresh process
(bench/native_worker.py) on the same Redis and prompts: ``base`` (a checkout of main, given by
``--base``; skipped without it), ``python`` (this checkout, KVLOOKUP_NATIVE=0) and ``native``
(KVLOOKUP_NATIVE=on). Prints per-item medians over the rounds of CPU µs per op (process_time) and
wall µs, and the ratios; ``--json PATH`` writes every round.

Usage: python -m kvlookup.bench.native [--base DIR] [--rounds 5] [--seconds 0.4] [--lengths 256,8192,32768]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from kvlookup.bench.procs import Procs
from kvlookup.bench.sweeps import hold, prompt
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
ITEMS = ("decode", "hash_lmcache", "decode+hash", "decode+hash+vllm16", "lookup")


def _round(target: str, root: Path, worker: Path, url: str, lengths: list[int], seconds: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), KVLOOKUP_NATIVE="0" if target == "python" else "auto")
    if target == "native":
        env["KVLOOKUP_NATIVE"] = "on"
    done = subprocess.run([sys.executable, str(worker), url, json.dumps(lengths), str(seconds)], cwd=worker.parent,
                          env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{target}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    where = Path(out["kvlookup"]).resolve().parent.parent
    if where != root.resolve():
        raise RuntimeError(f"{target}: imported kvlookup from {where}, not {root}")
    if out["native"] != (target == "native"):
        raise RuntimeError(f"{target}: extension in use = {out['native']}")
    return out["rows"]


def run(base: str | None, rounds: int, seconds: float, lengths: list[int]) -> dict:
    targets = [("base", Path(base))] if base else []
    targets += [("python", CHECKOUT), ("native", CHECKOUT)]
    results: dict = {t: [] for t, _ in targets}
    with Procs() as procs:
        worker = procs.tmp / "native_worker.py"  # run from a folder of its own: no bench/ module shadows another
        shutil.copy(HERE / "native_worker.py", worker)
        url = procs.start_redis()
        hold(Store(connect(url), instance_ttl_s=0), prompt(max(lengths), 1), [f"len-{i}" for i in range(8)])
        for i in range(rounds):
            order = targets if i % 2 == 0 else targets[::-1]
            for target, root in order:
                results[target].append(_round(target, root, worker, url, lengths, seconds))
                print(f"round {i + 1}/{rounds} {target} done", file=sys.stderr, flush=True)
    return {"rounds": rounds, "seconds_per_item": seconds, "lengths": lengths, "results": results,
            "loadavg": os.getloadavg()}


def medians(out: dict) -> dict:
    """target -> length -> item -> (median CPU µs, median wall µs)."""
    table: dict = {}
    for target, rounds in out["results"].items():
        for n in out["lengths"]:
            for item in ITEMS:
                cpu = statistics.median(r[str(n)][item]["cpu_us"] for r in rounds)
                wall = statistics.median(r[str(n)][item]["wall_us"] for r in rounds)
                table.setdefault(target, {}).setdefault(n, {})[item] = (cpu, wall)
    return table


def report(out: dict) -> str:
    table = medians(out)
    targets = list(table)
    lines = ["| tokens | item | " + " | ".join(f"{t} CPU µs (wall)" for t in targets)
             + " | python/native CPU" + (" | base/native CPU |" if "base" in table else " |"),
             "|---|---|" + "---|" * (len(targets) + 1 + ("base" in table))]
    for n in out["lengths"]:
        for item in ITEMS:
            cells = [f"{table[t][n][item][0]:.1f} ({table[t][n][item][1]:.1f})" for t in targets]
            ratio = table["python"][n][item][0] / table["native"][n][item][0]
            row = f"| {n} | {item} | " + " | ".join(cells) + f" | {ratio:.2f}x |"
            if "base" in table:
                row += f" {table['base'][n][item][0] / table['native'][n][item][0]:.2f}x |"
            lines.append(row)
    load = ", ".join(f"{x:.2f}" for x in out["loadavg"])
    return "\n".join(lines) + f"\n\nmedians of {out['rounds']} alternating rounds; load average at the end {load}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlookup.bench.native", description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="a checkout of main (git worktree / git archive) to time beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4, help="seconds per item per round")
    parser.add_argument("--lengths", default="256,8192,32768")
    parser.add_argument("--json", help="write every round here")
    args = parser.parse_args(argv)
    out = run(args.base, args.rounds, args.seconds, [int(x) for x in args.lengths.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
