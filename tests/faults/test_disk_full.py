"""Issue 20 item 11: the disk under Redis's AOF fills up.

A real valkey whose file writes are capped (``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored: a write
past the cap fails with EFBIG, as one on a full disk fails with ENOSPC; valkey then refuses every
write with ``MISCONF``), a real sidecar owning quiet LMCache instances (registered, never
heartbeating: only its lease renewals keep them alive, and those are writes), a real
``kvlookup reap --loop`` and a real controller. While the disk is full: every lookup answers
200 with every instance (a lease cannot be renewed, so its lapse is not evidence), ``/health``
says ``disk_full``. When the cap is lifted (``prlimit`` on the running server: space freed),
valkey writes again, ``/health`` is 200 and ingest resumes.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect, find_server_binary
from tests.conftest import SEED_TOKENS
from tests.faults.test_world_faults import TTL_S, _fleet, _reaper, _sidecar, _stop
from tests.support.procs import ControllerProc

CAP_KIB = 1024  # the AOF's file size cap while the "disk" is full (bash ulimit -f: KiB)


def _capped_binary(tmp: Path) -> str:
    """A valkey launcher whose files cannot grow past CAP_KIB (bash's ``ulimit -S -f``: the soft
    limit, so it can be lifted), with SIGXFSZ ignored so a write past the cap fails (EFBIG)
    instead of killing the server."""
    path = tmp / "capped-valkey"
    path.write_text(f"#!/bin/bash\nulimit -S -f {CAP_KIB}\ntrap '' XFSZ\nexec {find_server_binary()} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture()
def server(tmp_path):
    srv = EmbeddedRedis(tmp_path / "redis", appendonly=True, binary=_capped_binary(tmp_path))
    srv.start()
    yield srv
    srv.stop()


def _health(ctl: ControllerProc) -> tuple[int, dict]:
    resp = ctl.session.get(f"{ctl.http}/health", timeout=5)
    return resp.status_code, resp.json()["components"]


def test_a_full_disk_keeps_every_answer_and_health_says_so(server, tmp_path):
    r = connect(server.url)
    store = Store(r, instance_ttl_s=TTL_S)
    fleet = {"side-a": ["a0", "a1", "a2"]}
    sidecar = _sidecar(server.url, "side-a").start()
    _fleet(store, fleet)
    reaper = _reaper(server.url, tmp_path / "reap.log")
    ctl = ControllerProc("--redis-url", server.url, "--instance-ttl", str(TTL_S), "--workers", "1").wait_ready()
    everyone = {"a0": ["LocalCPUBackend", 12], "a1": ["LocalCPUBackend", 12], "a2": ["LocalCPUBackend", 12]}
    try:
        assert ctl.layout(SEED_TOKENS) == everyone
        r.set("filler", "x" * (2 * CAP_KIB * 1024))  # applied in memory; its AOF write crosses the cap
        time.sleep(1.5)  # the AOF is written within a second (appendfsync everysec)
        with pytest.raises(Exception, match="MISCONF"):
            r.set("probe", "1")
        assert _health(ctl)[1]["redis writes"]["disk_full"] is True
        start, statuses, wrong = time.monotonic(), {}, []
        while time.monotonic() - start < 3 * TTL_S:  # every lease would have lapsed twice over
            resp = ctl.session.post(f"{ctl.http}/lookup", json={"tokens": SEED_TOKENS}, timeout=10)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            if resp.status_code == 200 and {k: v for k, v in resp.json().items() if k != "event_id"} != everyone:
                wrong.append(resp.json())
            time.sleep(0.05)
        assert list(statuses) == [200] and wrong == []
        status, components = _health(ctl)
        writes = components.pop("redis writes")
        assert status == 503 and writes["state"] == "down" and writes["disk_full"] is True
        assert writes["error"].startswith("MISCONF")
        assert components["redis"]["state"] == "up", components  # it answers reads

        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        freed, back = time.monotonic(), None
        while back is None or time.monotonic() - back < 5:  # and the sidecar renews again
            assert ctl.layout(SEED_TOKENS) == everyone
            if back is None and _health(ctl)[0] == 200:
                back = time.monotonic()
            assert time.monotonic() - freed < 10, _health(ctl)
            time.sleep(0.05)
        print(f"\ndisk full for {3 * TTL_S:.0f} s: {sum(statuses.values())} lookups, all 200 and exact; "
              f"writes back {back - freed:.2f} s after the space was freed, answers exact throughout")
        assert r.get("filler") is not None
        assert all(r.zscore(keys.alive_key(), i) > store.clock.now_ms() for i in everyone)  # renewed again
    finally:
        ctl.stop()
        _stop([sidecar, reaper])
