"""The process-local copies behind cached reads (kvlookup.index.tracking): bounded, scan-resistant,
and with equal chunk sets shared.

- **Bounded**: at most ``max_keys`` copies (the ``lookup_cache_keys`` setting).
- **Scan-resistant** (segmented LRU): a new copy enters a *probation* segment; only a copy
  read again while there moves to the *protected* segment (at most ``PROTECTED_SHARE`` of
  ``max_keys``; its least recently used copies fall back to probation). A stream of keys each read
  once (fresh prompts, a working set larger than the cache) only churns probation, so the
  chunks of the prompts that are read again (a shared system prompt) stay.
- **Shared sets**: a chunk's member list is kept as a tuple, and equal tuples as one object, so
  a prompt whose chunks have the same holders (a prefix held by the whole fleet) keeps one
  tuple for all of them, and the walk (kvlookup.index.walk) sees a run of the same holders as
  the same object (``is``) instead of comparing every member, chunk after chunk.

Not thread-safe: the caller (CachedReads) holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict

#: The share of ``max_keys`` that copies read at least twice may take.
PROTECTED_SHARE = 0.8

MISS = object()


class Copies:
    """Copies by key, at most ``max_keys`` (>= 1). shared: the dict of kept tuples (:meth:`share`)
    to use, so several Copies (one per cluster master, kvlookup.index.cluster_cache) keep equal
    sets as one object; a new one by default."""

    def __init__(self, max_keys: int, shared: dict | None = None):
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self.protected_max = max(1, int(max_keys * PROTECTED_SHARE)) if max_keys > 1 else 0
        self.probation: OrderedDict = OrderedDict()
        self.protected: OrderedDict = OrderedDict()
        self._shared: dict[tuple, tuple] = {} if shared is None else shared

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def get(self, key):
        """The copy of ``key`` (marked recently used; a second read promotes it), or MISS."""
        value = self.protected.get(key, MISS)
        if value is not MISS:
            self.protected.move_to_end(key)
            return value
        value = self.probation.pop(key, MISS)
        if value is MISS:
            return MISS
        if self.protected_max:
            self.protected[key] = value
            while len(self.protected) > self.protected_max:
                old, v = self.protected.popitem(last=False)
                self.probation[old] = v  # demoted: the most recently used of probation
        else:
            self.probation[key] = value
        self._bound()
        return value

    def get_many(self, keys: list) -> list:
        """:meth:`get` of each key, in order (one call: a lookup reads thousands)."""
        pget, pmove, get = self.protected.get, self.protected.move_to_end, self.get
        out: list = []
        append = out.append
        for key in keys:
            value = pget(key, MISS)
            if value is MISS:
                value = get(key)
            else:
                pmove(key)
            append(value)
        return out

    def peek_many(self, keys: list) -> list:
        """The copy of each key, or MISS, in order, without marking it used or promoting it (a
        lookup read by digest, kvlookup.index.tracking.CachedReads.peek: a stream of fresh prompts
        over a held prefix costs no LRU moves; the prefix's place is kept by the reads that keep
        it, tracked ones through :meth:`get_many`)."""
        pget, qget = self.protected.get, self.probation.get
        return [v if (v := pget(k, MISS)) is not MISS else qget(k, MISS) for k in keys]

    def share(self, value):
        """``value`` as kept: a list becomes a tuple, equal to (and the same object as) an equal
        one already kept."""
        if isinstance(value, list):
            value = tuple(value)
            if len(self._shared) >= self.max_keys:  # only sharing is lost; the copies stay right
                self._shared.clear()
            value = self._shared.setdefault(value, value)
        return value

    def put(self, key, value) -> None:
        """Keep ``value`` (as :meth:`share` returns it) for ``key``, in probation."""
        self.protected.pop(key, None)
        self.probation[key] = value
        self.probation.move_to_end(key)
        self._bound()

    def pop(self, key) -> None:
        self.protected.pop(key, None)
        self.probation.pop(key, None)

    def clear(self) -> None:
        self.protected.clear()
        self.probation.clear()
        self._shared.clear()

    def _bound(self) -> None:
        while len(self) > self.max_keys:
            if self.probation:
                self.probation.popitem(last=False)
            else:
                self.protected.popitem(last=False)


#: Holder sets a :class:`Digests` keeps (all forgotten at once past it).
DIGESTS_KEPT = 65536


class Digests:
    """Chunk holder sets by digest (``keys.CHUNK_DIGEST_MEMBER``), each kept as one tuple: a lookup
    that reads a chunk's digest (``ZRANGE key 0 1 WITHSCORES``: O(1) whatever the holder count)
    reads the chunk's members only the first time it sees that digest. Content-addressed (an
    entry is the set whose digest it is, checked when it is put), so entries never go stale.

    ``one`` and ``empty`` share the sets a chunk without a digest has (one holder, none)."""

    def __init__(self, max_sets: int = DIGESTS_KEPT):
        self.max_sets = max_sets
        self.sets: dict[int, tuple] = {}
        self.singles: dict[str, tuple] = {}

    def get(self, digest: int) -> tuple | None:
        return self.sets.get(digest)

    def put(self, digest: int, members: tuple) -> tuple:
        """Keep ``members`` (a chunk's ``ZRANGE 0 -1``, digest member first) as the set of ``digest``."""
        if len(self.sets) >= self.max_sets:
            self.sets.clear()
        return self.sets.setdefault(digest, members)

    def one(self, holder_id: str) -> tuple:
        got = self.singles.get(holder_id)
        if got is None:
            if len(self.singles) >= self.max_sets:
                self.singles.clear()
            got = self.singles[holder_id] = (holder_id,)
        return got
