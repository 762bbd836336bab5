"""A first miss read by digest from an event loop (kvlookup.index.loop_reads, as app.asgi reads it):
the lookup suspended in a greenlet while its reads go on the worker's asyncio connection gives the
answer the thread's read gives, many at once on one connection; a read that fails (NOSCRIPT after
a script flush, the connection killed) raises NeedsRedis for the thread to answer, and the next
read works again. A Cluster has no such connection (its reads stay on the thread path)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.loop_reads import CLIENT_NAME, LoopRedis, loop_redis_for, run_in_loop
from kvlookup.index.store import ADMIT, Store
from kvlookup.index.tracking import LOCAL_ONLY, UNTRACKED, NeedsRedis
from kvlookup.proc.redis_server import connect

CPU = "LocalCPUBackend"
N = 200  # chunks: the held prefix is read in two stages from the copies
HELD = list(range(20_000, 20_000 + N * 256))
HASHES = HashProfile().chunk_hashes(HELD)


def fresh(i: int) -> list[int]:
    """The held prompt with new last chunk number ``i``."""
    return HELD[:-256] + list(range(90_000 + 256 * i, 90_256 + 256 * i))


def _answer(client: Client, tokens: list[int]) -> dict[str, int]:
    return {m.instance_id: m.matched_prefix_length for m in client.matches(tokens)}


def _thread(client: Client, tokens: list[int]) -> dict[str, int]:
    token = UNTRACKED.set(True)  # as app.asgi asks it in a pool thread
    try:
        return _answer(client, tokens)
    finally:
        UNTRACKED.reset(token)


async def _in_loop(client: Client, conn: LoopRedis, tokens: list[int]) -> dict[str, int]:
    def lookup() -> dict[str, int]:  # app.asgi._untracked_here
        LOCAL_ONLY.set(True)
        UNTRACKED.set(True)
        return _answer(client, tokens)

    got = await run_in_loop(lookup, conn)
    assert isinstance(got, dict)
    return got


@pytest.fixture()
def fleet(r):
    writer = Store(r, purge_grace_s=0)
    for inst in ("a", "b"):
        writer.register_worker(inst, 0)
    writer.apply([("a", 0, CPU, [(ADMIT, h) for h in HASHES])])
    writer.apply([("b", 0, CPU, [(ADMIT, h) for h in HASHES[:100]])])
    return writer


@pytest.fixture()
def client(r, fleet, cluster):
    client = Client(store=Store(r, purge_grace_s=0, cache_reads=True))
    if cluster:
        assert client.store.loop_redis() is None  # every master's reads: the thread path
        pytest.skip("a Cluster keeps the thread path")
    assert _answer(client, HELD) == _answer(client, HELD) == {"a": N * 256, "b": 100 * 256}  # copies kept
    assert _thread(client, fresh(99)) == {"a": (N - 1) * 256, "b": 100 * 256}  # loads the digest script
    return client


def test_loop_reads_answer_as_the_thread_does_many_at_once(client, fleet):
    conn = client.store.loop_redis()
    assert conn is not None
    want = {"a": (N - 1) * 256, "b": 100 * 256}
    prompts = [fresh(i) for i in range(8)]
    cached = client.store.records.cached
    hits = cached.stats["hits"]

    async def main():
        return await asyncio.gather(*[_in_loop(client, conn, t) for t in prompts])

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == [want] * 8 == [_thread(client, t) for t in prompts]
        assert cached.stats["hits"] >= hits + 2 * 8 * (N - 1)  # the held prefix from the copies, both ways
        new = HashProfile().chunk_hashes(prompts[3])[-1]
        fleet.apply([("a", 0, CPU, [(ADMIT, new)])])  # the new chunk stored: read at once
        got = loop.run_until_complete(main())
        assert got[3] == {"a": N * 256, "b": 100 * 256} and got[:3] + got[4:] == [want] * 7
    finally:
        loop.close()


def test_a_failed_loop_read_leaves_it_to_the_thread_and_the_next_one_works(client, r):
    conn = client.store.loop_redis()
    assert conn is not None
    want = {"a": (N - 1) * 256, "b": 100 * 256}

    async def scenario():
        out = [await _in_loop(client, conn, fresh(0))]
        r.script_flush()  # the digest script is gone: NOSCRIPT
        with pytest.raises(NeedsRedis):
            await _in_loop(client, conn, fresh(1))
        out.append(_thread(client, fresh(1)))  # the thread loads it again
        out.append(await _in_loop(client, conn, fresh(2)))
        ids = [c["id"] for c in r.client_list() if c["name"] == CLIENT_NAME]
        assert len(ids) == 1  # one connection for all of them
        r.client_kill_filter(_id=ids[0])
        await asyncio.sleep(0.2)  # the loop sees it closed
        out.append(await _in_loop(client, conn, fresh(3)))  # a new connection
        return out

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(scenario()) == [want] * 4
    finally:
        loop.close()


def test_which_clients_get_a_loop_connection(tmp_path):
    """TCP and Unix sockets with their password and db get one; TLS and a Sentinel master do not."""
    tcp = loop_redis_for(connect("redis://:pw@127.0.0.1:7000/3"))
    assert tcp is not None and tcp.where == ("tcp", "127.0.0.1", 7000)
    assert tcp.hello == [("AUTH", "pw"), ("SELECT", 3), ("CLIENT", "SETNAME", CLIENT_NAME)]
    unix = loop_redis_for(connect(f"unix://{tmp_path}/r.sock"))
    assert unix is not None and unix.where == ("unix", f"{tmp_path}/r.sock")
    assert loop_redis_for(connect("rediss://127.0.0.1:7000")) is None
    assert loop_redis_for(redis.Redis(protocol=3, decode_responses=True)) is None
    sentinel = connect("redis+sentinel://127.0.0.1:26379/mymaster")
    assert loop_redis_for(sentinel) is None
    assert Store(connect("redis://127.0.0.1:7000")).loop_redis() is None  # caching off: no copies to peek
