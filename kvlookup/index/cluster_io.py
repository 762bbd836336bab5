"""Plain single-key commands to the masters of a Redis Cluster: one pipelined round trip per
node, every node at once, with MOVED/ASK redirections and failover followed.

Why not redis-py's ``ClusterPipeline``: it builds several Python objects per command and
answers one node after another; 128 ``ZRANGE`` calls (a 32k-token lookup) cost 3.8-5.8 ms
through it and about 1 ms here (measured side by side, docs/benchmarks-notes.md). This module
keeps everything else to redis-py: the slot map (``RedisCluster.nodes_manager``), the
connection pools, RESP parsing, the redirection errors; hiredis packs the commands.
"""

from __future__ import annotations

import inspect
import logging
import time
from binascii import crc_hqx
from collections import defaultdict
from collections.abc import Sequence

import hiredis
from redis.cluster import PRIMARY, ClusterNode, NodesManager, RedisCluster, get_node_name
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

#: A command: its name, the key that routes it, then the other arguments; ``EVALSHA``
#: commands (``"EVALSHA", sha, numkeys, key, ...``) are routed by their first key.
Command = tuple

#: Pause before retrying after a lost node or CLUSTERDOWN (a replica takes over meanwhile).
RETRY_PAUSE_S = 0.1
SLOTS = 16384
#: redis-py >= 8.1 can be told which node failed, to ask it last when it reads the topology again.
_DEFERS_FAILED = "last_failed_node_name" in inspect.signature(NodesManager.initialize).parameters


def slot_of(key: str) -> int:
    """The cluster hash slot of a key (CRC16 of the key, or of its ``{hash tag}``)."""
    if "{" in key:
        return key_slot(key.encode())
    return crc_hqx(key.encode(), 0) % SLOTS


def routing_key(cmd: Command) -> str:
    """The key a command is routed by."""
    return cmd[3] if cmd[0] == "EVALSHA" else cmd[1]


class ClusterIO:
    """Runs batches of single-key commands (and single-slot EVALSHA) on a cluster's masters.

    rc: the cluster client (its slot map and connection pools are used).
    retry_s: how long a batch keeps retrying commands whose node is gone (failover, a node
    restarting) before the last error is raised.

    ``stats`` counts, per kind, the commands that had to be sent again: ``moved`` and ``ask``
    (redirections followed: resharding, failover), ``tryagain`` (a multi-key command on a slot
    being migrated), ``clusterdown`` (a failover in progress), ``node_lost`` (a node that did
    not answer), ``noscript`` (a master without the script yet).
    """

    def __init__(self, rc: RedisCluster, retry_s: float = 10.0):
        self.rc = rc
        self.retry_s = retry_s
        self.stats = dict.fromkeys(("moved", "ask", "tryagain", "clusterdown", "node_lost", "noscript"), 0)
        self._slots: list[tuple[str, int]] | None = None  # slot -> its master (host, port)
        self._scripts: dict[str, str] = {}  # sha -> source, for masters that lack a script
        self._unanswered: tuple[str, int] | None = None  # the last node that timed out (asked last)

    def register(self, script: str) -> str:
        """A Lua script's sha, for ``("EVALSHA", sha, ...)``; a master that answers NOSCRIPT gets
        it loaded (so nothing connects until the first call)."""
        import hashlib

        sha = hashlib.sha1(script.encode()).hexdigest()
        self._scripts[sha] = script
        return sha

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
                self.refresh(self._unanswered)
                self._unanswered = None
            todo = retry
        return results

    # -- topology ----------------------------------------------------------------------------

    def refresh(self, avoid: tuple[str, int] | None = None) -> None:
        """Read the slot map again now, asking the master at ``avoid`` (one that left a round trip
        unanswered: hung, or failed over while frozen) last. Never raises."""
        self._slots = None
        try:
            if avoid is not None and _DEFERS_FAILED:
                self.rc.nodes_manager.initialize(last_failed_node_name=get_node_name(*avoid))
            else:
                self.rc.nodes_manager.initialize()
        except RedisError as exc:  # the next round fails fast and we retry until the deadline
            log.debug("cluster topology refresh failed: %s", exc)

    def slot_map(self) -> list[tuple[str, int]]:
        """(host, port) of the master serving each slot in the slot map as last read (("", 0)
        where none does); a redirection or a lost node makes the next call read it again."""
        return self._slot_map()

    def client_of(self, addr: tuple[str, int]):
        """The redis-py client of the master at ``addr`` (RedisConnectionError for ("", 0))."""
        return self._client(addr)

    def _slot_map(self) -> list[tuple[str, int]]:
        if self._slots is None:
            cache = self.rc.nodes_manager.slots_cache
            self._slots = [(cache[s][0].host, cache[s][0].port) if cache.get(s) else ("", 0) for s in range(SLOTS)]
        return self._slots

    # -- one round: send every node its commands, then read every node's replies -------------

    def _round(self, commands, todo, asking, results) -> tuple[list[int], Exception | None]:
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        slots = self._slot_map()
        for i in todo:
            groups[asking.get(i) or slots[slot_of(routing_key(commands[i]))]].append(i)
        retry: list[int] = []
        error: Exception | None = None
        sent = []
        for addr, idx in groups.items():
            try:
                sent.append((addr, idx, *self._send(addr, [commands[i] for i in idx], [i in asking for i in idx])))
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                retry.extend(idx)
                error = exc
                self.stats["node_lost"] += len(idx)
                self._note_unanswered(addr, exc)
        for addr, idx, pool, conn in sent:
            r, e, missing = self._read(conn, commands, idx, asking, results)
            pool.release(conn)
            self._note_unanswered(addr, e)
            for sha in missing:
                self._client(addr).script_load(self._scripts[sha])
            retry.extend(r)
            error = e or error
        return retry, error

    def _note_unanswered(self, addr: tuple[str, int], exc: Exception | None) -> None:
        """A node that timed out (hung, or frozen while a replica takes over) is asked last when
        the slot map is read again: asking it first would wait out the socket timeout again."""
        if isinstance(exc, (RedisTimeoutError, TimeoutError)):
            self._unanswered = addr

    def _client(self, addr: tuple[str, int]):
        """The redis-py client of one master. A node named by an ASK before this client's slot
        map lists it (a new, still empty master receiving its first slot) is added to the map's
        nodes, as redis-py adds the node of a MOVED."""
        if not addr[0]:  # a slot no master serves (yet)
            self.refresh()
            raise RedisConnectionError("a slot is not served by any cluster node")
        node = self.rc.get_node(addr[0], addr[1])
        if node is None:
            new = ClusterNode(addr[0], addr[1], PRIMARY)
            node = self.rc.nodes_manager.nodes_cache.setdefault(new.name, new)
        return self.rc.get_redis_connection(node)

    def _send(self, addr: tuple[str, int], cmds: list[Command], ask: list[bool]):
        pool = self._client(addr).connection_pool
        conn = pool.get_connection()
        try:
            packed = [hiredis.pack_command(("ASKING",)) + hiredis.pack_command(cmd) if asked
                      else hiredis.pack_command(cmd) for cmd, asked in zip(cmds, ask, strict=True)]
            conn.send_packed_command([b"".join(packed)], check_health=False)
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        return pool, conn

    def _read(self, conn, commands, idx, asking, results):
        """Read one node's replies; returns (to retry, error, script shas it lacks)."""
        retry: list[int] = []
        error: Exception | None = None
        missing: set[str] = set()
        for n, i in enumerate(idx):
            try:
                if asking.pop(i, None) is not None:
                    conn.read_response()  # ASKING's OK
                results[i] = conn.read_response()
            except MovedError as exc:
                self.rc.nodes_manager.move_slot(exc)
                self._slots = None
                retry.append(i)
                self.stats["moved"] += 1
            except AskError as exc:
                asking[i] = exc.node_addr
                retry.append(i)
                self.stats["ask"] += 1
            except (TryAgainError, ClusterDownError) as exc:  # the slot is moving or failing over
                retry.append(i)
                error = exc
                self.stats["tryagain" if isinstance(exc, TryAgainError) else "clusterdown"] += 1
            except NoScriptError as exc:  # a master that never saw the script (a promoted replica)
                if commands[i][1] in self._scripts:
                    missing.add(commands[i][1])
                    retry.append(i)
                    self.stats["noscript"] += 1
                else:
                    results[i] = exc
            except ResponseError as exc:
                results[i] = exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                conn.disconnect()
                self.stats["node_lost"] += len(idx) - n
                return retry + idx[n:], exc, missing  # the node is gone: nothing more to read from it
        return retry, error, missing
