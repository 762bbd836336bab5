"""Plain single-key commands to the masters of a Redis Cluster: one pipelined round trip per
node, every node at once, with MOVED/ASK redirections and failover followed.

Why not redis-py's ``ClusterPipeline``: it builds several Python objects per command and
answers one node after another; 128 ``ZRANGE`` calls (a 32k-token lookup) cost 3.8-5.8 ms
through it and 1.0 ms here (measured side by side, docs/benchmarks-notes.md). This module
keeps everything else to redis-py: the slot map (``RedisCluster.nodes_manager``), the
connection pools, RESP packing and parsing, the redirection errors.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

#: A command: its name, the key that routes it, then the other arguments.
Command = tuple

#: Pause before retrying after a lost node or CLUSTERDOWN (the replica takes over meanwhile).
RETRY_PAUSE_S = 0.1


class ClusterIO:
    """Runs batches of single-key commands on a :class:`RedisCluster`'s masters.

    rc: the cluster client (its slot map and connection pools are used).
    retry_s: how long a batch keeps retrying commands whose node is gone (failover, a node
    restarting) before the last error is raised.
    """

    def __init__(self, rc: RedisCluster, retry_s: float = 10.0):
        self.rc = rc
        self.retry_s = retry_s

    def execute(self, commands: Sequence[Command]) -> list:
        """Results of ``commands`` in order; a command error (WRONGTYPE, ...) is returned as its
        ResponseError. Raises RedisError when a node stays unreachable for ``retry_s``."""
        results: list = [None] * len(commands)
        todo = list(range(len(commands)))
        asking: dict[int, tuple[str, int]] = {}
        deadline = 0.0
        while todo:
            retry, error = self._round(commands, todo, asking, results)
            if not retry:
                break
            now = time.monotonic()
            deadline = deadline or now + self.retry_s
            if now > deadline:
                raise error or RedisConnectionError("cluster commands kept being redirected")
            if error is not None:
                time.sleep(RETRY_PAUSE_S)
                self._refresh()
            todo = retry
        return results

    def _refresh(self) -> None:
        try:
            self.rc.nodes_manager.initialize()
        except RedisError as exc:  # the next round fails fast and we retry until the deadline
            log.debug("cluster topology refresh failed: %s", exc)

    def _round(self, commands, todo, asking, results) -> tuple[list[int], Exception | None]:
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i in todo:
            groups[asking.get(i) or self._addr(commands[i][1])].append(i)
        retry: list[int] = []
        error: Exception | None = None
        sent = []
        for addr, idx in groups.items():
            try:
                sent.append((addr, idx, *self._send(addr, [commands[i] for i in idx],
                                                    [i in asking for i in idx])))
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                retry.extend(idx)
                error = exc
        for _addr, idx, pool, conn in sent:
            r, e = self._read(conn, commands, idx, asking, results)
            retry.extend(r)
            error = e or error
            pool.release(conn)
        return retry, error

    def _addr(self, key: str) -> tuple[str, int]:
        node = self.rc.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        return node.host, node.port

    def _send(self, addr: tuple[str, int], cmds: list[Command], ask: list[bool]):
        node = self.rc.nodes_manager.get_node(addr[0], addr[1]) or self.rc.get_node(addr[0], addr[1])
        if node is None or node.redis_connection is None:
            self._refresh()
            raise RedisConnectionError(f"no connection to cluster node {addr[0]}:{addr[1]}")
        pool = node.redis_connection.connection_pool
        conn = pool.get_connection()
        try:
            args = []
            for cmd, asked in zip(cmds, ask, strict=True):
                if asked:
                    args.append(("ASKING",))
                args.append(cmd)
            conn.send_packed_command(conn.pack_commands(args), check_health=False)
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        return pool, conn

    def _read(self, conn, commands, idx, asking, results) -> tuple[list[int], Exception | None]:
        retry: list[int] = []
        error: Exception | None = None
        for n, i in enumerate(idx):
            try:
                if asking.pop(i, None) is not None:
                    conn.read_response()  # ASKING's OK
                results[i] = conn.read_response()
            except MovedError as exc:
                self.rc.nodes_manager.move_slot(exc)
                retry.append(i)
            except AskError as exc:
                asking[i] = exc.node_addr
                retry.append(i)
            except (TryAgainError, ClusterDownError) as exc:  # the slot is moving or failing over
                retry.append(i)
                error = exc
            except ResponseError as exc:
                results[i] = exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                conn.disconnect()
                return retry + idx[n:], exc  # the node is gone: nothing more to read from it
        return retry, error
