"""Plain commands to one Redis in one pipelined round trip, and the helpers every backend uses
to read replies (script shas, errors)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import hiredis
import redis
from redis.exceptions import NoScriptError, ResponseError

from kvlookup.index import keys

#: Reverse-index buckets read per purge round trip.
PURGE_BUCKETS_PER_STEP = 64


class SingleIO:
    """Commands to one Redis (or a Sentinel's current master) in one pipelined round trip,
    packed by hiredis: redis-py encodes each argument in Python (~1 µs; an APPLY_OPS call of
    5,000 ops has 15,000 arguments). Scripts registered here are loaded again on a server that
    lost them (a restart without persistence of its script cache, a Sentinel failover)."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._scripts: dict[str, str] = {}

    def register(self, script: str) -> str:
        """A Lua script's sha, for ``("EVALSHA", sha, numkeys, ...)``; it is loaded the first time
        a server says NOSCRIPT (so nothing connects until the first call)."""
        sha = script_sha(script)
        self._scripts[sha] = script
        return sha

    def execute(self, commands: Sequence[tuple]) -> list:
        """Results in order; a command error is returned as its ResponseError. Raises
        redis.ConnectionError / TimeoutError when the server is unreachable."""
        return self.send(commands)()

    def send(self, commands: Sequence[tuple]) -> Callable[[], list]:
        """:meth:`execute` in two steps: ``commands`` are sent now, on a connection held until
        the returned function (call it once) reads their replies; the caller works meanwhile
        (sidecar.vllm_writer). Both steps raise as :meth:`execute` does."""
        read = self._send(commands)

        def replies() -> list:
            out = read()
            lost = [i for i, res in enumerate(out)
                    if isinstance(res, NoScriptError) and commands[i][1] in self._scripts]
            if lost:
                for sha in {commands[i][1] for i in lost}:
                    self.r.script_load(self._scripts[sha])
                for i, res in zip(lost, self._send([commands[i] for i in lost])(), strict=True):
                    out[i] = res
            return out

        return replies

    def _send(self, commands: Sequence[tuple]) -> Callable[[], list]:
        if not commands:
            return list
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([b"".join(hiredis.pack_command(c) for c in commands)], check_health=False)
        except BaseException:
            conn.disconnect()  # maybe half sent: never reuse this connection
            pool.release(conn)
            raise

        def read() -> list:
            try:
                out: list = []
                for _ in commands:
                    try:
                        out.append(conn.read_response())
                    except ResponseError as exc:
                        out.append(exc)
                return out
            except BaseException:
                conn.disconnect()  # replies may be left unread: never reuse this connection
                raise
            finally:
                pool.release(conn)

        return read


def script_sha(script: str) -> str:
    """The SHA1 hex digest Redis names a script by (``SCRIPT LOAD``'s answer)."""
    return hashlib.sha1(script.encode()).hexdigest()


def raise_errors(results: list) -> list:
    """``results`` unchanged, or the first command error raised."""
    for res in results:
        if isinstance(res, Exception):
            raise res
    return results


def purge_step(run, chunk_op: str, holder_id: str, space: str, bucket: int, budget: int) -> tuple[int, int]:
    """One purge step over plain commands; ``run(commands) -> results`` executes one batch;
    ``chunk_op`` is the sha of ``scripts.CHUNK_OP`` (a record leaves its chunk set with the set's digest kept).

    ``bucket`` is the progress: ``b >= 0`` walks the buckets the holder's bucket set
    (keys.holder_buckets_key) names, from bucket ``b``; once they are done and the holder's
    record count says nothing is left, the holder is done, otherwise (records written without
    naming their bucket: by an older kvlookup) every bucket is swept, progress ``-1 - b`` at bucket ``b``.
    So a purge costs what the holder holds (a few commands for one record), not 2048 reads.

    Reads at most PURGE_BUCKETS_PER_STEP buckets per round trip, removes their records from the
    chunk sorted sets and only then from the buckets (so a bucket always lists at least the
    records that remain: a step cut short by a crash is redone, never leaks), and lowers the
    holder's record count by what left the buckets. Returns (records removed, next progress);
    ``keys.HOLDER_CHUNK_BUCKETS`` once every bucket is empty.
    """
    nb = keys.HOLDER_CHUNK_BUCKETS
    removed = 0
    if bucket >= 0:
        marked = raise_errors(run([("SMEMBERS", keys.holder_buckets_key(holder_id))]))[0]
        todo = sorted(b for b in map(int, marked) if b >= bucket)
        while todo and removed < budget:
            n, todo = _purge_buckets(run, chunk_op, holder_id, space, todo, budget - removed)
            removed += n
        if todo:
            return removed, todo[0]
        left = raise_errors(run([("HGET", keys.records_key(), holder_id)]))[0]
        if int(left or 0) <= 0:
            return removed, nb
        bucket = -1  # records in buckets the set does not name: sweep every bucket
    todo = list(range(-1 - bucket, nb))
    while todo and removed < budget:
        n, todo = _purge_buckets(run, chunk_op, holder_id, space, todo, budget - removed)
        removed += n
    return removed, (-1 - todo[0]) if todo else nb


def _purge_buckets(run, chunk_op: str, holder_id: str, space: str, todo: list[int], want: int) -> tuple[int, list[int]]:
    """Purge up to ``want`` records from the first PURGE_BUCKETS_PER_STEP buckets of ``todo``;
    returns (records removed, the buckets still to read, a partly read one first)."""
    prefix = keys.chunk_prefix(space)
    span = todo[:PURGE_BUCKETS_PER_STEP]
    found = run([("SRANDMEMBER", keys.holder_chunks_key(holder_id, b), want) for b in span])
    take, total, rest = [], 0, len(span)
    for i, members in enumerate(found):
        if total >= want:
            rest = i
            break
        if members:
            take.append((span[i], members))
            total += len(members)
        if len(members) >= want:  # maybe more left there
            rest = i
            break
    raise_errors(run([("EVALSHA", chunk_op, 1, prefix + h, holder_id, "") for _b, members in take for h in members]))
    gone = sum(int(n) for n in run([("SREM", keys.holder_chunks_key(holder_id, b), *members) for b, members in take]))
    if gone:
        run([("HINCRBY", keys.records_key(), holder_id, -gone)])
    return gone, todo[rest:]
