"""LMCache worker traffic of both eras through real ZMQ sockets into a real Redis."""

from __future__ import annotations

import pytest
import zmq

from kvlookup.client import Client
from kvlookup.hashing import HashProfile
from kvlookup.store import Store
from kvlookup.workersim import WorkerSim
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.helpers import SidecarThread, wait_for

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
