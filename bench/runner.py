"""``kvlookup bench {all,compare,ingest,memory,sweeps,report}``: run, save JSON, render docs.

``all`` runs every part in one process, on one machine, in one go, writes
``bench/results/results.json`` (``results-quick.json`` with ``--quick``), the PNG plots under
docs/img/ and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from kvlookup.bench import progress

if importlib.util.find_spec("tqdm") is None:  # the bench extra is missing: `kvlookup bench` says so
    raise ImportError("No module named 'tqdm'")
from kvlookup.bench.procs import PARTS, REPO

RESULTS = REPO / "bench" / "results"

QUICK = {
    "compare": dict(requests=1500, instances=4, cpu_chunks=2048, disk_chunks=4096, agree_sample=200,
                    load_sample=100, concurrencies=(1, 4, 16), duration_s=2.0, kv_configs=("uvicorn:2",)),
    "ingest": dict(workers=4, ops_per_worker=50_000, pushers=2),
    "memory": dict(records=100_000, holder_counts=(1, 4)),
    "sweeps": dict(lengths=(1024, 32768, 131072), instance_counts=(1, 8, 64), index_sizes=(10_000, 100_000),
                   seconds=0.5),
    "stages": dict(lengths=(1024, 32768), seconds=1.0),
    "cluster": dict(lengths=(1024, 32768), seconds=0.5, sidecar_counts=(1, 2), ops_per_sidecar=20_000,
                    trace_requests=300),
    "wrk": dict(lengths=(12, 32768), concurrencies=(1, 16), seconds=1.0, rounds=1),
    "purge": dict(records=200_000),
    "idle": dict(seconds=2.0),
    "holders": dict(lengths=(1024, 32768), holder_counts=(8, 1024), seconds=0.5),
    "fresh": dict(lengths=(12, 1024), concurrencies=(1, 16), seconds=1.0),
    "vllm-ingest": dict(blocks=20_000),
    "mp": dict(placements=20_000, lookups=50, seconds=1.0, rounds=1),
}
FULL = {
    "compare": dict(requests=12031, instances=8, cpu_chunks=8192, disk_chunks=24576, agree_sample=1500,
                    load_sample=400, concurrencies=(1, 4, 16), duration_s=6.0,
                    kv_configs=("uvicorn:2", "gevent:2", "gthread:2x4", "sync:2")),
    "ingest": dict(workers=4, ops_per_worker=250_000, pushers=2),
    "memory": dict(records=1_000_000, holder_counts=(1, 2, 4)),
    "sweeps": dict(lengths=(1024, 4096, 16384, 32768, 65536, 131072), instance_counts=(1, 4, 8, 16, 64),
                   index_sizes=(10_000, 100_000, 1_000_000, 10_000_000), seconds=2.0),
    "stages": dict(lengths=(1024, 11264, 32768), seconds=3.0),
    "cluster": dict(lengths=(1024, 32768, 131072), seconds=3.0, sidecar_counts=(1, 2, 4), ops_per_sidecar=200_000,
                    trace_requests=4000),
    "wrk": dict(lengths=(12, 256, 1024, 32768), concurrencies=(1, 4, 16), seconds=2.0, rounds=3),
    "purge": dict(records=1_000_000),
    "idle": dict(seconds=3.0),
    "holders": dict(lengths=(1024, 32768), holder_counts=(1, 8, 64, 512, 1024), seconds=2.0, rounds=2),
    "fresh": dict(lengths=(12, 256, 1024, 8192, 32768), concurrencies=(1, 4, 16, 64), seconds=2.0),
    "vllm-ingest": dict(blocks=100_000),
    "mp": dict(placements=100_000, lookups=200),
}


def machine() -> dict:
    """nproc, CPU model, memory, Python, Redis server version."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines()
                      if x.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem_kb = 0
    from kvlookup.proc.redis_server import find_server_binary

    server = subprocess.run([find_server_binary(), "--version"], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "cpu": model, "memory_gib": round(mem_kb / 2**20, 1),
            "python": platform.python_version(), "redis": server.split(" sha=")[0], "os": platform.platform()}


def run_part(name: str, params: dict, args: argparse.Namespace) -> dict:
    start = time.monotonic()
    progress.note(f"== {name}")
    if name == "compare":
        from kvlookup.bench.compare import CompareConfig, run

        cfg = CompareConfig(**params, lmcache_venv=args.lmcache_venv, create_venv=args.create_venv)
        res = run(cfg)
    elif name == "ingest":
        from kvlookup.bench.ingest import run

        res = run(**params)
        progress.note(f"  ingest: {res['ops_per_s']:,} chunk ops/s (CPU per op: sidecar {res['sidecar_cpu_us_per_op']} "
                      f"us, Redis {res['redis_cpu_us_per_op']} us)")
    elif name == "memory":
        from kvlookup.bench.memory import run

        res = run(**params)
        for c in res["cases"]:
            progress.note(f"  {c['holders_per_chunk']} holder(s)/chunk: {c['bytes_per_record']} B/record")
    elif name == "sweeps":
        from kvlookup.bench.sweeps import run

        res = run(**params)
    elif name == "cluster":
        from kvlookup.bench.cluster import run

        res = run(**params)
    elif name == "mp":
        from kvlookup.bench.mp import run

        res = run(**params, lmcache_venv=args.lmcache_venv)
        progress.note(f"  mp: ingest {res['ingest_ratio']}x, {res['redis_bytes_per_placement']} B/placement")
    elif name == "wrk":
        from kvlookup.bench.wrkload import run

        res = run(**params, lmcache_venv=args.lmcache_venv)
    elif name == "purge":
        from kvlookup.bench.purge import run

        res = run(**params)
        progress.note(f"  purge: {res['records_per_s']:,} records/s")
    elif name == "idle":
        from kvlookup.bench.idle import run

        res = run(**params)
        for c in res["cases"]:
            progress.note(f"  idle {c['kind']} sidecar: {c['commands_per_s']} Redis commands/s, "
                          f"{c['cpu_share'] * 100:.2f}% of a core")
    elif name == "holders":
        from kvlookup.bench.holders import run

        res = run(**params)
    elif name == "vllm-ingest":
        from kvlookup.bench.vllm_ingest import run

        res = run(**params)
        for shape, s in res["shapes"].items():
            progress.note(f"  vLLM {shape}: {s['blocks_per_s']:,} blocks/s (CPU per block: sidecar "
                          f"{s['sidecar_cpu_us_per_block']} us, Redis {s['redis_proc_cpu_us_per_block']} us; "
                          f"commandstats {s['redis_cpu_us_per_block']} us)")
    elif name == "fresh":
        from kvlookup.bench.fresh import run

        res = run(**params, lmcache_venv=args.lmcache_venv)
    else:
        from kvlookup.bench.stages import run

        res = run(**params)
    res["wall_s"] = round(time.monotonic() - start, 1)
    res["command"] = _command()
    res["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return res


def _command() -> str:
    return "kvlookup bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])


def cmd_run(args: argparse.Namespace) -> int:
    table = QUICK if args.quick else FULL
    parts = PARTS if args.part == "all" else (args.part,)
    out_path = Path(args.out) if args.out else RESULTS / ("results-quick.json" if args.quick else "results.json")
    results: dict = {}
    if args.part != "all" and out_path.exists():
        results = json.loads(out_path.read_text())  # update one part of an earlier run
        for name in PARTS:  # parts kept from that run keep its command and date
            if name in results:
                results[name].setdefault("command", results.get("command", "?"))
                results[name].setdefault("date", results.get("date", "?"))
    here = machine()
    results.update({"command": _command(), "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    results.setdefault("machine", here)  # the machine of the parts run together; a part run alone keeps its own
    if args.part == "all":
        results["machine"] = here
    start = time.monotonic()
    for name in parts:
        results[name] = run_part(name, table[name], args)
        if here != results["machine"]:
            results[name]["machine"] = here
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1) + "\n")
    results["total_wall_s"] = round(time.monotonic() - start, 1)
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    progress.note(f"results: {out_path}")
    if not args.no_docs:
        from kvlookup.bench import report

        report.render(results, out_path)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kvlookup.bench import report

    path = Path(args.results or RESULTS / "results.json")
    report.render(json.loads(path.read_text()), path)
    return 0


def add_parser(sub) -> None:
    """Add ``bench`` to the kvlookup CLI's subparsers."""
    b = sub.add_parser("bench", help="benchmarks side by side with LMCache's controller (docs/benchmarks.md)",
                       description="Parts: compare (kvlookup vs LMCache 0.5.6 on the Mooncake trace; needs the "
                       "LMCache venv), ingest (one sidecar's chunk ops/s), memory (Redis bytes per record), "
                       "sweeps (latency vs prompt length, instances, index size), stages (where an HTTP "
                       "lookup's time goes), purge (records/s deleted of a retired holder), idle (Redis "
                       "commands/s and CPU of an idle sidecar of each kind), holders (lookup cost vs how many "
                       "instances hold the prompt), fresh (prompts with a new last chunk vs LMCache, CPU per "
                       "request), vllm-ingest (vLLM BlockStored blocks/s). 'all' runs every "
                       "part (~6 min; --quick ~1.5 min) and writes bench/results/results.json and "
                       "docs/benchmarks.md; 'report' re-renders the docs.")
    b.add_argument("part", nargs="?", default="all", choices=("all", *PARTS, "report"),
                   help="what to run (default: all)")
    b.add_argument("--quick", action="store_true", help="small sizes, for smoke runs (all: ~1.5 min)")
    b.add_argument("--lmcache-venv", help="venv with LMCache 0.5.6 (default $KVLOOKUP_LMCACHE_PYTHON or .venv-lmcache)")
    b.add_argument("--create-venv", action="store_true",
                   help="create .venv-lmcache (torch 2.13.0 CPU, then lmcache 0.5.6) when missing")
    b.add_argument("--out", help="results JSON (default bench/results/results[-quick].json)")
    b.add_argument("--results", help="for 'report': the results JSON to render")
    b.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md and plots")
    b.set_defaults(func=lambda a: cmd_report(a) if a.part == "report" else cmd_run(a))
