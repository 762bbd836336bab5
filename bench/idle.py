"""``kvlookup bench idle``: what a sidecar with no traffic costs (Redis commands/s, CPU share).

Each kind of sidecar (LMCache PULL + ROUTER, vLLM SUB only) is started as a real process on a
Redis of its own, left idle for a few seconds, and measured from outside: Redis commands per
second from ``INFO commandstats`` deltas (every command the server counted, minus the two
``INFO`` calls of the measurement itself), and the process's CPU share from /proc/PID/stat
(user + system time over wall time, every thread).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

from kvlookup.proc.redis_server import EmbeddedRedis, free_port

#: clock ticks per second for /proc/PID/stat times
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def commands_total(r: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` as {command: calls}."""
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in r.info("commandstats").items()}


def measure(pid: int, r: redis.Redis, seconds: float = 3.0) -> dict:
    """Commands/s Redis served and CPU share of ``pid`` over ``seconds`` of wall time.

    Returns {"commands_per_s", "cpu_share" (1.0 = one core), "by_command" ({name: per second})}.
    The measurement's own two INFO calls are not counted."""
    before, cpu0, t0 = commands_total(r), cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    after, cpu1, t1 = commands_total(r), cpu_seconds(pid), time.monotonic()
    wall = t1 - t0
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    delta["info"] = delta.get("info", 0) - 1  # the second INFO is counted before it answers
    delta = {k: v for k, v in delta.items() if v > 0}
    return {"commands_per_s": round(sum(delta.values()) / wall, 2), "cpu_share": round((cpu1 - cpu0) / wall, 4),
            "by_command": {k: round(v / wall, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])}}


def sidecar_args(kind: str) -> list[str]:
    """Command-line flags of an idle sidecar of ``kind`` ("lmcache" or "vllm") on free ports."""
    if kind == "lmcache":
        return ["--pull-url", f"127.0.0.1:{free_port()}", "--reply-url", f"127.0.0.1:{free_port()}"]
    return ["--instance-id", "idle-vllm", "--vllm-endpoint", f"tcp://127.0.0.1:{free_port()}"]


def start_sidecar(kind: str, redis_url: str, settle_s: float = 1.0, timeout_s: float = 30.0) -> subprocess.Popen:
    """``python -m kvlookup sidecar`` of ``kind`` on ``redis_url``: once its /health answers,
    ``settle_s`` more (past start-up: imports, script loads, first renewals)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "sidecar", "--log-level", "WARNING",
                             "--redis-url", redis_url, "--metrics-port", str(port), *sidecar_args(kind)],
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} sidecar exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{kind} sidecar did not answer /health") from None
            time.sleep(0.05)
    time.sleep(settle_s)
    return proc


def run(seconds: float = 3.0, kinds: tuple[str, ...] = ("lmcache", "vllm")) -> dict:
    """Each kind of sidecar idle on a Redis of its own: {"cases": [{"kind", ...measure()}]}."""
    cases = []
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            server = EmbeddedRedis(Path(tmp), appendonly=False)
            server.start()
            proc = None
            try:
                proc = start_sidecar(kind, server.url)
                client = redis.Redis.from_url(server.url)
                cases.append({"kind": kind, "seconds": seconds, **measure(proc.pid, client, seconds)})
                client.close()
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(15)
                server.stop()
    return {"cases": cases}


if __name__ == "__main__":
    import json

    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0), indent=1))
