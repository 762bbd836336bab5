"""Processes a benchmark starts: Redis, kvlookup sidecar and controller, LMCache's controller.

Everything binds 127.0.0.1 on free ports and is stopped by :class:`Procs` (by pid, SIGTERM
then SIGKILL), also when a benchmark fails half way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvlookup.proc.redis_server import EmbeddedRedis, free_port, ping

log = logging.getLogger("bench")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LMCACHE_VENV = REPO / ".venv-lmcache"

#: The parts of ``kvlookup bench all``, in the order they run and are reported.
PARTS = ("compare", "ingest", "memory", "sweeps", "stages", "purge", "cluster", "wrk", "idle", "holders", "fresh",
         "vllm-ingest", "mp")


def wrk_and_lmcache(venv: str | None = None) -> Path:
    """The LMCache 0.5.6 venv's python for a wrk benchmark; FileNotFoundError naming what is
    missing (wrk, or the venv)."""
    if not shutil.which("wrk"):
        raise FileNotFoundError("wrk is not installed (apt-get install wrk)")
    py = lmcache_python(venv)
    if py is None:
        raise FileNotFoundError("no LMCache 0.5.6 venv (scripts/real-peers.sh)")
    return py


def lmcache_python(venv: str | None = None, create: bool = False) -> Path | None:
    """Python of a venv holding LMCache 0.5.6: ``venv``, else ``$KVLOOKUP_LMCACHE_PYTHON``, else
    ``.venv-lmcache`` (created with torch 2.13.0 CPU then lmcache 0.5.6 when ``create``)."""
    if venv:
        py = Path(venv) / "bin" / "python"
    elif os.environ.get("KVLOOKUP_LMCACHE_PYTHON"):
        py = Path(os.environ["KVLOOKUP_LMCACHE_PYTHON"])
    else:
        py = DEFAULT_LMCACHE_VENV / "bin" / "python"
    if (py.parent / "lmcache_controller").exists():
        return py
    if not create:
        return None
    target = py.parent.parent
    log.info("creating the LMCache 0.5.6 venv in %s (torch first, then lmcache)", target)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "lmcache==0.5.6"], check=True)
    return py


class Procs:
    """Owns every process of one benchmark; ``close()`` stops them all (idempotent)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.redis: list[EmbeddedRedis] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="kvlookup-bench-"))

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_redis(self, extra: list[str] | None = None) -> str:
        """A throwaway Redis (no persistence); returns its URL."""
        server = EmbeddedRedis(self.tmp / f"redis{len(self.redis)}", appendonly=False)
        if extra:
            base = server.command

            def command() -> list[str]:
                return base() + extra

            server.command = command  # type: ignore[method-assign]
        server.start()
        self.redis.append(server)
        return server.url  # type: ignore[return-value]

    def spawn(self, name: str, cmd: list[str], env: dict | None = None, cwd: str | None = None) -> subprocess.Popen:
        logf = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        logf.close()
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, n: int = 2000) -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def start_sidecar(self, redis_url: str, name: str = "sidecar") -> tuple[str, str]:
        """``kvlookup sidecar`` bound to free loopback ports; returns (pull, reply) host:port."""
        pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.spawn(name, [sys.executable, "-m", "kvlookup", "sidecar", "--redis-url", redis_url,
                          "--pull-url", pull, "--reply-url", reply, "--instance-ttl", "0",
                          "--log-level", "WARNING"])
        return pull, reply

    def start_controller(self, redis_url: str, conf: str = "uvicorn:2", name: str = "kvlookup-controller",
                         extra: tuple[str, ...] = (), env: dict | None = None) -> str:
        """``kvlookup controller`` (gunicorn) in config ``conf`` (see :func:`gunicorn_conf`), with
        ``extra`` flags (e.g. ``("--lookup-cache", "off")``) and ``env`` added to its environment;
        returns its base URL once /health answers."""
        worker_class, workers, threads = gunicorn_conf(conf)
        port = free_port()
        self.spawn(name, [
            sys.executable, "-m", "kvlookup", "controller", "--redis-url", redis_url, "--port", str(port),
            "--worker-class", worker_class, "--workers", str(workers), "--threads", str(threads),
            "--instance-ttl", "0", "--log-level", "WARNING", "--lookup-response", "layout_info", *extra],
            env=dict(os.environ, **env) if env else None)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", name, self)
        return url

    def start_lmcache(self, python: Path) -> tuple[str, str, str]:
        """LMCache's ``lmcache_controller`` on free ports; returns (http url, pull, reply)."""
        port, pull, reply = free_port(), free_port(), free_port()
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_LOG_LEVEL="WARNING")
        self.spawn("lmcache-controller", [
            str(python.parent / "lmcache_controller"), "--host", "127.0.0.1", "--port", str(port),
            "--monitor-ports", json.dumps({"pull": pull, "reply": reply})], env=env, cwd=str(self.tmp))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/lookup", "lmcache-controller", self, post=b'{"tokens":[]}', timeout=60)
        return url, f"127.0.0.1:{pull}", f"127.0.0.1:{reply}"

    def pid(self, name: str) -> int:
        """The pid of the process started as ``name``."""
        return next(proc.pid for n, proc in self.procs if n == name)

    def stop(self, name: str) -> None:
        for n, proc in list(self.procs):
            if n == name:
                _terminate(proc)
                self.procs.remove((n, proc))

    def close(self) -> None:
        for _name, proc in reversed(self.procs):
            _terminate(proc)
        self.procs.clear()
        for server in self.redis:
            server.stop()
        self.redis.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def gunicorn_conf(conf: str) -> tuple[str, int, int]:
    """``"<worker class>:<workers>[x<threads>]"`` (e.g. ``gevent:2``, ``gthread:2x4``) ->
    (worker class, workers, threads); raises ValueError on another shape."""
    worker_class, _, size = conf.partition(":")
    workers, _, threads = size.partition("x")
    if not worker_class or not workers.isdigit() or (threads and not threads.isdigit()):
        raise ValueError(f"gunicorn config {conf!r} is not <worker class>:<workers>[x<threads>]")
    return worker_class, int(workers), int(threads or 1)


def wait_http(url: str, name: str, procs: Procs, post: bytes | None = None, timeout: float = 30) -> None:
    """Wait until ``url`` answers 200; raises RuntimeError with the process log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url, data=post, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        for n, proc in procs.procs:
            if n == name and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {procs.log_tail(name)}")
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not answer at {url} within {timeout}s: {procs.log_tail(name)}")


__all__ = ["Procs", "lmcache_python", "ping", "free_port"]
