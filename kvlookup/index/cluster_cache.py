"""Cached reads on a Redis Cluster: one :class:`kvlookup.index.tracking.CachedReads` per master,
so the cluster's lookups read from process-local copies as one server's do.

Client-side caching is per server: a master tracks the keys this process read from it and
sends their invalidations to this process's invalidation connection on that master. Each
master's copies are kept coherent by that master alone, as on one server; a lookup's chunk keys
spread over every master, so :meth:`ClusterCachedReads.execute` splits its cacheable reads
(``ZRANGE`` of a chunk set, ``GET`` of the registry version) by the master that serves their
slot and asks each master's CachedReads (from copies; a round trip to that master for the rest).
Everything else (RESOLVE, writes) and every read a master answers with a redirection (MOVED,
ASK: a slot moved, a failover), a cluster error or a lost connection goes through
:class:`kvlookup.index.cluster_io.ClusterIO`, which follows redirections and refreshes the
slot map; the next lookup asks the slot's new master. A copy never outlives its key on the
master it was read from: a slot migrating away deletes its keys there, which invalidates them.

Equal member lists are one object across masters (one shared dict of kept tuples), so a prefix
held by the whole fleet is a run of the same object, as on one server (kvlookup.index.copies).

What a cluster adds: a master demoted to a replica while it stays up (a manual failover) keeps
answering from the copies read from it, invalidated as the replication stream changes them, until a
miss on that master gets a MOVED; meanwhile a lookup reads as from a replica (behind by the
replication lag). A master frozen (hung, partitioned: no socket closes) is trusted only while its
invalidation connection answers a PING (tracking.LISTENER_TRUST_S), so a failover away from it is
seen. ``lookup_cache_keys`` bounds each master's copies.
"""

from __future__ import annotations

import select
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from redis.exceptions import AskError, ClusterDownError, RedisError, TryAgainError

from kvlookup.index.cluster_io import ClusterIO, slot_of
from kvlookup.index.copies import MISS, Copies
from kvlookup.index.tracking import LOCAL_ONLY, RECONNECT_S, CachedReads, MasterHung, NeedsRedis, as_fields, cacheable

#: Keys whose slot a ClusterCachedReads remembers (all forgotten at once past it): about
#: 150 B a key (the dict entry and the key string it keeps alive), so ~30 MiB per worker at most.
SLOTS_KEPT = 200_000

#: Replies that say the command must be sent again elsewhere (ClusterIO does that).
REDIRECTED = (AskError, ClusterDownError, TryAgainError)  # MovedError is an AskError


class ClusterCachedReads:
    """A caching executor of commands for a cluster (see the module docstring).

    io: the cluster's ClusterIO (slot map, redirections, the commands not cached). max_keys and
    fence: as CachedReads, per master; copies: makes each master's copies (None: CachedReads'
    own; kvlookup.index.mp_copies bounds them by fields). Thread-safe.
    """

    def __init__(self, io: ClusterIO, max_keys: int = 200_000, fence: bool = False,
                 copies: Callable[[], Copies] | None = None):
        self.io = io
        self.max_keys, self.fence = max_keys, fence
        self._make_copies = copies
        self._masters: dict[tuple[str, int], CachedReads] = {}
        self._shared: dict[tuple, tuple] = {}
        self._slot: dict[str, int] = {}  # key -> its slot (a pure function of the key)
        self._map: list | None = None  # the slot map the masters were last pruned by
        self._plain = 0  # cacheable reads sent through ClusterIO (untracked)
        self._lock = threading.Lock()
        self._refreshed: dict[tuple[str, int], float] = {}  # hung master -> when the slot map was read for it

    def register(self, script: str) -> str:
        """A Lua script's sha for ``("EVALSHA", sha, ...)`` (scripts always go through ClusterIO)."""
        return self.io.register(script)

    def local_now(self) -> bool:
        """Are reads answered from copies now on every master read so far (unfenced, each
        master's invalidation connection up)?"""
        masters = list(self._masters.values())
        return bool(masters) and all(m.local_now() for m in masters)

    @property
    def stats(self) -> dict[str, int]:
        """CachedReads' counters summed over the masters."""
        out: dict[str, int] = defaultdict(int)
        for m in list(self._masters.values()):
            for k, v in m.stats.items():
                out[k] += v
        return dict(out)

    # -- what changed since (kvlookup.index.kept: whole lookups kept, as on one server) ------

    def since(self) -> tuple[tuple, int]:
        """A mark for :meth:`unchanged`, taken before the reads it covers: (the slot map and each
        master's CachedReads mark, reads sent untracked so far); its [1] moves whenever a
        cacheable read went untracked (as CachedReads.since)."""
        masters = tuple((addr, reads, reads.since()) for addr, reads in list(self._masters.items()))
        return (self.io.slot_map(), masters, self._plain), self._plain + sum(m[2][1] for m in masters)

    def unchanged(self, names: Sequence[str], mark: tuple[tuple, int]) -> bool:
        """Is no key of ``names`` (each read through :meth:`execute` after ``mark``) known to have
        changed since? Every master asks its CachedReads.unchanged (one ``select`` for all of
        them; a master's invalidations name only its own keys, so each is given every name);
        False, never a wrong True, when the slot map changed, a master was added, a read went
        untracked, or any master says so."""
        (slots, masters, plain), _total = mark
        if slots is not self.io.slot_map() or self._plain != plain or len(self._masters) != len(masters):
            return False
        readable = _readable([sock for _addr, reads, _m in masters for sock in reads.watched()])
        for _addr, reads, m in masters:
            if not reads.unchanged(names, m, readable):
                return False
        return True

    def execute(self, commands: Sequence[tuple]) -> list:
        """Results of ``commands`` in order (errors as ClusterIO.execute). Under LOCAL_ONLY it
        raises NeedsRedis before sending anything when a command needs a round trip."""
        local = LOCAL_ONLY.get()
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        rest: list[int] = []
        slots, slot = self.io.slot_map(), self._slot
        if len(slot) > SLOTS_KEPT:
            slot.clear()
        for i, cmd in enumerate(commands):
            if cacheable(cmd):
                key = cmd[1]
                s = slot.get(key)
                if s is None:
                    s = slot[key] = slot_of(key)
                groups[slots[s]].append(i)
            else:
                rest.append(i)
        if rest and local:
            raise NeedsRedis()
        if slots is not self._map:
            self._drop_gone(slots)
        out: list = [None] * len(commands)
        masters = []
        for addr, idx in groups.items():
            reads = self._master(addr) if addr[0] else None
            if reads is None:
                rest += idx
            else:
                masters.append((addr, reads, idx))
        readable = _readable([sock for _addr, reads, _idx in masters for sock in reads.watched()])
        for addr, reads, idx in masters:
            try:
                got = reads.execute([commands[i] for i in idx], readable)
            except (RedisError, OSError) as exc:  # the master is gone: ClusterIO retries and refreshes
                self._hung(addr, exc)
                if local:
                    raise NeedsRedis() from None
                rest += idx
                continue
            for i, res in zip(idx, got, strict=True):
                if isinstance(res, REDIRECTED):
                    rest.append(i)
                else:
                    out[i] = res
        if rest:
            if local:
                raise NeedsRedis()
            rest.sort()
            if any(cacheable(commands[i]) for i in rest):
                self._plain += 1  # untracked: no invalidation will tell of it (since/unchanged)
            for i, res in zip(rest, self.io.execute([commands[i] for i in rest]), strict=True):
                out[i] = res
        return out

    def whole_hashes(self, names: Sequence[str], script: str) -> list:
        """As :meth:`kvlookup.index.tracking.CachedReads.whole_hashes`, each master asked for its
        own names; a master gone or redirecting has its names read untracked through ClusterIO
        (the script, one call a slot). Under LOCAL_ONLY, NeedsRedis when a name is not kept."""
        local = LOCAL_ONLY.get()
        slots = self.io.slot_map()
        if slots is not self._map:
            self._drop_gone(slots)
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        slot = self._slot
        for i, key in enumerate(names):
            s = slot.get(key)
            if s is None:
                s = slot[key] = slot_of(key)
            groups[slots[s]].append(i)
        out: list = [None] * len(names)
        rest: list[int] = []
        masters = [(addr, self._master(addr) if addr[0] else None, idx) for addr, idx in groups.items()]
        readable = _readable([sock for _addr, reads, _idx in masters if reads is not None for sock in reads.watched()])
        for addr, reads, idx in masters:
            try:
                if reads is None:
                    raise NeedsRedis() if local else RedisError("no master")
                got = reads.whole_hashes([names[i] for i in idx], script, readable)
            except (RedisError, OSError) as exc:  # gone or redirected: ClusterIO follows, refreshes
                self._hung(addr, exc)
                if local:
                    raise NeedsRedis() from None
                rest += idx
                continue
            for i, res in zip(idx, got, strict=True):
                out[i] = res
        if rest:
            self._plain += 1
            self._untracked(names, rest, script, out)
        return out

    def _untracked(self, names: Sequence[str], idx: list[int], script: str, out: list) -> None:
        """``script`` over ``names[idx]`` through ClusterIO, one call per slot, into ``out``."""
        by_slot: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            by_slot[slot_of(names[i])].append(i)
        sha = self.io.register(script)
        calls = list(by_slot.values())
        got = self.io.execute([("EVALSHA", sha, len(part), *(names[i] for i in part)) for part in calls])
        for part, res in zip(calls, got, strict=True):
            if isinstance(res, Exception):
                raise res
            for i, reply in zip(part, res, strict=True):
                out[i] = as_fields(reply)

    def peek(self, reads: list[tuple[str, str]]) -> list:
        """As :meth:`kvlookup.index.tracking.CachedReads.peek`, over every master read so far
        (a key of a master not read yet, or of a slot map that moved, is a MISS); sends nothing."""
        out: list = [MISS] * len(reads)
        slots = self.io.slot_map()
        if slots is not self._map:
            return out
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        slot = self._slot
        for i, (_name, key) in enumerate(reads):
            s = slot.get(key)
            if s is None:
                s = slot[key] = slot_of(key)
            groups[slots[s]].append(i)
        masters = [(m, idx) for addr, idx in groups.items() if (m := self._masters.get(addr)) is not None]
        readable = _readable([sock for m, _idx in masters for sock in m.watched()])
        for m, idx in masters:
            for i, res in zip(idx, m.peek([reads[i] for i in idx], readable), strict=True):
                out[i] = res
        return out

    def _hung(self, addr: tuple[str, int], exc: Exception) -> None:
        """A master that left a round trip unanswered (tracking.MasterHung): read the slot map again
        first (it asked last), so the reads go to the replica that took over, not to wait out the
        socket timeout on the hung one (a master that is only slow is still named and waited for)."""
        if isinstance(exc, MasterHung):
            now = time.monotonic()
            if now - self._refreshed.get(addr, -1e9) >= RECONNECT_S:  # one refresh per hung master a second
                self._refreshed[addr] = now
                self.io.refresh(avoid=addr)

    def _drop_gone(self, slots: list[tuple[str, int]]) -> None:
        """A new slot map: forget (and disconnect) the copies of masters that serve no slot now
        (failed over, removed), so they hold no connection and are not asked :meth:`local_now`."""
        with self._lock:
            if slots is self._map:
                return
            serving = set(slots)
            for addr in [a for a in self._masters if a not in serving]:
                self._masters.pop(addr).close()
            self._map = slots

    def _master(self, addr: tuple[str, int]) -> CachedReads | None:
        reads = self._masters.get(addr)
        if reads is None:
            with self._lock:
                reads = self._masters.get(addr)
                if reads is None:
                    try:
                        node = self.io.client_of(addr)
                    except RedisError:
                        return None
                    made = self._make_copies() if self._make_copies is not None else None
                    reads = self._masters[addr] = CachedReads(node, max_keys=self.max_keys, fence=self.fence,
                                                              shared=self._shared, copies=made, hung_raises=True)
        return reads


def _readable(socks: list) -> set:
    """The sockets of ``socks`` readable now: one ``select`` for every master a lookup reads
    (each master's CachedReads then reads only an invalidation connection that has something,
    instead of one ``select`` and one poll a master: issue 18, the cluster's fixed cost)."""
    if not socks:
        return set()
    try:
        return set(select.select(socks, [], [], 0)[0])
    except (OSError, ValueError):  # a socket closed under us: each master looks at its own
        return set(socks)
