"""After a failover: tell that a master was replaced, and keep what must be written again.

Redis replicates asynchronously. When a master dies, writes it acknowledged but had not yet
sent to its replica are gone once the replica takes over (Redis Cluster or Sentinel alike; a
restarted server without fsync'd AOF loses its last second too). The index heals from that in
two ways (docs/scaling.md, "Failover"):

- :class:`MasterWatch` notices that a master which served the index is no longer serving it
  (a replica was promoted, or the server restarted), by the masters' ``run_id``.
- :class:`Journal` keeps the recent record writes (kvlookup.index.store.Store.keep_journal), so
  they can be written again once some may be lost. Admits and evicts are idempotent (ZADD/ZREM
  of one holder), so rewriting a suffix of the writes, in order, to the holders they were
  written for, leaves exactly the state the writes meant.

For 0.3.12+ LMCache workers the sidecar also asks for a full sync (sidecar.lmcache_ingest),
which heals what the journal cannot: registry writes (registrations, retirements) and writes
older than the journal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

SLOTS = 16384
#: Seconds of writes a :class:`Journal` keeps by default: more than a Redis Cluster failover
#: takes with the default cluster-node-timeout (15 s; the replica takes over within ~2x that).
JOURNAL_S = 60.0
#: Operations a :class:`Journal` keeps at most by default (about 100 B each in memory).
JOURNAL_MAX_OPS = 1_000_000


def slot_ranges(slots: list) -> list[tuple]:
    """A shard's ``slots`` from redis-py's ``cluster_shards()`` as ``[(start, end), ...]``: redis-py
    up to 8.1 gives the server's flat ``[start, end, start, end, ...]``, 8.2 pairs them."""
    if slots and isinstance(slots[0], (list, tuple)):
        return [tuple(pair) for pair in slots]
    return [(slots[i], slots[i + 1]) for i in range(0, len(slots), 2)]


def serving_masters(client) -> frozenset[str] | None:
    """The ``run_id`` of every master serving the index now, or None when that cannot be told
    (a master unreachable, slots without a serving master: a failover in progress).

    client: redis-py ``Redis`` (one server, or a Sentinel ``master_for`` client) or
    ``RedisCluster`` (every master that owns slots, read from ``CLUSTER SHARDS``).
    """
    try:
        if not isinstance(client, RedisCluster):
            return frozenset([client.info("server")["run_id"]])
        ids, covered = set(), 0
        for shard in client.cluster_shards():
            slots = shard.get("slots") or []
            if not slots:
                continue
            masters = [n for n in shard["nodes"] if n.get("role") == "master" and n.get("health") == "online"]
            if len(masters) != 1:
                return None
            node = client.get_node(host=masters[0].get("endpoint") or masters[0]["ip"], port=int(masters[0]["port"]))
            if node is None:  # a master this client has not met: learn the topology, ask next time
                client.nodes_manager.initialize()
                return None
            ids.add(client.info("server", target_nodes=node)["run_id"])
            covered += sum(int(end) - int(start) + 1 for start, end in slot_ranges(slots))
        return frozenset(ids) if covered == SLOTS else None
    except (redis.RedisError, OSError, KeyError, ValueError) as exc:
        log.debug("cannot tell the serving masters: %s", exc)
        return None


class MasterWatch:
    """Tells, at most every ``every_s`` seconds, whether a master that served the index has
    stopped serving it since the last look (failed over, restarted, or removed).

    A master added (resharding onto a new node) is not a loss; a master replaced is. Nothing
    is reported while the masters cannot be read (during the failover itself): the watch
    answers once the index is served again, so what is done about it lands on the new master.
    """

    def __init__(self, client, every_s: float = 1.0,
                 read: Callable[[Any], frozenset[str] | None] = serving_masters):
        self.client = client
        self.every_s = every_s
        self._read = read
        self._seen: frozenset[str] | None = None
        self._next = 0.0

    def replaced(self) -> bool:
        """True once after a master seen before stopped serving; never raises."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every_s
        current = self._read(self.client)
        if current is None:
            return False
        gone = self._seen - current if self._seen is not None else frozenset()
        self._seen = current
        if gone:
            log.warning("Redis master(s) %s no longer serve the index (now %s): writes they had not "
                        "replicated may be lost", ", ".join(sorted(gone)), ", ".join(sorted(current)))
        return bool(gone)


class Journal:
    """What was written in the last ``keep_s`` seconds (at most ``max_ops`` operations), oldest
    first: add() each write once it is acknowledged; items() gives them to write again (they
    stay, in case another failover follows). Thread-safe."""

    def __init__(self, keep_s: float = JOURNAL_S, max_ops: int = JOURNAL_MAX_OPS):
        self.keep_s, self.max_ops = keep_s, max_ops
        self._items: deque[tuple[float, Any, int]] = deque()  # (written at, item, its ops)
        self.ops = 0
        self._cut_at = float("-inf")  # when the newest item dropped for max_ops was written
        self._lock = threading.Lock()

    def add(self, item: Any, ops: int) -> None:
        """Keep ``item`` (``ops`` operations), written now."""
        with self._lock:
            now = time.monotonic()
            self._items.append((now, item, ops))
            self.ops += ops
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._items and (self._items[0][0] < now - self.keep_s or self.ops > self.max_ops):
            at, _item, n = self._items.popleft()
            self.ops -= n
            if at >= now - self.keep_s:
                self._cut_at = at

    def items(self) -> tuple[list[Any], float]:
        """The items kept, oldest first, and how many seconds back they reach (less than
        ``keep_s`` when ``max_ops`` cut the journal short)."""
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            return [item for _at, item, _n in self._items], min(self.keep_s, now - self._cut_at)
