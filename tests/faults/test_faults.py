"""Fault injection on the LMCache drop-in deployment, under steady ingest and lookups.

One deployment for the whole module (tests.support.dropin.Deployment), as shipped by default: ``kvlookup controller
--monitor-ports`` (embedded Redis in its own data dir, embedded sidecar, 2 gunicorn workers,
``--instance-ttl 5``) and one standalone ``kvlookup sidecar`` sharing that embedded Redis. Engines
(simulated LMCache workers speaking the real protocol): 0.5-era engines heartbeating every 0.5 s
and obeying full syncs, spread over both sidecars, with steady random stores and evicts; quiet
0.3-era engines registered with chunks and then silent. Lookups POST /lookup every 20 ms.

Each scenario kills (SIGKILL) or restarts (SIGTERM) a real process, or sends a maximal frame or
a flood, asserts how long recovery took, then pauses the traffic and asserts EXACT convergence:
the chunk sorted sets hold what the engines hold (tests.support.helpers.index_view), every known prompt's
lookup is what the engines' truth implies, and the quiet instances kept every record. Lookups
that answered are checked too: they never reported a quiet instance wrongly.

Run with ``-s`` for the figures (``[faults] ...`` lines, and a table at the end);
docs/operations.md, "Fault injection: measured", has them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvlookup.index import keys
from kvlookup.proc.embedded import served_by
from kvlookup.proc.redis_server import ping, port_free
from kvlookup.sidecar.sockets import Limits
from kvlookup.wire import lmcache as proto
from tests.support.dropin import CPU, FIGURES, PROFILE, Deployment, health_summary, max_sync_keys, record
from tests.support.helpers import wait
from tests.support.procs import ROOT, children, log_lines, memory_mb
from tests.support.procs_embedded import alive, servers_of
from tests.support.samplers import Sampler, lease_margin_s, lowest_and_renewed, outage_of_health, purge_time

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("faults"))
    t0 = time.monotonic()
    try:
        d.start()
        record("setup", start_s=time.monotonic() - t0, universe=len(d.universe))
        yield d
    finally:
        ops, answers = (d.traffic.ops, d.lookups.answers) if hasattr(d, "lookups") else (0, [])
        d.close()
        took = sorted(a.ended - a.started for a in answers if a.status == 200) or [0.0]
        record("total", seconds=time.monotonic() - t0, chunk_ops=ops, lookups=len(answers),
               lookup_p50_ms=1000 * took[len(took) // 2], lookup_p99_ms=1000 * took[len(took) * 99 // 100])
        FIGURES.print_table()


@pytest.fixture()
def fresh(dep):
    """The deployment, running, with steady traffic for a moment before the fault."""
    dep.ensure_running()
    dep.steady(1.0)
    return dep


def test_1_kill9_of_the_embedded_redis_heals_exactly(fresh):
    d = fresh
    old = served_by(d.data)["server_pid"]
    assert servers_of(d.data) == [old]
    url = (d.data / "redis.url").read_text().strip()
    canary_chain = PROFILE.chunk_hashes([7, 7, 7] + list(range(200)))  # not in any prompt
    d.universe = sorted(set(d.universe) | set(canary_chain))
    d.canary.store(canary_chain)
    wait(lambda: d.canary.holder(d.r) is not None, 5, "canary holder")
    hid = d.canary.holder(d.r)
    wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == len(canary_chain), 5, "canary written")
    journaled = [len(log_lines(p, "failover: wrote the ops")) for p in (d.sidecar.log, d.controller.log)]
    health = Sampler(lambda: health_summary(d.controller), 0.02)
    killed = time.monotonic()  # well within a second of the canary's acknowledged writes
    os.kill(old, signal.SIGKILL)
    back = wait(lambda: ping(url) and (served_by(d.data) or {}).get("server_pid") not in (None, old), 10,
                "valkey-server restarted")
    pipe = d.r.pipeline(transaction=False)  # before the sidecars heal (their master watch looks once a second)
    for h in canary_chain:
        pipe.zscore(keys.chunk_key(h), hid)
    canary_lost = sum(s is None for s in pipe.execute())
    wait(lambda: any(t > killed and v[0] == 200 and v[1] not in (None, old) for t, v in health.samples), 10,
         "/health 200 naming the new server")
    health.stop()
    h = outage_of_health(health.samples, killed, lambda v: v[0] == 200)
    wait(lambda: all(e.synced_since(killed) for e in d.active), 10, "full syncs of every 0.5 engine")
    synced_s = time.monotonic() - killed
    wait(lambda: [len(log_lines(p, "failover: wrote the ops")) for p in (d.sidecar.log, d.controller.log)] ==
         [n + 1 for n in journaled], 5, "both sidecars rewrote their journal once")
    rewritten = [log_lines(p, "failover: wrote the ops")[-1].rsplit("(", 1)[1].split(")")[0]
                 for p in (d.sidecar.log, d.controller.log)]
    end = d.steady(1.0)
    out = d.lookups.recovery(killed, end)
    record("1 kill -9 valkey-server", server_back_s=back, health_503_after_s=h["first_503_s"],
           health_200_s=h["healthy_s"], first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"],
           statuses=out["statuses"], acked_records_missing_at_restart=canary_lost,
           journal_ops_rewritten="+".join(rewritten), full_syncs_done_s=synced_s)
    assert back < 2.0 and h["healthy_s"] is not None and h["healthy_s"] < 5.0 and h["between"] == [503]
    assert out["answered_again_s"] is not None and out["answered_again_s"] < 5.0 and out["statuses"] == [503]
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("1 kill -9 valkey-server")  # the canary included: its records are all there
    assert all(d.r.zscore(keys.chunk_key(h), hid) is not None for h in canary_chain)


def test_2_kill9_of_the_standalone_sidecar_then_a_start_converges_exactly(fresh):
    d = fresh
    std = [e for e in d.active if "-std-" in e.name]
    killed = time.monotonic()
    d.sidecar.kill(signal.SIGKILL)
    restart_s = d.sidecar.start().ready_s
    wait(lambda: all(e.synced_since(killed) for e in std), 10, "full syncs of the standalone sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    out = d.lookups.recovery(killed, end)
    record("2 kill -9 standalone sidecar", back_s=restart_s, full_syncs_done_s=synced_s,
           failed_lookups=out["failed"], longest_without_answer_s=out["longest_without_answer_s"])
    assert restart_s < 5.0 and synced_s < 8.0
    assert out["failed"] == 0  # the controller and its Redis never noticed
    assert {reason for e in std for at, reason in e.syncs if at > killed} == {"controller_restart"}
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("2 kill -9 standalone sidecar")


def test_3_kill9_of_the_embedded_sidecar_is_restarted_by_the_supervisor(fresh):
    d = fresh
    emb = [e for e in d.active if "-emb-" in e.name]
    old = d.controller.health()[1]["components"]["embedded_sidecar"]["pid"]
    assert old in children(d.controller.proc.pid)
    health = Sampler(lambda: health_summary(d.controller), 0.02)
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait(lambda: any(t > killed and v[0] == 200 and v[2] not in (None, old) for t, v in health.samples), 10,
         "/health 200 with a new embedded sidecar")
    health.stop()
    h = outage_of_health(health.samples, killed, lambda v: v[0] == 200 and v[2] not in (None, old) and v[3] == "up")
    new = d.controller.health()[1]["components"]["embedded_sidecar"]
    wait(lambda: all(e.synced_since(killed) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    out = d.lookups.recovery(killed, end)
    record("3 kill -9 embedded sidecar", health_503_after_s=h["first_503_s"], back_s=h["healthy_s"],
           restarts=new["restarts"], full_syncs_done_s=synced_s, failed_lookups=out["failed"])
    assert h["first_503_s"] < 1.0 and h["healthy_s"] < 5.0 and h["between"] == [503]  # 503 until it is back
    assert new["pid"] in children(d.controller.proc.pid) and new["state"] == "up"
    assert out["failed"] == 0
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("3 kill -9 embedded sidecar")


def test_4_kill9_of_a_gunicorn_worker_leaves_the_other_answering(fresh):
    d = fresh
    workers = d.controller.workers()
    assert len(workers) == 2, workers
    killed = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    replaced = wait(lambda: len(set(d.controller.workers()) - {workers[0]}) == 2, 10, "worker replaced")
    end = d.steady(2.0)
    out = d.lookups.recovery(killed, end)
    record("4 kill -9 gunicorn worker", replaced_s=replaced, failed_lookups=out["failed"], statuses=out["statuses"],
           longest_without_answer_s=out["longest_without_answer_s"], lookups=out["lookups"])
    assert replaced < 5.0
    assert out["failed"] <= 2 and out["longest_without_answer_s"] < 1.0
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("4 kill -9 gunicorn worker")


def test_5_kill9_of_the_controller_master_frees_its_ports_and_a_restart_converges(fresh):
    d = fresh
    c = d.controller
    emb = [e for e in d.active if "-emb-" in e.name]
    keeper = served_by(d.data)["pid"]
    kids = [k for k in children(c.proc.pid) if k != keeper]  # 2 workers and the sidecar
    assert len(kids) == 3, kids
    leases = Sampler(lambda: lease_margin_s(d.r, [q.name for q in d.quiet]), 0.1)
    killed = time.monotonic()
    c.kill9()
    freed = wait(lambda: all(port_free(p) for p in c.ports), 10, "HTTP and monitor ports free")
    start_s = c.start()  # as soon as it can: the quiet instances' leases run out TTL_S after their last renewal
    back_s = time.monotonic() - killed
    gone = wait(lambda: not any(alive(k) for k in kids), 5, "workers and sidecar gone") + back_s
    wait(lambda: all(e.synced_since(killed) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    synced_s = time.monotonic() - killed
    end = d.steady(1.0)
    leases.stop()
    margin, renewed = lowest_and_renewed(leases.samples, killed)
    out = d.lookups.recovery(killed, end)
    record("5 kill -9 controller master", ports_free_s=freed, start_s=start_s, health_200_s=back_s,
           first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"], full_syncs_done_s=synced_s,
           quiet_leases_renewed_s=renewed, shortest_quiet_lease_left_s=margin)
    assert margin > 0  # the quiet instances never dropped out (a reaper would have purged them)
    assert freed < 3.0 and gone < 10.0 and back_s < 10.0 and out["answered_again_s"] < 10.0
    assert alive(keeper) and servers_of(d.data)  # the standalone sidecar still uses the embedded Redis
    assert not d.quiet_wrong(d.lookups.window(killed))
    d.converge("5 kill -9 controller master")


def test_6_sigterm_restarts_of_controller_and_sidecar_lose_nothing(fresh):
    d = fresh
    emb = [e for e in d.active if "-emb-" in e.name]
    leases = Sampler(lambda: lease_margin_s(d.r, [q.name for q in d.quiet]), 0.1)
    t0 = time.monotonic()
    stop_s = d.controller.stop()
    start_s = d.controller.start()
    wait(lambda: all(e.synced_since(t0) for e in emb), 10, "full syncs of the embedded sidecar's engines")
    end = d.steady(1.0)
    leases.stop()
    margin, renewed = lowest_and_renewed(leases.samples, t0)
    out = d.lookups.recovery(t0, end)
    record("6a SIGTERM controller restart", stop_s=stop_s, start_s=start_s,
           first_lookup_after_s=out["answered_again_s"], failed_lookups=out["failed"], statuses=out["statuses"],
           longest_without_answer_s=out["longest_without_answer_s"], quiet_leases_renewed_s=renewed,
           shortest_quiet_lease_left_s=margin)
    assert margin > 0  # the embedded sidecar stopped last: its quiet instances never lapsed
    assert stop_s < 8.0 and start_s < 10.0
    assert not d.quiet_wrong(d.lookups.window(t0))
    d.converge("6a SIGTERM controller restart")

    t1 = time.monotonic()
    d.sidecar.kill(signal.SIGTERM)
    stop_s = time.monotonic() - t1
    start_s = d.sidecar.start().ready_s
    std = [e for e in d.active if "-std-" in e.name]
    wait(lambda: all(e.synced_since(t1) for e in std), 10, "full syncs of the standalone sidecar's engines")
    end = d.steady(1.0)
    out = d.lookups.recovery(t1, end)
    record("6b SIGTERM sidecar restart", stop_s=stop_s, start_s=start_s, failed_lookups=out["failed"])
    assert stop_s < 5.0 and start_s < 3.0 and out["failed"] == 0
    assert not d.quiet_wrong(d.lookups.window(t1))
    d.converge("6b SIGTERM sidecar restart")

def test_7_a_maximal_frame_in_a_full_sync_lets_no_lease_lapse(fresh):
    d = fresh
    sc = d.sidecar
    std = [e for e in d.active if "-std-" in e.name]
    limit = Limits().max_frame_bytes
    big = d.engine("big-0.5", "0.5", (sc.pull_url, sc.reply_url))
    n = max_sync_keys(limit, big.name)
    rng = random.Random(23)
    chunks = list(dict.fromkeys(d.chains[5] + [2**62 + rng.getrandbits(62) for _ in range(n + 100)]))[:n]
    frame = len(proto.encode(proto.FullSyncBatchMsg(big.name, 0, CPU, f"{big.name}_0_00000000", 0, chunks)))
    assert limit - 16 < frame <= limit
    names = [e.name for e in d.engines]
    leases = Sampler(lambda: lease_margin_s(d.r, names), 0.05)
    rss = Sampler(lambda: memory_mb(sc.pid), 0.1)
    t0 = time.monotonic()
    with big.lock:
        big.sim.held[CPU] = set(chunks)
        start, status = big.worker.full_sync(chunks, batch_size=len(chunks))
    assert start.get("accepted") and status.get("is_complete"), (start, status)
    wait(lambda: big.holder(d.r) is not None, 10, "holder of the big sync")
    hid = big.holder(d.r)
    ingest_s = wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == n, 60, "maximal frame written")
    end = d.steady(1.0)
    margins, peak = leases.stop(), max(rss.stop())
    hwm = memory_mb(sc.pid, "VmHWM")
    beat_s = max(e.max_beat_s(t0, end) for e in std)
    outcomes = {o for e in std for at, _took, o in e.beats if t0 <= at <= end}
    out = d.lookups.recovery(t0, end)
    record("7 maximal frame", keys=n, frame_bytes=frame, written_s=ingest_s, ops_per_s=int(n / ingest_s),
           longest_heartbeat_reply_s=beat_s, shortest_lease_left_s=min(margins), peak_rss_mb=peak,
           vm_hwm_mb=hwm, failed_lookups=out["failed"])
    assert min(margins) > 0  # no live instance ever dropped out
    assert beat_s < 2.0 and outcomes == {"ok"}
    assert out["failed"] == 0 and not d.quiet_wrong(d.lookups.window(t0))
    d.converge("7 maximal frame")
    assert int(d.r.hget(keys.records_key(), hid)) == n  # all of it, not only the chunks of prompt 5

    # purge: the engine restarts cold, so its old holder (the n records) is retired
    t1 = time.monotonic()
    with big.lock:
        big.worker.register()
        big.sim.held.clear()
    took = purge_time(d.r, hid)
    record("purge (re-registration)", records=n, purged_s=took, records_per_s=int(n / took),
           started_after_s=time.monotonic() - t1 - took)
    d.engines.remove(big)
    big.close()


FLOOD = r"""
import json, sys, time, zmq
from kvlookup.wire import lmcache as proto
pull, inst, seconds, n, base = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 10000)
    s.connect("tcp://" + pull)
    socks.append(s)
socks[0].send(proto.encode(proto.RegisterMsgV3(inst, 0, "127.0.0.1", 0, "flood:1")))
print("registered", flush=True)
sys.stdin.readline()
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLOUT)
sent = waits = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    progress = False
    for s in socks:
        try:
            s.send(proto.encode(proto.KVAdmitMsg(inst, 0, base + sent, "LocalCPUBackend")), zmq.NOBLOCK)
            sent += 1
            progress = True
        except zmq.Again:
            pass
    if not progress:  # every socket at its high-water mark: wait until one can send
        waits += 1
        poller.poll(10)
print(json.dumps({"sent": sent, "waits": waits}), flush=True)
sys.stdin.readline()
socks[0].send(proto.encode(proto.DeRegisterMsg(inst, 0, "127.0.0.1", 0)))
for s in socks:
    s.close()
ctx.term()
"""
FLOOD_S = 10.0
RSS_LIMIT_MB = 300.0


def test_8_a_flood_of_small_admits_stays_bounded_and_loses_nothing(fresh):
    d = fresh
    sc = d.sidecar
    std = [e for e in d.active if "-std-" in e.name]
    inst = "flood-0.3"
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, sc.pull_url, inst, str(FLOOD_S), "4", str(2**62)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert flood.stdout.readline().strip() == "registered"
        wait(lambda: d.r.exists(keys.worker_key(inst, 0)) == 1, 10, "flood instance registered")
        names = [e.name for e in d.engines] + [inst]
        leases = Sampler(lambda: lease_margin_s(d.r, names), 0.1)
        rss = Sampler(lambda: memory_mb(sc.pid), 0.1)
        before = memory_mb(sc.pid)
        t0 = time.monotonic()
        flood.stdin.write("go\n")
        flood.stdin.flush()
        sent = json.loads(flood.stdout.readline())["sent"]
        t_end = time.monotonic()
        hid = d.r.hget(keys.worker_key(inst, 0), keys.location_field(CPU))
        drained = wait(lambda: int(d.r.hget(keys.records_key(), hid) or 0) == sent, 60, "flood written")
        time.sleep(max(0.0, t_end + 10.0 - time.monotonic()))
        after = memory_mb(sc.pid)
        samples, margins = rss.stop(), leases.stop()
        out = d.lookups.recovery(t0, t_end)
        beat_s = max(e.max_beat_s(t0, t_end) for e in std)
        outcomes = {o for e in std for at, _took, o in e.beats if t0 <= at <= t_end}
        record("8 flood", seconds=t_end - t0, admits_sent=sent, sent_per_s=int(sent / (t_end - t0)),
               written_after_flood_s=drained, admits_lost=sent - int(d.r.hget(keys.records_key(), hid)),
               rss_before_mb=before, peak_rss_mb=max(samples), rss_10s_after_mb=after,
               longest_heartbeat_reply_s=beat_s, failed_lookups=out["failed"],
               longest_without_answer_s=out["longest_without_answer_s"], shortest_lease_left_s=min(margins))
        assert max(samples) <= RSS_LIMIT_MB
        assert int(d.r.hget(keys.records_key(), hid)) == sent  # back pressure, never a drop
        assert out["failed"] == 0 and out["longest_without_answer_s"] < 2.0
        assert beat_s < 2.0 and outcomes == {"ok"} and min(margins) > 0
        assert not d.quiet_wrong(d.lookups.window(t0))

        flood.stdin.write("deregister\n")
        flood.stdin.flush()
        took = purge_time(d.r, hid)  # from the DeRegisterMsg sent, through the PUSH queue behind the flood
        record("purge (deregistration)", records=sent, purged_s=took, records_per_s=int(sent / took))
        assert flood.wait(15) == 0
    finally:
        flood.kill()
    d.converge("8 flood")
