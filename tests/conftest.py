"""Shared fixtures: real Redis-compatible servers started by the tests, flushed per test.

Every test that asks for ``redis_url``, ``r`` or ``store`` runs twice: against one real server
and against a real 3-master + 3-replica Redis Cluster (``valkey-cli --cluster create`` over the
same valkey binaries). ``KVLOOKUP_TEST_BACKENDS=single`` (or ``cluster``) runs one of them.
"""

from __future__ import annotations

import os

import pytest

from kvlookup.devtools.local_cluster import LocalCluster
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect
from tests.compat.gate import (  # noqa: F401  (hooks: compatibility skips say why; fail under KVLOOKUP_REAL_PEERS=1)
    pytest_report_teststatus,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)
from tests.support import native as native_impl

SEED_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
SEED_HASH = 4690244967161877535

BACKENDS = [b for b in os.environ.get("KVLOOKUP_TEST_BACKENDS", "single,cluster").split(",") if b]
# Controllers under test cache their reads fenced: a lookup sees every write completed before it
# (tests write, then look up at once); the unfenced default is tested on its own (test_tracking).
os.environ.setdefault("KVLOOKUP_LOOKUP_CACHE", "fenced")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``single_node`` (what only one Redis has: its scripts' slicing, the embedded
    server) run against the single server only, uncached."""
    def wanted(item) -> bool:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        cached = params.get("store") == "cached"
        if params.get("backend") == "cluster":
            return not item.get_closest_marker("single_node")
        return not (cached and item.get_closest_marker("single_node"))

    keep = [i for i in items if wanted(i)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture(params=native_impl.IMPLS)
def impl(request, monkeypatch):
    """``python`` or ``native``: the hot path's implementation for this test (tests/support/native.py);
    the process's own mode comes back afterwards."""
    native_impl.use(request.param, monkeypatch)
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """``single`` or ``cluster``: which deployment this run of the test talks to."""
    return request.param


@pytest.fixture()
def cluster(backend) -> bool:
    """True when the test runs against the Redis Cluster."""
    return backend == "cluster"


@pytest.fixture()
def redis_url(request, cluster):
    if cluster:
        c = request.getfixturevalue("redis_cluster")
        c.flushall()
        return c.url
    server = request.getfixturevalue("redis_server")
    client = connect(server.url)
    client.flushall()
    client.close()
    return server.url


@pytest.fixture()
def redis_settings(redis_url, cluster) -> dict:
    """Settings naming this test's Redis (for create_app and kvlookup.config)."""
    return {"redis_url": redis_url, "redis_cluster": cluster}


@pytest.fixture()
def redis_args(redis_url, cluster) -> list[str]:
    """Command-line flags naming this test's Redis (for kvlookup processes)."""
    return ["--redis-url", redis_url, *(["--redis-cluster"] if cluster else [])]


@pytest.fixture()
def r(redis_url, cluster):
    client = connect(redis_url, cluster=cluster)
    yield client
    client.close()


@pytest.fixture(params=["plain", "cached"])
def store(request, r):
    """The index on this test's Redis; also with lookups through cached reads (fenced: on one
    server kvlookup.index.tracking, on a cluster kvlookup.index.cluster_cache), so the cached walk
    meets the same contract."""
    return Store(r, purge_grace_s=0, cache_reads="fenced" if request.param == "cached" else False)


@pytest.fixture()
def own_redis(tmp_path):
    """A valkey of this test's own (no AOF), for tests that reconfigure, signal or measure the
    server itself (the shared ``redis_url`` server stays untouched)."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    server.start()
    yield server
    server.stop()
