"""Process-local complete copies of the LMCache MP chunk buckets (``keys.mp_chunks_key``), kept
coherent by Redis CLIENT TRACKING, as the classic path's chunk sets are (kvlookup.index.tracking,
kvlookup.index.cluster_cache): a bucket is read whole (``HGETALL`` of each in one Lua call, on a
tracked connection) and kept as a dict ``field -> value``; any write to it (a store, delete,
access, a fence or a departure reaching one of its records) makes Redis send its name to this
process's invalidation connection and the copy goes. A complete copy answers a field that is
there and one that is not, so a ``POST /directory/lookup`` whose buckets are all copied needs no
round trip (and runs in app.asgi's event loop). A lookup that lacks some buckets reads just its
chunks of those as before (one script call) and hands the buckets to a :class:`Copier`, which
copies them in the background, off the request's path: a whole bucket is ~25x the fields a
lookup needs of it, and reading 128 whole buckets costs more than the lookup itself (4.3 ms CPU
and 8.6 ms wall at 32k tokens, against 2.2 / 3.1 for reading the chunks).

Bound: at most ``max_fields`` fields over all copies of a process (setting ``mp_copy_fields``;
a bucket with more is read but not kept), least recently used first out (the segmented LRU of
kvlookup.index.copies: a bucket read once waits in probation).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvlookup.index.cluster_cache import ClusterCachedReads
from kvlookup.index.cluster_io import ClusterIO
from kvlookup.index.copies import Copies
from kvlookup.index.tracking import CachedReads

log = logging.getLogger(__name__)

#: Set (True) in a directory lookup's memo (app.asgi) to read from the copies without handing
#: what they lack to the copier: the event loop's recent tries mostly missed (ingest churn
#: invalidates buckets faster than lookups find them all copied), so copying is not worth it.
NO_COPY = "mp_no_copy"

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


#: Buckets a Copier reads in one call, and the most it holds waiting (more are dropped: a
#: lookup that misses them again asks again). Small calls: one Lua call blocks Valkey, and the
#: parse of its one reply holds the GIL (app.asgi's loop waits), for as long as it is big (256
#: buckets of ~26 fields: a 93 ms p99 at 32k tokens under churn, against 40 without copies).
COPY_BATCH = 32
COPY_PENDING = 8192
#: The share of one core a Copier may keep busy: after a call that took t seconds it rests
#: t * (1 / COPY_DUTY - 1). Under ingest churn every store batch invalidates ~10% of the
#: buckets; copying them again at any cost would take the lookups' CPU on a small box.
COPY_DUTY = float(os.environ.get("KVLOOKUP_MP_COPY_DUTY", "0.2"))  # (the environment: a bench's design knob)


class Copier:
    """Copies the buckets lookups lacked, in a daemon thread of its own (started on first use):
    ``reads.whole_hashes(names, script)`` for what :meth:`want` was given, at most
    :data:`COPY_DUTY` of a core. Errors are logged (debug) and the names dropped."""

    def __init__(self, reads, script: str):
        self.reads, self.script = reads, script
        self._want: dict[str, None] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False

    def want(self, names: list[str]) -> None:
        """Copy ``names`` soon (never waits)."""
        with self._cv:
            if len(self._want) < COPY_PENDING:
                self._want.update(dict.fromkeys(names))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mp-bucket-copier", daemon=True)
                self._thread.start()
            self._cv.notify()

    def idle(self) -> bool:
        """Nothing waits to be copied and no copy is under way."""
        with self._cv:
            return not self._want and not self._busy

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._want:
                    self._cv.wait()
                names = list(self._want)[:COPY_BATCH]
                for n in names:
                    del self._want[n]
                self._busy = True
            start = time.perf_counter()
            try:
                self.reads.whole_hashes(names, self.script)
            except Exception as exc:  # the next lookup that lacks them asks again
                log.debug("MP bucket copies: %s", exc)
            with self._cv:
                self._busy = False
            time.sleep((time.perf_counter() - start) * (1 / COPY_DUTY - 1))
