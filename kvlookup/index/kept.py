"""Whole lookups kept while nothing they read changed (cached reads only: kvlookup.index.tracking on one
server, kvlookup.index.cluster_cache on a cluster).

A lookup of a long prompt reads its chains in stages (kvlookup.index.staged), so the walk memo
there (one-round lookups only) does not apply to it, and reading 2,000 chunk copies and walking
them costs milliseconds in Python. :class:`KeptLookups` keeps such a lookup's answer under its
chains (each chain's space, chunk size, length and last hash: the hashes are chained, so the
last names the whole prefix) with the names of every key it read. A later lookup of the same
chains gets that answer while

- Redis told of no change to any of those keys since the first read (every read went through a
  tracked connection: a chunk set written, a chunk that was empty filled, the registry version
  moved; :meth:`kvlookup.index.tracking.CachedReads.unchanged`),
- no holder answer changed (:attr:`kvlookup.index.staged.HolderCache.gen`), no counting
  holder's ``until`` passed (its lease or heartbeat) and none left out for a lapsed lease would
  count again (a clock judged as of an earlier time): the walk memo's rule,
  :meth:`kvlookup.index.staged.HolderCache.window`,

so it is the answer a new walk would give. The hashing of the prompt is not skipped (the key
is its chains). Answers that matched nothing are not kept (fresh prompts churn nothing), but for
those whose first chunk had holders none of which count (``dead_instance``: a prompt held by a
dead fleet whose records are not purged yet, its leases lapsed: kvlookup.index.staged.HolderCache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvlookup.index.records import Chain, Liveness, Matches
from kvlookup.index.staged import MEMO_MAX, Execute, HolderCache, StagedLookup
from kvlookup.index.tracking import CACHED


class TrackedReads(Protocol):
    """Cached reads that can tell what changed: kvlookup.index.tracking.CachedReads (one server)
    or kvlookup.index.cluster_cache.ClusterCachedReads (every master)."""

    def since(self) -> tuple[Any, int]:
        """A mark taken before reads; its [1] moves whenever a read went untracked."""

    def unchanged(self, names: Sequence[str], mark: Any) -> bool:
        """No key of ``names`` (read after ``mark``) known to have changed since."""

    def execute(self, commands: Sequence[tuple]) -> list:
        """Results of ``commands``, from copies where kept."""


class KeptLookups:
    """Answers of whole lookups over ``cached`` (see the module docstring): at most
    :data:`kvlookup.index.staged.MEMO_MAX` answers and ``max_keys`` key names in all (all
    dropped when either is full). Thread- and greenlet-safe (dict operations only)."""

    def __init__(self, cached: TrackedReads, holders: HolderCache, max_keys: int):
        self.cached, self.holders, self.max_keys = cached, holders, max_keys
        self.entries: dict[tuple, tuple[Matches, list[str], Any, tuple[float, float], int]] = {}
        self.names = 0

    def lookup(self, chains: Sequence[Chain], live: Liveness, walk: Callable[[Execute], StagedLookup]) -> Matches:
        """The kept answer of ``chains`` at ``live`` if it still holds, else ``walk(execute).run()``
        (kept when it matched). walk: a :class:`StagedLookup` reading through the given executor."""
        key = (live.worker_ttl_ms, live.check_alive,
               *[(c.prefix, c.chunk_size, c.n_tokens, len(c.hashes), c.hashes[-1]) for c in chains])
        hit = self.entries.get(key)
        if hit is not None:
            answer, names, mark, (after, until), gen = hit
            if gen == self.holders.gen and after < live.now_ms <= until and self.cached.unchanged(names, mark):
                return answer
        mark, gen = self.cached.since(), self.holders.gen
        read: list[str] = []

        def execute(commands: Sequence[tuple]) -> list:
            read.extend(c[1] for c in commands if c[0] in CACHED)
            return self.cached.execute(commands)

        staged = walk(execute)
        out = staged.run()
        # kept only when no holder answer changed while it walked and every read was tracked
        if (out or out.miss == "dead_instance") and gen == self.holders.gen and self.cached.since()[1] == mark[1]:
            self._keep(key, out, read, mark, staged.kept_window or self.holders.window(staged.holders), gen)
        return out

    def _keep(self, key: tuple, out: Matches, read: list[str], mark: Any, window: tuple[float, float],
              gen: int) -> None:
        if len(self.entries) >= MEMO_MAX or self.names + len(read) > self.max_keys:
            self.entries.clear()
            self.names = 0
        out.kept = True  # shared by every lookup that gets it: never changed (kvlookup.client)
        self.entries[key] = (out, read, mark, window, gen)
        self.names += len(read)
