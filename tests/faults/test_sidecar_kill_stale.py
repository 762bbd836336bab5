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
from tests.support.helpers import until, wait_for
from tests.support.procs import SidecarProc
from tests.support.vllm_helpers import LoopbackPublisher

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



def test_a_vllm_sidecar_restarted_with_another_instance_lets_the_old_one_go(r, redis_args, tmp_path):
    """A vLLM sidecar killed, then started on the same endpoint (so the same default sidecar id)
    with another ``--instance-id``: it resumes only what it serves. The old instance leaves its
    set and the owners hash and its lease is not renewed again, so lookups stop counting it once
    it lapses (a newcomer found pod-v answering lookups minutes after its server was gone)."""
    pub = LoopbackPublisher()
    args = [*redis_args, "--instance-ttl", "2", "--vllm-endpoint", pub.endpoint,
            "--vllm-replay-endpoint", pub.replay_endpoint]
    first = SidecarProc(*args, "--instance-id", "pod-v").start()
    until(lambda: r.hget(keys.owners_key(), "pod-v"))
    sidecar_id = r.hget(keys.owners_key(), "pod-v")
    first.kill()
    second = SidecarProc(*args, "--instance-id", "pod-w", log=tmp_path / "second.log").start()
    try:
        assert wait_for(lambda: r.smembers(keys.sidecar_instances_key(sidecar_id)), {"pod-w"}) == {"pod-w"}
        assert (r.hget(keys.owners_key(), "pod-v"), r.hget(keys.owners_key(), "pod-w")) == (None, sidecar_id)
        assert second.lines("no longer serving pod-v")
        lease, renewed = r.zscore(keys.alive_key(), "pod-v"), r.zscore(keys.alive_key(), "pod-w")
        time.sleep(2.5)  # past pod-v's lease (instance_ttl 2 s); the sidecar renews every ~0.7 s
        assert r.zscore(keys.alive_key(), "pod-v") in (lease, None)  # never renewed again: lapsed
        assert r.zscore(keys.alive_key(), "pod-w") > renewed
    finally:
        second.kill()
