"""``mp_replica_acks``: an MP write is acknowledged only once a replica has it. WAIT counts the
writes of the connection it is sent on, so it must follow the write down the same connection:
sent on another pooled connection (one that wrote nothing: a lookup's) it answers at once, and a
master killed right after the answer could lose the write. A real master and a real replica,
the replica frozen (SIGSTOP): no write can be replicated, so every write must come back short,
whatever order the pool hands out its connections (here first in, first out)."""

from __future__ import annotations

import queue

import pytest
import redis

from kvlookup.devtools.local_cluster import Node, Processes, replicas_synced, spawn, stop_all, wait
from kvlookup.index.mp import MPDirectory
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache_mp as W
from tests.index.test_mp_index import C0, batch, entry, post

WRITES = 6


@pytest.fixture()
def pair(tmp_path):
    master = spawn(Node(free_port(), tmp_path / "master"), [])
    replica = spawn(Node(free_port(), tmp_path / "replica"), ["--replicaof", "127.0.0.1", str(master.port)])
    wait(lambda: replicas_synced([master, replica]), 30, "the replica did not sync")
    yield master, replica
    stop_all([master, replica])


def test_every_write_waits_on_its_own_connection(pair):
    master, replica = pair
    pool = redis.BlockingConnectionPool(port=master.port, decode_responses=True, max_connections=8,
                                        queue_class=queue.Queue)  # FIFO: the next call, another connection
    client = redis.Redis(connection_pool=pool)
    d = MPDirectory(client, replica_acks=1, replica_timeout_ms=100)
    d.register(W.RegisterRequest(instance_id="mp-test-1", ip="127.0.0.1", http_port=1))
    assert d.short_acks == 0  # the replica is live: it acknowledged the registration
    Processes().freeze(replica)
    answers = [post(d, batch(seq, entries=[entry(C0), entry(f"{seq:064x}")])) for seq in range(1, WRITES + 1)]
    d.deregister("mp-test-1")
    assert answers == [{"applied": 1, "duplicates": 0, "stale": 0}] * WRITES
    assert len(pool._connections) > 1  # the calls did go down several connections
    assert d.short_acks == WRITES + 1  # no WAIT answered for a connection that wrote nothing
