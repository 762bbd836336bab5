"""Issue 20 item 10: one writer per instance, wherever a write names it.

The first sidecar to write for an instance owns it while its lease holds (keys.owners_key):
every other sidecar (the controller's embedded one too) refuses its registration, heartbeat,
full sync, admits, evicts and deregistration, a sidecar started with ``--instance-id`` for it
takes nothing, and the LMCache MP coordinator paths (controller and ``--mp-listen``) answer
409. The other way round, an instance registered through the MP coordinator is refused by
every sidecar until it deregisters. ``--shared-instance-ownership`` lets several sidecars serve
one instance. Real sidecar and controller processes, real ZMQ and HTTP, real Redis.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import requests

from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache as proto
from tests.faults.test_instance_claims import CPU, HASHES, _push, _records, _request
from tests.faults.test_instance_claims import _sidecar as _claims_sidecar
from tests.index.test_mp_index import C0, batch, entry
from tests.support.helpers import wait_for
from tests.support.procs import ControllerProc

OWNED = ("instance 'inst' is owned by sidecar 'A' (the first to write for it); no other process takes writes for "
         "it while that sidecar runs (shared_instance_ownership on every sidecar of the instance allows several)")
MP_HELD = ("instance 'mpi' is registered through the LMCache MP coordinator; no sidecar takes writes for it until "
           "it deregisters or times out")


def _sidecar(redis_args, sid: str, *args: str):
    """A real sidecar; a worker whose REQ socket closed stays registered for the test (grace 120 s)."""
    return _claims_sidecar(redis_args, sid, "--disconnect-grace", "120", *args)


def _register(url: str, inst: str, worker: int = 0) -> dict:
    return _request(url, proto.RegisterMsg(inst, worker, "127.0.0.1", 0, None))


def _metric(proc, reason: str, source: str = "lmcache") -> float:
    for line in proc.metrics().splitlines():
        if line.startswith("kvlookup_rejected_frames_total{") and f'reason="{reason}"' in line \
                and f'source="{source}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_first_sidecar_to_write_owns_the_instance_until_it_stops(r, redis_args):
    a = _sidecar(redis_args, "A")
    b = _sidecar(redis_args, "B")
    try:
        assert _register(a.reply_url, "inst")["type"] == "RegisterRetMsg"
        _push(a.pull_url, *[proto.KVAdmitMsg("inst", 0, h, CPU) for h in HASHES])
        assert wait_for(lambda: _records(r, "inst"), len(HASHES)) == len(HASHES)
        holder = r.hget(keys.worker_key("inst", 0), f"loc:{CPU}")

        # a hostile peer through B: registration, heartbeat, full sync, a new worker -> ErrorMsg
        assert _register(b.reply_url, "inst") == {"type": "ErrorMsg", "error": OWNED}
        assert _register(b.reply_url, "inst", 1) == {"type": "ErrorMsg", "error": OWNED}
        hb = proto.HeartbeatMsg("inst", 0, "127.0.0.1", 0, None)
        assert _request(b.reply_url, hb) == {"type": "ErrorMsg", "error": OWNED}
        sync = proto.FullSyncStartMsg("inst", 0, CPU, "s1", 0, 0)
        assert _request(b.reply_url, sync) == {"type": "ErrorMsg", "error": OWNED}
        _push(b.pull_url, proto.KVEvictMsg("inst", 0, HASHES[0], CPU), proto.DeRegisterMsg("inst", 0, "127.0.0.1", 0))
        assert wait_for(lambda: _metric(b, "instance_owned"), 6.0) == 6.0
        time.sleep(0.5)  # whatever B's loop was going to write is written
        assert r.hget(keys.worker_key("inst", 0), "epoch") == "1"
        assert r.hget(keys.worker_key("inst", 0), f"loc:{CPU}") == holder
        assert not r.exists(keys.worker_key("inst", 1))
        assert r.hget(keys.owners_key(), "inst") == "A"
        assert _records(r, "inst") == len(HASHES)

        a.kill()  # kill -9 and a restart with the same identity: still A's
        a.start()
        assert _register(a.reply_url, "inst")["type"] == "RegisterRetMsg"
        assert _register(b.reply_url, "inst")["type"] == "ErrorMsg"

        a.stop()  # a clean stop signs off: B may take the instance at once (its answer is cached <= 1 s)
        start = time.monotonic()
        assert wait_for(lambda: _register(b.reply_url, "inst")["type"], "RegisterRetMsg", timeout=10) \
            == "RegisterRetMsg"
        took = time.monotonic() - start
        print(f"taken over {took:.2f} s after the owner's clean stop")
        assert took < 3
        assert r.hget(keys.owners_key(), "inst") == "B"
    finally:
        a.kill()
        b.stop()


def test_shared_instance_ownership_lets_sidecars_serve_one_instance_together(r, redis_args):
    a = _sidecar(redis_args, "A", "--shared-instance-ownership")
    b = _sidecar(redis_args, "B", "--shared-instance-ownership")
    c = _sidecar(redis_args, "C")  # not shared: refused while a live sidecar owns it
    try:
        assert _register(a.reply_url, "multi", 0)["type"] == "RegisterRetMsg"
        assert _register(b.reply_url, "multi", 1)["type"] == "RegisterRetMsg"
        _push(a.pull_url, proto.KVAdmitMsg("multi", 0, HASHES[0], CPU))
        _push(b.pull_url, proto.KVAdmitMsg("multi", 1, HASHES[0], CPU))
        both = lambda: sorted(r.hget(keys.worker_key("multi", w), "epoch") or "" for w in (0, 1))  # noqa: E731
        assert wait_for(both, ["1", "1"]) == ["1", "1"]
        assert _register(c.reply_url, "multi", 2)["type"] == "ErrorMsg"
    finally:
        for s in (a, b, c):
            s.stop()


def test_a_sidecar_pinned_to_another_sidecars_instance_takes_nothing(r, redis_args):
    a = _sidecar(redis_args, "A", "--allowed-instance-ids", "prot")
    assert _register(a.reply_url, "prot")["type"] == "RegisterRetMsg"
    assert _register(a.reply_url, "inst")["type"] == "ErrorMsg"  # not in A's list
    b = _sidecar(redis_args, "B")
    assert _register(b.reply_url, "inst")["type"] == "RegisterRetMsg"
    # pinned to A's claimed instance and to B's first-written one
    p = _sidecar(redis_args, "P", "--instance-id", "prot")
    q = _sidecar(redis_args, "Q", "--instance-id", "inst")
    try:
        assert _metric(p, "instance_claimed", "sidecar") == 1.0
        assert _metric(q, "instance_owned", "sidecar") == 1.0
        time.sleep(1.5)  # a lease renewal of each
        assert r.hgetall(keys.owners_key()) == {"prot": "A", "inst": "B"}
        assert not r.smembers(keys.sidecar_instances_key("P")) and not r.smembers(keys.sidecar_instances_key("Q"))
        assert _register(p.reply_url, "prot")["type"] == "ErrorMsg"
        for msg in (proto.HeartbeatMsg("prot", 0, "127.0.0.1", 0, None),
                    proto.FullSyncStartMsg("prot", 0, CPU, "s", 0, 0)):
            assert _request(p.reply_url, msg)["type"] == "ErrorMsg"
        _push(p.pull_url, proto.KVEvictMsg("prot", 0, 7, CPU), proto.DeRegisterMsg("prot", 0, "127.0.0.1", 0))
        assert wait_for(lambda: _metric(p, "instance_claimed"), 5.0) == 5.0
        assert _register(q.reply_url, "inst") == {"type": "ErrorMsg", "error": OWNED.replace("'A'", "'B'")}
        assert r.hget(keys.worker_key("prot", 0), "epoch") == "1"
        assert r.hget(keys.worker_key("inst", 0), "epoch") == "1"
    finally:
        for s in (a, b, p, q):
            s.stop()


def _mp_process(redis_args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "sidecar", *redis_args, "--mp-listen",
                             f"127.0.0.1:{port}", "--log-level", "WARNING"], start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(base + "/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    assert wait_for(up, True, timeout=30)
    return proc, base


def test_mp_coordinator_and_sidecars_keep_off_each_others_instances(r, redis_args):
    a = _sidecar(redis_args, "A", "--allowed-instance-ids", "prot,inst")
    b = _sidecar(redis_args, "B")
    mp, base = _mp_process(redis_args)
    ctl = ControllerProc(*redis_args, "--workers", "1").wait_ready()
    try:
        assert _register(a.reply_url, "inst")["type"] == "RegisterRetMsg"
        assert _register(b.reply_url, "own2")["type"] == "RegisterRetMsg"
        for url in (base, ctl.http):  # the standalone MP process and the controller
            for inst, who in (("prot", "belongs to sidecar 'A' (its allowed_instance_ids names it)"),
                              ("inst", "belongs to sidecar 'A'"), ("own2", "is owned by sidecar 'B'")):
                got = requests.post(url + "/instances", json={"instance_id": inst, "ip": "127.0.0.1", "http_port": 1})
                assert got.status_code == 409 and who in got.json()["error"], got.text
                got = requests.put(f"{url}/instances/{inst}/heartbeat")
                assert got.status_code == 409, got.text
                got = requests.post(url + "/events", json={"batches": [batch(1, inst=inst, entries=[entry(C0)])]})
                assert got.status_code == 409, got.text
        assert r.hlen(keys.mp_instances_key()) == 0 and r.zcard(keys.mp_held_key()) == 0
        assert r.hget(keys.worker_key("inst", 0), "epoch") == "1"
        assert r.hget(keys.owners_key(), "own2") == "B"

        # the other way round: an MP registration keeps every sidecar off its id
        reg = {"instance_id": "mpi", "ip": "127.0.0.1", "http_port": 1}
        assert requests.post(base + "/instances", json=reg).json() == {"instance_id": "mpi", "re_registered": False}
        assert requests.post(base + "/events", json={"batches": [batch(1, inst="mpi", entries=[entry(C0)])]}
                             ).json() == {"applied": 1, "duplicates": 0, "stale": 0}
        assert _register(b.reply_url, "mpi") == {"type": "ErrorMsg", "error": MP_HELD}
        assert not r.exists(keys.worker_key("mpi", 0))
        assert requests.delete(ctl.http + "/instances/mpi").status_code == 204  # deregistered: the id is free
        assert wait_for(lambda: _register(b.reply_url, "mpi")["type"], "RegisterRetMsg", timeout=5) \
            == "RegisterRetMsg"
        assert r.hget(keys.owners_key(), "mpi") == "B"
    finally:
        mp.terminate()
        mp.wait(15)
        ctl.stop()
        a.stop()
        b.stop()


def test_the_controllers_embedded_sidecar_refuses_another_sidecars_instance(r, redis_args):
    a = _sidecar(redis_args, "A")
    pull, reply = free_port(), free_port()
    ctl = ControllerProc(*redis_args, "--workers", "1", "--monitor-ports",
                         json.dumps({"pull": pull, "reply": reply})).wait_ready()
    try:
        assert _register(a.reply_url, "inst")["type"] == "RegisterRetMsg"
        assert _register(f"127.0.0.1:{reply}", "inst") == {"type": "ErrorMsg", "error": OWNED}
        assert _register(f"127.0.0.1:{reply}", "other")["type"] == "RegisterRetMsg"
        assert r.hgetall(keys.owners_key())["inst"] == "A"
    finally:
        ctl.stop()
        a.stop()


def test_a_vllm_sidecar_for_another_sidecars_instance_writes_nothing_until_it_is_free(r, redis_args):
    from kvlookup.client import Client, VllmChains
    from tests.support.vllm_helpers import LoopbackPublisher, layout, payload, stored

    tokens = list(range(1000, 1032))
    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])
    a = _sidecar(redis_args, "A")
    assert _register(a.reply_url, "inst")["type"] == "RegisterRetMsg"  # A wrote for it first
    pub = LoopbackPublisher()
    v = _sidecar(redis_args, "V", "--instance-id", "inst", "--vllm-endpoint", pub.endpoint,
                 "--vllm-replay-endpoint", pub.replay_endpoint)
    try:
        assert wait_for(lambda: _metric(v, "instance_owned", "sidecar"), 1.0) == 1.0  # its pin was refused
        for _ in range(3):
            pub.publish(payload(stored([1, 2], tokens)))
        assert wait_for(lambda: _metric(v, "instance_owned", "vllm") >= 3, True) is True
        assert layout(client, tokens) == {}  # nothing of V's written: A's worker has no records
        assert r.hget(keys.worker_key("inst", 0), "epoch") == "1"
        assert r.hget(keys.owners_key(), "inst") == "A"

        a.stop()  # A signs off: the instance is free, V takes it at its next batch and rebuilds from replay
        start = time.monotonic()

        def answer() -> dict:
            pub.publish(payload(stored([3], tokens[:16])))
            time.sleep(0.2)
            return layout(client, tokens)

        assert wait_for(answer, {"inst": ("GPU", 32)}, timeout=10) == {"inst": ("GPU", 32)}
        print(f"vLLM sidecar took the instance {time.monotonic() - start:.1f} s after the owner's stop")
        assert r.hget(keys.owners_key(), "inst") == "V"
    finally:
        v.stop()
        a.kill()
        pub.close()
