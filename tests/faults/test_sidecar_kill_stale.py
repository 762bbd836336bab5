"""Issue 20 item 5: after ``kill -9`` of a sidecar nothing is silently wrong.

Real processes: a valkey, a ``python -m kvlookup sidecar`` (killed with SIGKILL and started
again with the same arguments), LMCache workers on real ZMQ sockets (kvlookup.devtools.workersim),
explain in process on the same Redis. The killed sidecar's ops in flight are lost; started again,
it marks every LMCache instance it owns *possibly stale* (explain says so, with when and why),
lookups keep answering them, and the mark goes when the instance heals: a heartbeating 0.5-era
worker is asked for a full sync at its next heartbeat; a 0.3-era worker's cold restart registers
it again. A sidecar stopped with SIGTERM drains and signs off: it marks nothing.
"""

from __future__ import annotations

import signal
import time

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys, staleness
from kvlookup.index.explain import Explainer
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import connect, free_port
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import wait_for
from tests.support.procs import SidecarProc

CPU = "LocalCPUBackend"


def _explain(client: Client) -> dict:
    answer = {k: list(v) for k, v in client.lookup(SEED_TOKENS)[1].items()}
    return Explainer(client).explain(SEED_TOKENS, answer)


def test_kill9_marks_unhealed_instances_possibly_stale_until_they_heal(own_redis):
    r = connect(own_redis.url)
    pull, reply = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sidecar = SidecarProc("--redis-url", own_redis.url, "--sidecar-id", "side-k", pull_url=pull, reply_url=reply)
    sidecar.start()
    old = WorkerSim("old-era", era="0.3", pull_url=pull)
    new = WorkerSim("new-era", era="0.5", pull_url=pull, reply_url=reply)
    client = Client(store=Store(r))
    try:
        old.register()
        assert new.register()["type"] == "RegisterRetMsg"
        for w in (old, new):
            w.admit([SEED_HASH])
        both = {"old-era": (CPU, 12), "new-era": (CPU, 12)}
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], both) == both
        sidecar.kill(signal.SIGKILL)
        killed = time.monotonic()
        sidecar.start()
        marked = wait_for(lambda: set(staleness.marks(r, ["old-era", "new-era"])), {"old-era", "new-era"})
        print(f"\nkill -9: both instances marked possibly stale {time.monotonic() - killed:.2f} s after the kill")
        assert marked == {"old-era", "new-era"}
        assert client.lookup(SEED_TOKENS)[1] == both  # still answered: what is there is most likely right
        out = _explain(client)
        stale = {e["instance_id"]: e["possibly_stale"] for e in out["instances"]}
        assert set(stale) == {"old-era", "new-era"}
        assert stale["old-era"]["reason"].startswith("sidecar side-k (pid ")
        assert "stopped without draining (killed?)" in stale["old-era"]["reason"]
        assert abs(stale["old-era"]["since_ms"] - client.store.clock.now_ms()) < 60_000
        assert any(line.startswith("instance old-era may be stale since ") for line in out["diagnosis"])

        # a heartbeating 0.5-era worker heals: the restarted sidecar asks it for a full sync
        reply_msg = new.heartbeat()
        assert [c["reason"] for c in reply_msg["commands"]] == ["controller_restart"]
        start, status = new.full_sync([SEED_HASH])
        assert start["accepted"] and status["is_complete"]
        assert set(staleness.marks(r, ["old-era", "new-era"])) == {"old-era"}
        # a 0.3-era worker heals by its cold restart: it registers again (a new epoch)
        old.register()
        old.admit([SEED_HASH])
        assert wait_for(lambda: staleness.marks(r, ["old-era", "new-era"]), {}) == {}
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], both) == both
        assert "possibly_stale" not in str(_explain(client)["instances"])

        # a SIGTERM drains and signs off: nothing is marked after it
        sidecar.kill(signal.SIGTERM)
        assert r.exists(keys.sidecar_status_key("side-k")) == 0
        sidecar.start()
        time.sleep(1.0)
        assert staleness.marks(r, ["old-era", "new-era"]) == {}
    finally:
        for w in (old, new):
            w.close()
        sidecar.kill()
