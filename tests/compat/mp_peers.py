"""Real LMCache MP peers for tests: the library-driven emitter (mp_emitter_driver.py), the real
coordinator (``python -m lmcache.v1.mp_coordinator``), the real CPU MP server, and a fan-out
proxy that hands the same HTTP traffic to kvlookup and to the real coordinator.

Every LMCache process runs with LMCACHE_TRACK_USAGE=false, DO_NOT_TRACK=1 and a scratch
NUMBA_CACHE_DIR / HOME / TMPDIR (the numba cache would otherwise land inside the venv).
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import requests

from kvlookup.proc.redis_server import free_port

HERE = Path(__file__).resolve().parent


def lmcache_env(scratch: str | None = None) -> dict:
    scratch = scratch or tempfile.mkdtemp(prefix="kvl-lmc-")
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "NUMBA_CACHE_DIR": scratch,
            "HOME": scratch, "TMPDIR": scratch, "PYTHONUNBUFFERED": "1"}


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, wait: float = 15) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class Emitter:
    """The real CacheEventSubscriber + HttpCacheEventSink + keep_registered, one op at a time."""

    def __init__(self, python: str, url: str, instance_id: str, incarnation: int, *args: str):
        cmd = [python, str(HERE / "mp_emitter_driver.py"), "--url", url, "--instance-id", instance_id,
               "--incarnation", str(incarnation), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=lmcache_env(), start_new_session=True)
        ready = self._read()
        assert ready == {"event": "ready"}, ready

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"emitter exited with {self.proc.poll()}")
            if line.startswith("{"):
                return json.loads(line)

    def op(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self._read()
            self.proc.wait(15)

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)


class Coordinator:
    """``python -m lmcache.v1.mp_coordinator`` on a free port; ``.url``."""

    def __init__(self, python: str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1", "--port", str(self.port),
               "--chunk-size", "256", *args]
        self.log = tempfile.NamedTemporaryFile(prefix="kvl-coord-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env=lmcache_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.2)
        raise TimeoutError("coordinator did not answer /healthz")

    def stop(self) -> None:
        _stop(self.proc)


class FanOut:
    """An HTTP proxy: every request goes to ``primary``, whose answer the client gets, and then,
    in arrival order on one thread, to each of ``mirrors`` (so a slow mirror, e.g. a coordinator
    compiling its blend index, never times out the emitter). ``drain()`` waits for the mirrors;
    ``.log`` lists (method, path, [statuses]) once mirrored."""

    def __init__(self, primary: str, *mirrors: str):
        import queue

        self.primary, self.mirrors = primary, list(mirrors)
        self.log: list[tuple[str, str, list[int]]] = []
        self.queue: queue.Queue = queue.Queue()
        proxy = self

        class FanOutHandler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                first = requests.request(self.command, proxy.primary + self.path, data=body, headers=headers,
                                         timeout=10)
                proxy.queue.put((self.command, self.path, body, headers, first.status_code))
                self.send_response(first.status_code)
                self.send_header("Content-Type", first.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(first.content)))
                self.end_headers()
                self.wfile.write(first.content)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), FanOutHandler)  # one request at a time: order kept
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._mirror, daemon=True).start()

    def _mirror(self) -> None:
        while True:
            method, path, body, headers, status = self.queue.get()
            try:
                got = [requests.request(method, m + path, data=body, headers=headers, timeout=120).status_code
                       for m in self.mirrors]
            except requests.RequestException:
                got = [-1]
            self.log.append((method, path, [status, *got]))
            self.queue.task_done()

    def drain(self) -> None:
        self.queue.join()

    def stop(self) -> None:
        self.drain()
        self.server.shutdown()
        self.server.server_close()


class MPServer:
    """The real CPU MP server (``python -m lmcache.v1.multiprocess.http_server``) reporting to ``coordinator_url``."""

    def __init__(self, python: str, coordinator_url: str, instance_id: str, chunk_size: int = 256):
        self.port, self.http_port = free_port(), free_port()
        cmd = [python, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--instance-id", instance_id,
               "--chunk-size", str(chunk_size), "--l1-size-gb", "1", "--l1-init-size-gb", "1",
               "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
               "--coordinator-url", coordinator_url, "--coordinator-advertise-ip", "127.0.0.1",
               "--coordinator-heartbeat-interval", "1", "--coordinator-event-reporting",
               "--coordinator-event-flush-interval", "0.5",
               "--l2-adapter", json.dumps({"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10})]
        self.log = tempfile.NamedTemporaryFile(prefix="kvl-mpserver-", suffix=".log", delete=False)
        self.python = python
        self.proc = subprocess.Popen(cmd, env=lmcache_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"MP server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                requests.get(f"http://127.0.0.1:{self.http_port}/healthz", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.5)
        raise TimeoutError("MP server did not answer")

    def bench(self, tp: int = 2, tokens: int = 512, start: int = 0, end: int = 2) -> subprocess.CompletedProcess:
        """``lmcache bench server --mode cpu --transfer-mode engine_driven`` against this server."""
        cmd = [self.python, "-m", "lmcache.cli.main", "bench", "server", "--mode", "cpu", "--transfer-mode",
               "engine_driven", "--rpc-url", f"tcp://127.0.0.1:{self.port}", "--url",
               f"http://127.0.0.1:{self.http_port}", "--tp-size", str(tp), "--num-tokens", str(tokens),
               "--kvcache-shape-spec", "(2,64,16,8,128):float16:4", "--start", str(start), "--end", str(end)]
        return subprocess.run(cmd, env=lmcache_env(), capture_output=True, text=True, timeout=300)

    def stop(self) -> None:
        _stop(self.proc)
