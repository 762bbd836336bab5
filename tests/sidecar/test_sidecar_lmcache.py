"""LMCache worker traffic of both eras through real ZMQ sockets into a real Redis."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import Store
from kvlookup.wire import lmcache as proto
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import SidecarThread, wait_for

S600 = SEED_TOKENS + list(range(1000, 1588))
S600_HASHES = [-3970904962213640042, 5029743591393730883, 3632939766864693898]


@pytest.fixture()
def sidecar(r):
    with SidecarThread(Store(r)) as sc:
        yield sc


@pytest.fixture()
def client(r):
    return Client(redis=r)


@pytest.mark.parametrize("era", ["0.3", "0.5"])
def test_seed_walkthrough(sidecar, client, era):
    w = WorkerSim("lmcache_default_instance", era=era, pull_url=sidecar.pull_url, reply_url=sidecar.reply_url)
    reply = w.register()
    if era == "0.5":
        assert reply == {"type": "RegisterRetMsg", "extra_config": {"heartbeat_url": sidecar.reply_url}}
    w.admit([SEED_HASH])
    got = wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"lmcache_default_instance": ("LocalCPUBackend", 12)})
    assert got == {"lmcache_default_instance": ("LocalCPUBackend", 12)}
    w.evict([SEED_HASH])
    assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {}) == {}
    w.close()


def test_s600_hashes_match_real_lmcache():
    assert HashProfile().chunk_hashes(S600) == S600_HASHES


def test_garbage_frames_do_not_stop_ingest(sidecar, client):
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect("tcp://" + sidecar.pull_url)
    push.send_multipart([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"{not json", b"\xff\xfe\xfd", b"\x93\x01\x02\x03"])
    w = WorkerSim("inst", era="0.3", pull_url=sidecar.pull_url)
    w.register()
    w.admit([SEED_HASH])
    assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"inst": ("LocalCPUBackend", 12)}) == {
        "inst": ("LocalCPUBackend", 12)}
    push.close()
    w.close()


def test_heartbeats_and_full_sync_replace_a_location(r, sidecar, client):
    w = WorkerSim("inst", era="0.5", pull_url=sidecar.pull_url, reply_url=sidecar.reply_url)
    w.register()
    assert w.heartbeat() == {"type": "HeartbeatRetMsg", "commands": []}
    w.admit(S600_HASHES)
    assert wait_for(lambda: client.lookup(S600)[1], {"inst": ("LocalCPUBackend", 600)}) == {
        "inst": ("LocalCPUBackend", 600)}
    start = proto.FullSyncStart("inst", 0, "LocalCPUBackend", "inst_0_abc", 1, 1)
    reply = w.request(proto.FullSyncStartMsg(**msgspec.structs.asdict(start)))
    assert reply == {"type": "FullSyncStartRetMsg", "sync_id": "inst_0_abc", "accepted": True, "error_msg": None}
    assert client.lookup(S600)[1] == {}  # the sync replaces what the index had for that location
    w.push.send_multipart([proto.encode(proto.FullSyncBatchMsg("inst", 0, "LocalCPUBackend", "inst_0_abc", 0,
                                                                   [SEED_HASH]))])
    assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"inst": ("LocalCPUBackend", 12)}) == {
        "inst": ("LocalCPUBackend", 12)}
    status = w.request(proto.FullSyncStatusMsg("inst", 0, "inst_0_abc"))
    assert (status["is_complete"], status["can_exit_freeze"]) == (True, True)
    w.close()


def test_unknown_worker_heartbeat_reregisters_and_asks_for_sync(r, sidecar, client):
    w = WorkerSim("fresh", era="0.5", pull_url=sidecar.pull_url, reply_url=sidecar.reply_url)
    reply = w.heartbeat()
    assert reply["commands"] == [{"command_type": "full_sync", "reason": "worker_re_registered", "args": None}]
    assert Store(r).is_registered("fresh", 0)
    w.close()


def test_sidecar_restart_asks_known_workers_for_full_sync(r, client):
    with SidecarThread(Store(r)) as first:
        w = WorkerSim("inst", era="0.5", pull_url=first.pull_url, reply_url=first.reply_url)
        w.register()
        w.close()
    with SidecarThread(Store(r)) as second:  # a new process: registry in Redis, worker unseen here
        w = WorkerSim("inst", era="0.5", pull_url=second.pull_url, reply_url=second.reply_url)
        reply = w.heartbeat()
        assert reply["commands"][0]["reason"] == "controller_restart"
        assert w.heartbeat()["commands"] == []
        w.close()


def test_request_socket_answers_errors_as_errormsg(sidecar):
    w = WorkerSim("inst", era="0.5", pull_url=sidecar.pull_url, reply_url=sidecar.reply_url)
    w.dealer.send_multipart([b"", b"\xc1garbage"])
    reply = msgspec.msgpack.decode(w.dealer.recv_multipart()[-1])
    assert reply["type"] == "ErrorMsg" and reply["error"].startswith("undecodable")
    w.close()
