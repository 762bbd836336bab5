"""Whole lookups kept on a Redis Cluster (kvlookup.index.kept over
kvlookup.index.cluster_cache.ClusterCachedReads): the same prompt again is answered without
reading a copy, and every change that matters reaches the next lookup exactly as without the
kept answer: a write on any master (deep in the chain, an empty chunk filled), a deregistration
(the registry's master), a lapsed lease."""

from __future__ import annotations

import time

import pytest

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import ADMIT, EVICT, Store
from tests.conftest import BACKENDS

CPU = "LocalCPUBackend"
LONG = list(range(10_000, 10_000 + 300 * 256))  # 300 chunks: read in stages (128, then 1,024)
HASHES = HashProfile().chunk_hashes(LONG)
pytestmark = pytest.mark.skipif("cluster" not in BACKENDS, reason="KVLOOKUP_TEST_BACKENDS excludes the cluster")


@pytest.fixture()
def rc(redis_cluster):
    redis_cluster.flushall()
    from kvlookup.proc.redis_server import connect

    client = connect(redis_cluster.url, cluster=True)
    yield client
    client.close()


def _answer(client: Client, now_ms: int | None = None):
    found = client.store.lookup(client.chains(LONG), now_ms=now_ms)
    return {m.instance_id: m.matched_prefix_length for m in found}, found


def test_a_kept_lookup_on_a_cluster_and_every_change_reaches_the_next(rc):
    writer = Store(rc, purge_grace_s=0, instance_ttl_s=30)
    for inst in ("long-a", "long-b"):
        writer.register_worker(inst, 0)
        writer.own("sc-long", inst)
    writer.apply([("long-a", 0, CPU, [(ADMIT, h) for h in HASHES])])
    writer.apply([("long-b", 0, CPU, [(ADMIT, h) for h in HASHES[:200]])])
    client = Client(store=Store(rc, purge_grace_s=0, instance_ttl_s=30, cache_reads="fenced"))
    cached = client.store.records.cached
    full = {"long-a": 300 * 256, "long-b": 200 * 256}
    assert _answer(client)[0] == full
    got, kept = _answer(client)
    hits = cached.stats["hits"]
    again, same = _answer(client)
    assert got == again == full and kept.kept and same is kept
    assert cached.stats["hits"] == hits  # answered without reading a copy
    writer.apply([("long-a", 0, CPU, [(EVICT, HASHES[250])])])  # past the first stage
    assert _answer(client)[0] == {"long-a": 250 * 256, "long-b": 200 * 256}
    writer.apply([("long-b", 0, CPU, [(ADMIT, HASHES[200])])])  # an empty chunk filled
    _answer(client)
    assert _answer(client)[0] == {"long-a": 250 * 256, "long-b": 201 * 256}
    writer.deregister_worker("long-b", 0)
    assert _answer(client)[0] == {"long-a": 250 * 256}
    now = int(time.time() * 1000)
    _answer(client, now_ms=now), _answer(client, now_ms=now)
    assert _answer(client, now_ms=now + 31_000)[0] == {}  # nobody renewed the lease
    assert _answer(client)[0] == {"long-a": 250 * 256}  # judged at the right time again
