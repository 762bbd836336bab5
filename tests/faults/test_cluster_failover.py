"""Redis Cluster under faults, with real processes: kill -9 of a master mid-ingest, and a new
master rebalanced in while ingest and lookups run. The index must keep answering and converge
exactly to what the engines hold."""

from __future__ import annotations

import threading
import time

import pytest

from kvlookup.client import Client
from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.index import keys
from kvlookup.index.cluster_io import slot_of
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.proc.redis_server import connect
from tests.conftest import BACKENDS
from tests.support.engines import CPU
from tests.support.figures import report
from tests.support.ha_fleet import PROFILE, Fleet, layouts_match, make_prompts, true_records
from tests.support.lookups import HttpClient, Lookups
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.skipif("cluster" not in BACKENDS, reason="KVLOOKUP_TEST_BACKENDS excludes the cluster")


@pytest.fixture()
def six(tmp_path):
    """A 3-master + 3-replica cluster of this test's own (cluster-node-timeout 1.5 s)."""
    c = LocalCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1500)
    c.start()
    yield c
    c.stop()


@pytest.fixture()
def fleet(six, tmp_path):
    rc = connect(six.url, cluster=True)
    f = Fleet(["--redis-url", six.url, "--redis-cluster"], Client(six.url, redis_cluster=True), rc,
              lambda: [n.client() for n in six.masters()], tmp_path, seed=11)
    yield f
    f.close()
    rc.close()


@pytest.fixture()
def controller(six):
    c = ControllerProc("--redis-url", six.url, "--redis-cluster", "--workers", "1").wait_ready()
    yield c
    c.stop()


def test_master_kill9_mid_ingest_fails_over_and_converges_exactly(six, fleet, controller):
    cluster, f = six, fleet
    victim = cluster.node_of(keys.holders_key())  # the registry's master: the worst one to lose
    (replica,) = cluster.replicas_of(victim)
    f.fail_over("cluster failover", cluster, victim, replica, lambda: cluster.node_of(keys.holders_key()) is replica,
                Lookups(HttpClient(controller), f.prompts, seed=8, pace_s=0.02))
    print(f"[cluster failover] io_stats={f.client.store.records.io.stats}")
    # the killed master comes back as a replica of its successor, and nothing changes
    cluster.restart(victim)
    assert victim.client().info("replication")["role"] == "slave"
    assert cluster.node_of(keys.holders_key()) is replica
    time.sleep(1)
    assert f.state().records == true_records(f.all)
    assert layouts_match(f.client, f.all, f.prompts) == []


def test_add_master_and_rebalance_while_ingest_and_lookups_run(six, fleet):
    cluster, f = six, fleet
    f.lookups.start()
    time.sleep(2)
    t0 = time.monotonic()
    new = cluster.add_master()  # add-node, then --cluster rebalance --cluster-use-empty-masters
    rebalance_s = time.monotonic() - t0
    slots = cluster.slot_counts()
    time.sleep(1)
    _stopped, converged = f.converge()
    f.lookups.stop()
    out = f.lookups.outage(t0)
    s = f.state()
    report("rebalance", rebalance_s=rebalance_s, slots_on_new_master=slots[new.port],
            lookups=len([a for a in f.lookups.answers if a.ended >= t0]), **out, converged_after_stop_s=converged,
            records=len(s.records), io_stats=f.client.store.records.io.stats)
    assert slots[new.port] >= 16384 // 4 - 1 and len(slots) == 4
    new_keys = new.client().dbsize()
    assert new_keys > 0  # records moved onto the new master
    assert out["errors"] == 0, f.lookups.answers  # MOVED/ASK/TRYAGAIN followed, never an error
    assert not f.static_wrong()
    assert f.client.store.records.io.stats["moved"] + f.client.store.records.io.stats["ask"] > 0
    for e in f.engines:
        assert not e.errors, e.errors
    assert converged is not None, f"index did not converge: {f.why_not()}"
    assert not f.sidecar.lines("failover: wrote the ops")  # adding a master loses nothing


def _held(rc, seed: int, cache_reads: bool):
    """A Store on ``rc`` whose instance "a" holds one prompt's whole chain: (store, chain hashes,
    the exact answer, answer() reading it again)."""
    store = Store(rc, purge_grace_s=0, cache_reads=cache_reads)
    client = Client(store=store)
    prompt = make_prompts(seed=seed, n=1)[0]
    chain = PROFILE.chunk_hashes(prompt)
    store.register_worker("a", 0)
    store.touch_instance("a")
    store.apply([("a", 0, CPU, [(ADMIT, h) for h in chain])])

    def answer():
        return [(m.instance_id, m.location, m.matched_prefix_length) for m in client.matches(prompt)]

    return store, chain, [("a", CPU, len(prompt))], answer


@pytest.mark.parametrize("cache_reads", [False, True])
def test_half_moved_slots_ask_and_tryagain_are_followed(six, cache_reads):
    """One slot moved by hand, key by key: a lookup follows ASK to a master the client has never
    seen, and waits out TRYAGAIN on the registry's slot while only some of its keys have moved.
    With cached reads (kvlookup.index.cluster_cache) the moved key's copy goes with it (MIGRATE
    deletes it on its old master, which invalidates it) and the reads redirected go through
    ClusterIO."""
    cluster = six
    new = cluster.add_master(rebalance=False)  # a master with no slot yet
    rc = connect(cluster.url, cluster=True)
    store, chain, want, answer = _held(rc, seed=5, cache_reads=cache_reads)
    assert answer() == want
    stats = store.records.io.stats
    key = keys.chunk_key(chain[2])
    src, slot = cluster.node_of(key), slot_of(key)
    cluster.migrate(slot, src, new, [key])  # the key has moved, the slot not yet
    assert answer() == want
    assert stats["ask"] >= 1
    cluster.finish_migration(slot, src, new)
    assert answer() == want
    assert stats["moved"] >= 1
    # the registry's slot half moved: RESOLVE (five registry keys) gets TRYAGAIN until it is whole
    reg = cluster.node_of(keys.holders_key())
    reg_slot = slot_of(keys.holders_key())
    cluster.migrate(reg_slot, reg, new, [keys.rules_key()])
    finisher = threading.Timer(0.8, cluster.finish_migration, (reg_slot, reg, new))
    finisher.start()
    store.records.cache.clear()  # a lookup whose holders are not cached: it must RESOLVE
    t0 = time.monotonic()
    assert answer() == want
    waited = time.monotonic() - t0
    finisher.join()
    report("half-moved slots", ask=stats["ask"], moved=stats["moved"], tryagain=stats["tryagain"],
            waited_for_registry_slot_s=waited)
    assert stats["tryagain"] >= 1 and waited >= 0.5
    assert answer() == want
    assert cluster.node_of(keys.holders_key()) is new and store.heartbeat_worker("a", 0)
    rc.close()


@pytest.mark.parametrize("cache_reads", [False, True])
def test_frozen_master_failed_over_copies_do_not_answer(six, cache_reads):
    """A master frozen (SIGSTOP: a hung or partitioned host, its sockets stay open, no EOF) is failed
    over to its replica; a writer evicts a chunk on the new master. A reader whose chunk copies
    were read from the frozen master must not keep answering from them: the eviction is seen
    (kvlookup.index.tracking.LISTENER_TRUST_S: a silent invalidation connection is PINGed first)."""
    cluster = six
    # the reader times out as the controller's client does (kvlookup.app: socket_timeout=5)
    writer_rc, reader_rc = connect(cluster.url, cluster=True), connect(cluster.url, cluster=True, socket_timeout=5)
    writer = Store(writer_rc, purge_grace_s=0)
    reader = Store(reader_rc, purge_grace_s=0, cache_reads=cache_reads)
    client = Client(store=reader)
    reg = cluster.node_of(keys.holders_key())
    prompt = next(p for p in make_prompts(seed=7, n=50)
                  if cluster.node_of(keys.chunk_key(PROFILE.chunk_hashes(p)[1])) is not reg)
    chain = PROFILE.chunk_hashes(prompt)
    victim = cluster.node_of(keys.chunk_key(chain[1]))  # chunk 1's master, not the registry's
    (replica,) = cluster.replicas_of(victim)
    writer.register_worker("a", 0)
    writer.touch_instance("a")
    writer.apply([("a", 0, CPU, [(ADMIT, h) for h in chain])])

    def answer():
        return [(m.instance_id, m.location, m.matched_prefix_length) for m in client.matches(prompt)]

    assert answer() == answer() == [("a", CPU, len(prompt))]
    cluster.freeze(victim)
    try:
        deadline = time.monotonic() + 30
        while replica.client().info("replication").get("role") != "master":
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.2)
        writer.apply([("a", 0, CPU, [(EVICT, chain[1])])])
        writer.touch_instance("a")  # its sidecar renews the lease (30 s) however long the failover took
        assert writer_rc.zrange(keys.chunk_key(chain[1]), 0, -1) == []
        t0 = time.monotonic()
        got = [answer() for _ in range(3)]
        answered_s = time.monotonic() - t0
    finally:
        cluster.thaw(victim)
    report("frozen master", cache_reads=cache_reads, three_answers_s=answered_s)
    # found out by the PING of the invalidation connection (LISTENER_DEAD_S) or else the reader's
    # socket timeout (5 s), then the slot map is read asking the frozen master last (not again: 10 s+)
    assert answered_s < (5 if cache_reads else 9)
    assert got == [[("a", CPU, PROFILE.chunk_size)]] * 3
    if cache_reads:  # the frozen master's copies (and connections) were dropped with the new slot map
        masters = {port for _host, port in reader.records.cached._masters}
        assert victim.port not in masters and replica.port in masters
    writer_rc.close()
    reader_rc.close()


def test_a_master_frozen_briefly_is_waited_for_not_lost(tmp_path):
    """A master frozen 2 s (under the cluster-node-timeout: nobody takes over) while lookups run
    with cached reads: its unanswered PING marks it hung, the slot map is read again (at most
    once a second) and still names it, so its reads wait for it. Every answer stays exact, no
    lookup fails, and once thawed the copies come back."""
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=0, node_timeout_ms=15000)
    cluster.start()
    try:
        rc = connect(cluster.url, cluster=True, socket_timeout=5)
        store, chain, want, answer = _held(rc, seed=9, cache_reads=True)
        assert answer() == answer() == want
        victim = cluster.node_of(keys.chunk_key(chain[-1]))
        cluster.freeze(victim)
        thaw = threading.Timer(2.0, cluster.thaw, (victim,))
        thaw.start()
        got, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 3.5:
            got.append(answer())
            time.sleep(0.05)
        thaw.join()
        def local():  # lookups answered from copies: chunk reads, or whole lookups vouched for (kept)
            return store.records.cached.stats["hits"] + store.records.cached.stats["kept"]

        before, deadline = local(), time.monotonic() + 10
        while local() == before:  # reconnected (RECONNECT_S after the PING went unanswered)
            assert answer() == want and time.monotonic() < deadline, "the copies did not come back"
            time.sleep(0.1)
        report("master frozen 2 s", lookups=len(got))
        assert got == [want] * len(got)
        rc.close()
    finally:
        cluster.stop()
