"""Test helpers: waiting for eventual results (one place for every wait), a sidecar in a thread,
the index as the chunk sorted sets say."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from kvlookup.index.store import Store
from kvlookup.proc.redis_server import free_port
from kvlookup.sidecar.service import Sidecar


def wait_for(fn: Callable[[], Any], expected: Any, timeout: float = 10.0) -> Any:
    """Poll ``fn`` until it returns ``expected``; returns the last value (assert on it)."""
    deadline = time.monotonic() + timeout
    value = fn()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        value = fn()
    return value


def until(fn: Callable[[], Any], timeout: float = 10.0, step: float = 0.02) -> float:
    """Seconds until ``fn()`` is true; raises TimeoutError after ``timeout``."""
    start = time.monotonic()
    while not fn():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not true within {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def wait(fn: Callable[[], Any], timeout: float, what: str) -> float:
    """:func:`until` polling every 20 ms, failing the test (AssertionError naming ``what``)
    instead of raising TimeoutError."""
    try:
        return until(fn, timeout, step=0.02)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout} s") from None


def wait_http_200(url: str, proc=None, timeout: float = 40.0) -> float:
    """Seconds until GET ``url`` answers 200; AssertionError when ``proc`` (a Popen) exits first,
    TimeoutError after ``timeout``."""
    import requests

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        assert proc is None or proc.poll() is None, f"the process serving {url} exited"
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never answered 200 within {timeout} s")


def stop_group(proc, timeout: float = 20.0) -> None:
    """SIGTERM a Popen started with ``start_new_session`` (its whole process group), SIGKILL
    after ``timeout``."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def wait_until(fn: Callable[[], bool], timeout: float, every: float = 0.2) -> float | None:
    """Seconds until ``fn()`` was true (None: not within ``timeout``); Redis, OS and lookup
    errors count as false (a failover in progress)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if fn():
                return time.monotonic() - t0
        except (redis.RedisError, OSError, LookupError):
            pass
        time.sleep(every)
    return None


class SidecarThread:
    """A real Sidecar (real ZMQ sockets on loopback) running in a background thread.

    Its LMCache PULL socket is on ``pull_url`` (a free port by default; None: no PULL socket),
    its ROUTER on a free port unless ``reply=False``; ``kwargs`` go to Sidecar (``vllm=``
    sources, ``heartbeat_s`` ...). Use it as a context manager, or :meth:`start` and :meth:`close`."""

    def __init__(self, store: Store, *, reply: bool = True, pull_url: str | None | bool = True, **kwargs):
        self.pull_url = f"127.0.0.1:{free_port()}" if pull_url is True else pull_url or None
        self.reply_url = f"127.0.0.1:{free_port()}" if reply else None
        self.sidecar = Sidecar(store, self.pull_url, self.reply_url, **kwargs)
        self.thread = threading.Thread(target=self.sidecar.run, daemon=True)

    def start(self, settle_s: float = 0.0) -> SidecarThread:
        """Start the thread; wait ``settle_s`` (SUB sockets connecting: a PUB drops what it sends before)."""
        self.thread.start()
        time.sleep(settle_s)
        return self

    def ingest(self, instance_id: str):
        """The vLLM ingest of ``instance_id``."""
        return self.sidecar.vllm.ingests[instance_id]

    def close(self) -> None:
        self.sidecar.stop()
        self.thread.join(5)

    def __enter__(self) -> SidecarThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_sidecar(r, *sources, pull_url: str | None = None) -> SidecarThread:
    """A started Sidecar with vLLM ``sources`` (and optionally an LMCache PULL socket), no
    ROUTER, heartbeats every 0.5 s, its SUB sockets given 0.2 s to connect."""
    return SidecarThread(Store(r), reply=False, pull_url=pull_url, vllm=sources, heartbeat_s=0.5).start(settle_s=0.2)


def index_view(r, hashes) -> dict[tuple[str, str], set[int]]:
    """What the index says each live holder holds among ``hashes``: (instance, location) ->
    chunk hashes, read straight from the chunk sorted sets (retired holders left out)."""
    from kvlookup.index import keys
    hashes = list(hashes)
    pipe = r.pipeline(transaction=False)
    for h in hashes:
        pipe.zrange(keys.chunk_key(h), 0, -1)
    members = pipe.execute()
    dead = set(r.zrange(keys.dead_holders_key(), 0, -1))
    desc = r.hgetall(keys.holders_key())
    out: dict[tuple[str, str], set[int]] = {}
    for h, hids in zip(hashes, members, strict=True):
        for hid in hids:
            if hid in desc and hid not in dead:
                inst, _wid, loc, _space = keys.parse_holder(desc[hid])
                out.setdefault((inst, loc), set()).add(h)
    return out


def chunk_holders(r, key: str) -> set[str]:
    """The holder ids of one chunk sorted set, after checking its digest member
    (kvlookup.index.keys.CHUNK_DIGEST_MEMBER): first, with score ``-1 - set_digest(holders)``,
    exactly when the set has two holders or more."""
    from kvlookup.index import keys
    raw = r.zrange(key, 0, -1, withscores=True)
    holders = [m for m, _s in raw if m != keys.CHUNK_DIGEST_MEMBER]
    if len(holders) >= 2:
        assert raw[0] == (keys.CHUNK_DIGEST_MEMBER, -1 - keys.set_digest(holders)), (key, raw)
    else:
        assert len(raw) == len(holders), (key, raw)
    return set(holders)


def command_calls(r) -> dict[str, int]:
    """Calls per command name (``INFO commandstats``, lower case: ``evalsha``, ``zrange``) summed
    over every master of ``r`` (one server, or each primary of a cluster)."""
    nodes = r.get_primaries() if hasattr(r, "get_primaries") else [None]
    out: dict[str, int] = {}
    for node in nodes:
        info = r.info("commandstats", **({"target_nodes": node} if node else {}))
        if node is not None and len(info) == 1 and isinstance(only := next(iter(info.values())), dict):
            info = only
        for k, v in info.items():
            if k.startswith("cmdstat_"):
                out[k[8:]] = out.get(k[8:], 0) + int(v["calls"])
    return out
