"""HTTP load generator, run as its own process: ``python -m kvlookup.bench.loadgen ARGS``.

C threads, each with one keep-alive ``http.client`` connection, POST /lookup bodies taken in
turn from a pickle file (list of JSON bodies) for a fixed duration, bounded by a request cap.
Prints one JSON line: requests, errors, seconds, req_s, p50_ms, p99_ms, mean_ms.
"""

from __future__ import annotations

import argparse
import http.client
import json
import pickle
import sys
import threading
import time
from urllib.parse import urlsplit


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values (q in [0, 100]); 0.0 when empty."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def run(url: str, bodies: list[bytes], concurrency: int, duration: float, max_requests: int,
        warmup: float = 0.5) -> dict:
    """Drive the server; latencies of requests started after ``warmup`` seconds count."""
    parts = urlsplit(url)
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    budget = [max_requests]
    lock = threading.Lock()
    t0 = time.perf_counter()
    t_measure = t0 + warmup
    t_end = t_measure + duration
    headers = {"Content-Type": "application/json", "Connection": "keep-alive"}

    def worker(n: int) -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        i = n
        mine = lat[n]
        while True:
            now = time.perf_counter()
            if now >= t_end:
                break
            with lock:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            body = bodies[i % len(bodies)]
            i += concurrency
            start = time.perf_counter()
            try:
                conn.request("POST", parts.path or "/lookup", body, headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            end = time.perf_counter()
            if start >= t_measure:
                if ok:
                    mine.append(end - start)
                else:
                    errors[n] += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = min(time.perf_counter(), t_end) - t_measure
    all_lat = sorted(x for xs in lat for x in xs)
    n = len(all_lat)
    return {"concurrency": concurrency, "requests": n, "errors": sum(errors), "seconds": round(elapsed, 3),
            "req_s": round(n / elapsed, 1) if elapsed > 0 else 0.0,
            "p50_ms": round(percentile(all_lat, 50) * 1000, 3), "p99_ms": round(percentile(all_lat, 99) * 1000, 3),
            "mean_ms": round(sum(all_lat) / n * 1000, 3) if n else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True, help="http://127.0.0.1:PORT/lookup")
    p.add_argument("--bodies", required=True, help="pickle file: list of JSON request bodies (bytes)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--warmup", type=float, default=0.5)
    a = p.parse_args(argv)
    with open(a.bodies, "rb") as fh:
        bodies = pickle.load(fh)
    print(json.dumps(run(a.url, bodies, a.concurrency, a.duration, a.max_requests, a.warmup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
