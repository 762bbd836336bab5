"""LMCache ingest with a slice's write left in flight (``flush(overlap=True)``, what the sidecar
loop does): the next flush or any registry message reads it first, order per holder holds, and a
write whose reply never came is queued again."""

from __future__ import annotations

import pytest
import redis

from kvlookup.client import Client
from kvlookup.sidecar.lmcache_ingest import LMCacheIngest
from kvlookup.wire import lmcache as proto
from tests.conftest import SEED_HASH, SEED_TOKENS

CPU = "LocalCPUBackend"


def _ingest(store) -> LMCacheIngest:
    ingest = LMCacheIngest(store, "sc")
    ingest.handle_push([proto.encode(proto.RegisterMsgV3("a", 0, "127.0.0.1", 8001, "h:1"))])
    return ingest


def test_writes_in_flight_keep_their_order(store):
    ingest, client = _ingest(store), Client(store=store)
    ingest.handle_push([proto.encode(proto.KVAdmitMsg("a", 0, SEED_HASH, CPU))])
    assert ingest.flush(overlap=True) == 1
    assert ingest.queued_ops == 1  # sent, not known written
    ingest.handle_push([proto.encode(proto.KVEvictMsg("a", 0, SEED_HASH, CPU))])
    assert ingest.flush(overlap=True) == 1  # the admit's reply read first, then the evict sent
    assert ingest.queued_ops == 1
    assert ingest.flush(overlap=True) == 0 and ingest.queued_ops == 0
    assert client.lookup(SEED_TOKENS)[1] == {}
    ingest.handle_push([proto.encode(proto.KVAdmitMsg("a", 0, SEED_HASH, CPU))])
    ingest.flush(overlap=True)
    ingest.handle_push([proto.encode(proto.DeRegisterMsg("a", 0, "127.0.0.1", 8001))])  # reads it first
    assert ingest.queued_ops == 0
    assert client.lookup(SEED_TOKENS)[1] == {}


def test_a_write_whose_reply_never_came_is_queued_again(store, monkeypatch):
    if not hasattr(store.records, "io") or not hasattr(store.records.io, "receive"):
        pytest.skip("the cluster backend writes at once: nothing is left in flight")
    ingest, client = _ingest(store), Client(store=store)
    ingest.handle_push([proto.encode(proto.KVAdmitMsg("a", 0, SEED_HASH, CPU))])
    ingest.flush(overlap=True)
    real = store.records.io.receive

    def lost(sent):
        store.records.io.abandon(sent)
        raise redis.ConnectionError("connection reset")

    monkeypatch.setattr(store.records.io, "receive", lost)
    with pytest.raises(redis.ConnectionError):
        ingest.flush(overlap=True)
    assert ingest.queued_ops == 1  # back at the head of the queue
    monkeypatch.setattr(store.records.io, "receive", real)
    ingest.flush()
    assert ingest.queued_ops == 0
    assert client.lookup(SEED_TOKENS)[1] == {"a": (CPU, 12)}
