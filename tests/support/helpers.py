"""Test helpers: free ports, waiting for eventual results, a sidecar in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

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


class SidecarThread:
    """A real Sidecar (real ZMQ sockets on loopback) running in a background thread."""

    def __init__(self, store: Store, *, reply: bool = True, **kwargs):
        self.pull_url = f"127.0.0.1:{free_port()}"
        self.reply_url = f"127.0.0.1:{free_port()}" if reply else None
        self.sidecar = Sidecar(store, self.pull_url, self.reply_url, **kwargs)
        self.thread = threading.Thread(target=self.sidecar.run, daemon=True)

    def __enter__(self) -> SidecarThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sidecar.stop()
        self.thread.join(5)


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
