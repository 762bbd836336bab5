"""Process-local complete copies of the LMCache MP chunk buckets (``keys.mp_chunks_key``), kept
coherent by Redis CLIENT TRACKING, as the classic path's chunk sets are (kvlookup.index.tracking,
kvlookup.index.cluster_cache): a bucket is read whole (``HGETALL``, on a tracked connection) and
kept as a dict ``field -> value``; any write to it (a store, delete, access, a fence or a
departure reaching one of its records) makes Redis send its name to this process's invalidation
connection and the copy goes. A complete copy answers a field that is there and one that is not,
so a ``POST /directory/lookup`` whose buckets are all copied needs no round trip (and runs in
app.asgi's event loop); the buckets not copied are read in one round trip and kept.

Bound: at most ``max_fields`` fields over all copies of a process (setting ``mp_copy_fields``;
a bucket with more is read but not kept), least recently used first out (the segmented LRU of
kvlookup.index.copies: a bucket read once waits in probation).
"""

from __future__ import annotations

from kvlookup.index.cluster_cache import ClusterCachedReads
from kvlookup.index.cluster_io import ClusterIO
from kvlookup.index.copies import Copies
from kvlookup.index.tracking import CachedReads

#: Fields kept over all bucket copies of one process by default: ~150-200 B of Python objects a
#: field, so ~40 MiB; 200k fields hold every record of a ~200k-key directory.
DEFAULT_FIELDS = 200_000


class FieldCopies(Copies):
    """:class:`kvlookup.index.copies.Copies` of bucket dicts, bounded by the fields they hold
    (``max_fields`` >= 1) as well as by ``max_keys`` copies. Not thread-safe (CachedReads locks)."""

    def __init__(self, max_keys: int, max_fields: int):
        if max_fields < 1:
            raise ValueError("mp_copy_fields must be at least 1")
        super().__init__(max_keys)
        self.max_fields = max_fields
        self.fields = 0

    def put(self, key, value) -> None:
        self.pop(key)
        if len(value) > self.max_fields:  # a bucket larger than the whole bound: read, never kept
            return
        self.fields += len(value)
        self.probation[key] = value
        self._bound()

    def pop(self, key) -> None:
        old = self.protected.pop(key, None)
        if old is None:
            old = self.probation.pop(key, None)
        if old is not None:
            self.fields -= len(old)

    def clear(self) -> None:
        super().clear()
        self.fields = 0

    def _bound(self) -> None:
        while len(self) > self.max_keys or self.fields > self.max_fields:
            _, old = (self.probation or self.protected).popitem(last=False)
            self.fields -= len(old)


def bucket_reads(client, io, max_fields: int, max_keys: int = 200_000,
                 fence: bool = False) -> CachedReads | ClusterCachedReads:
    """The cached reads of one MP directory's buckets: a CachedReads on one Redis (``client``), a
    ClusterCachedReads on a cluster (``io`` its ClusterIO), with :class:`FieldCopies` of
    ``max_fields``. ``max_keys`` also bounds Redis's tracking table (tracking.bound_tracking_table:
    give the classic path's ``lookup_cache_keys`` so neither shrinks the other's)."""
    if isinstance(io, ClusterIO):
        return ClusterCachedReads(io, max_keys=max_keys, fence=fence,
                                  copies=lambda: FieldCopies(max_keys, max_fields))
    return CachedReads(client, max_keys=max_keys, fence=fence, copies=FieldCopies(max_keys, max_fields))
