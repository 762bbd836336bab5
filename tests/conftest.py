"""Shared fixtures: one real Redis-compatible server per test session, flushed per test."""

from __future__ import annotations

import pytest

from kvlookup.redis_server import EmbeddedRedis, connect
from kvlookup.store import Store

SEED_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]
SEED_HASH = 4690244967161877535


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server):
    client = connect(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture()
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


@pytest.fixture()
def store(r):
    return Store(r)
