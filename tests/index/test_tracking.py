"""Cached reads (kvlookup.index.tracking): a controller keeps the chunk sets it reads, and Redis tells
it when one changes (CLIENT TRACKING ... REDIRECT). A lookup whose chunks are known costs no
round trip; a change reaches it as soon as its invalidation arrives (fenced: before it begins)."""

from __future__ import annotations

import time

import pytest
import redis

from kvlookup.client import Client
from kvlookup.index import keys
from kvlookup.index.store import ADMIT, EVICT, Store
from kvlookup.index.tracking import LOCAL_ONLY, UNTRACKED, NeedsRedis
from kvlookup.proc.redis_server import EmbeddedRedis, connect
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import wait_for

CPU = "LocalCPUBackend"
pytestmark = pytest.mark.single_node  # one Redis: a cluster caches holder answers only


def _commands(r, name: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@pytest.fixture()
def writer(redis_url):
    store = Store(connect(redis_url), purge_grace_s=0)
    store.register_worker("a", 0)
    store.apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
    return store


def layout(client) -> dict:
    return {m.instance_id: m.matched_prefix_length for m in client.matches(SEED_TOKENS)}


def test_known_chunks_cost_no_round_trip_and_changes_arrive(redis_url, r, writer):
    client = Client(redis_url, cache_reads=True)
    assert layout(client) == {"a": 12}
    client.store.clock.refresh_s = float("inf")  # its offset kept: a measurement (SERVER_TIME: an EVALSHA),
    reads = _commands(r, "zrange") + _commands(r, "evalsha") + _commands(r, "get")  # each second, would count
    for _ in range(50):
        assert layout(client) == {"a": 12}
    assert _commands(r, "zrange") + _commands(r, "evalsha") + _commands(r, "get") == reads  # served here
    writer.apply([("a", 0, CPU, [(EVICT, SEED_HASH)])])
    assert wait_for(lambda: layout(client), {}, timeout=2) == {}  # unfenced: as soon as it arrives
    writer.apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
    assert wait_for(lambda: layout(client), {"a": 12}, timeout=2) == {"a": 12}
    assert client.store.records.cached.stats["invalidations"] >= 2


def test_cached_reads_over_a_unix_socket(tmp_path):
    """The invalidation connection is the client's own kind (a unix socket here; TLS, Sentinel):
    a plain TCP one was built from its options, and every lookup over ``unix://`` raised TypeError."""
    from kvlookup.devtools.local_cluster import Node, spawn, stop_all
    from kvlookup.proc.redis_server import free_port

    sock = tmp_path / "r.sock"
    node = spawn(Node(free_port(), tmp_path / "data"), ["--unixsocket", str(sock)])
    try:
        url = f"unix://{sock}"
        writer = Store(connect(url), purge_grace_s=0)
        writer.register_worker("a", 0)
        writer.apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
        client = Client(url, cache_reads=True)
        assert [layout(client) for _ in range(3)] == [{"a": 12}] * 3
        assert client.store.records.cached.stats["hits"] + client.store.records.cached.stats["kept"] >= 1
        writer.apply([("a", 0, CPU, [(EVICT, SEED_HASH)])])
        assert wait_for(lambda: layout(client), {}, timeout=2) == {}  # its invalidation arrived
    finally:
        stop_all([node])


def test_fenced_reads_see_every_completed_write(redis_url, writer):
    client = Client(redis_url, cache_reads="fenced")
    for i in range(30):
        op = EVICT if i % 2 == 0 else ADMIT
        writer.apply([("a", 0, CPU, [(op, SEED_HASH)])])
        assert layout(client) == ({} if op == EVICT else {"a": 12})
    writer.register_worker("a", 0)  # a new epoch: its records stop counting at once
    assert layout(client) == {}


def test_a_lost_invalidation_connection_drops_every_copy(redis_url, r, writer):
    client = Client(redis_url, cache_reads="fenced")
    cached = client.store.records.cached
    assert layout(client) == {"a": 12}
    r.client_kill_filter(_type="pubsub")  # the invalidation connection goes
    writer.apply([("a", 0, CPU, [(EVICT, SEED_HASH)])])
    assert layout(client) == {}  # not the stale copy
    assert cached.stats["resets"] >= 2
    writer.apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
    assert wait_for(lambda: layout(client), {"a": 12}) == {"a": 12}
    hits = local_answers(cached)
    assert layout(client) == {"a": 12} and local_answers(cached) > hits  # caching again


def test_flushall_empties_the_copies(redis_url, r, writer):
    client = Client(redis_url, cache_reads="fenced")
    assert layout(client) == {"a": 12}
    r.flushall()
    assert layout(client) == {}
    assert r.exists(keys.chunk_key(SEED_HASH)) == 0


@pytest.mark.parametrize("mode", [True, "fenced"])
def test_the_first_lookup_after_a_redis_kill_and_restart_answers(tmp_path, mode):
    """Reads never fail for want of the cache: after Redis comes back (a new server, so the
    listener id that tracked connections redirect to is gone), the first lookup answers from
    Redis and caching resumes."""
    server = EmbeddedRedis(tmp_path, appendonly=True)
    url = server.start()
    try:
        Store(connect(url), purge_grace_s=0).register_worker("a", 0)
        Store(connect(url), purge_grace_s=0).apply([("a", 0, CPU, [(ADMIT, SEED_HASH)])])
        client = Client(url, cache_reads=mode)
        cached = client.store.records.cached
        assert layout(client) == {"a": 12}
        time.sleep(1.2)  # appendfsync everysec
        server.proc.kill()
        server.proc.wait()
        for _ in range(2):
            with pytest.raises(redis.ConnectionError):
                layout(client)  # down: the listener is gone and is tried again only after a while
        server.start()
        assert layout(client) == {"a": 12}  # no 503: the AOF brought it back and reads go plainly
        assert wait_for(lambda: (layout(client), cached._listener is not None), ({"a": 12}, True)) == ({"a": 12}, True)
        hits = local_answers(cached)
        assert layout(client) == {"a": 12} and local_answers(cached) > hits  # caching again
        Store(connect(url), purge_grace_s=0).apply([("a", 0, CPU, [(EVICT, SEED_HASH)])])
        assert wait_for(lambda: layout(client), {}, timeout=2) == {}  # invalidations reach this process
    finally:
        server.stop()


@pytest.mark.parametrize("mode", [True, "fenced"])
@pytest.mark.parametrize("how", ["client-kill", "idle-timeout"])
def test_a_tracked_connection_closed_by_redis_drops_every_copy(redis_url, r, writer, mode, how):
    """Redis watches a key only while the connection that read it lives: once Redis closes it
    (CLIENT KILL, the ``timeout`` setting) its copies would never be invalidated again."""
    client = Client(redis_url, cache_reads=mode)
    cached = client.store.records.cached
    assert layout(client) == {"a": 12}
    assert layout(client) == {"a": 12}  # served from the copy
    if how == "client-kill":
        r.execute_command("CLIENT", "KILL", "TYPE", "normal")  # data connections, not the pub/sub listener
    else:
        r.config_set("timeout", 1)
        try:
            time.sleep(2.5)  # Valkey closes idle normal clients, never pub/sub ones
        finally:
            connect(redis_url).config_set("timeout", 0)
    resets = cached.stats["resets"]
    Store(connect(redis_url), purge_grace_s=0).apply([("a", 0, CPU, [(EVICT, SEED_HASH)])])
    assert wait_for(lambda: layout(client), {}, timeout=2) == {}
    assert cached.stats["resets"] > resets


def _local_attempt(client, tokens) -> NeedsRedis | list:
    """``client.matches(tokens)`` as app.asgi tries it in the event loop: the answer, or the
    NeedsRedis it raised."""
    token = LOCAL_ONLY.set(True)
    try:
        return client.matches(tokens)
    except NeedsRedis as exc:
        return exc
    finally:
        LOCAL_ONLY.reset(token)


def test_a_first_miss_is_read_by_digest_untracked_and_a_second_is_tracked(redis_url, r, writer):
    client = Client(redis_url, cache_reads=True)
    assert client.matches([7] * 300) == []  # the clock and the registry version are read
    fresh = [9] * 12
    for tokens in (fresh, SEED_TOKENS):
        first = _local_attempt(client, tokens)
        assert isinstance(first, NeedsRedis) and first.first_miss  # never lacked before
    tracked = _commands(r, "client|caching")
    token = UNTRACKED.set(True)
    try:  # as app.asgi asks it in a thread after a first miss
        assert client.matches(fresh) == []
        assert layout(client) == {"a": 12}  # read by digest: the same answer
    finally:
        UNTRACKED.reset(token)
    assert _commands(r, "client|caching") == tracked  # nothing tracked, nothing kept
    again = _local_attempt(client, SEED_TOKENS)
    assert isinstance(again, NeedsRedis) and not again.first_miss  # lacked once already
    assert layout(client) == {"a": 12}  # read tracked now, and kept
    assert _commands(r, "client|caching") == tracked + 1
    kept = _local_attempt(client, SEED_TOKENS)
    assert [(m.instance_id, m.matched_prefix_length) for m in kept] == [("a", 12)]


def local_answers(cached) -> int:
    """Reads answered from copies plus whole lookups kept (kvlookup.index.kept): either is caching."""
    return cached.stats["hits"] + cached.stats["kept"]


def test_a_silent_invalidation_connection_is_pinged_before_copies_answer(redis_url, r, writer):
    """A hung server closes no socket (kvlookup.index.tracking.LISTENER_TRUST_S): after a second
    with nothing heard on the invalidation connection, the event loop's attempt leaves the lookup
    to a thread, which PINGs it and then answers from the copies (no chunk read)."""
    client = Client(redis_url, cache_reads=True)
    assert layout(client) == layout(client) == {"a": 12}
    time.sleep(1.2)
    pings, reads = _commands(r, "ping"), _commands(r, "zrange")
    got = _local_attempt(client, SEED_TOKENS)
    assert isinstance(got, NeedsRedis) and not got.first_miss
    assert layout(client) == {"a": 12}
    assert _commands(r, "ping") == pings + 1 and _commands(r, "zrange") == reads
    kept = _local_attempt(client, SEED_TOKENS)  # heard from just now: the loop answers
    assert [(m.instance_id, m.matched_prefix_length) for m in kept] == [("a", 12)]
