"""A vLLM rank's record write left in flight while the next batch decodes (issue 18 item 3).

Each batch a vLLM ingest applies ends in one write (sidecar.vllm_apply.BatchApplier.flush: its
chunk ops, engine map changes and persisted seq, one pipelined round trip per space). With
overlap on, :class:`Writer` runs that write on a thread of its own (``concurrent.futures``, one
worker, so writes keep their order) and returns at once: the sidecar reads and decodes the next
batch while Redis works (a round trip's reply wait is most of a decode-shaped batch's cost on a
small box: docs/benchmarks-notes.md). At most :data:`DEPTH` write is in flight: :meth:`submit`
settles the one before first.

The ingest settles (waits for the reply of) the write in flight before anything that reads or
replaces what it writes: an engine map read, a wipe, a catch-up, replay or first contact, the
next write, and whenever its loop finds no message waiting. A write that failed calls its
``on_fail`` first (sidecar.vllm_ingest puts the rank back to the seq before the batch and forgets
its engine map mirror, so the next message shows a gap that replay heals), then :meth:`settle`
raises: the Redis error itself when Redis was unreachable (the loop backs off, as before), else
:class:`WriteFailed`. Off (``vllm_overlap_writes`` false), a write runs inline and raises as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import redis

log = logging.getLogger(__name__)

#: Writes in flight at most (per ingest, i.e. per vLLM instance).
DEPTH = 1

Write = Callable[[], None]
OnFail = Callable[[BaseException], None]


class WriteFailed(Exception):
    """A write left in flight failed with something other than an unreachable Redis (a script
    error, an ownership refusal...): its ``on_fail`` ran; ``cause`` is the error."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Writer:
    """Runs writes in order, inline (``overlap`` False) or one at a time on a worker thread.

    Counters: ``submitted`` (writes), ``failed`` (writes whose failure was settled), ``peak``
    (most writes in flight at once: never above :data:`DEPTH`)."""

    def __init__(self, overlap: bool, name: str = "kvlookup-vllm-write"):
        self.overlap = overlap
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, OnFail] | None = None
        self.submitted = 0
        self.failed = 0
        self.peak = 0

    @property
    def in_flight(self) -> int:
        """Writes submitted and not yet settled (0 or 1)."""
        return 1 if self._pending is not None else 0

    def submit(self, write: Write, on_fail: OnFail) -> None:
        """Run ``write``: after settling the one in flight (which may raise, see :meth:`settle`;
        then ``write`` is not run). Inline when overlap is off (its errors raise here, and
        ``on_fail`` is not called: the caller's own error path runs, as before)."""
        self.settle()
        self.submitted += 1
        if not self.overlap:
            write()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        self._pending = (self._pool.submit(write), on_fail)
        self.peak = max(self.peak, self.in_flight)

    def settle(self) -> None:
        """Wait for the write in flight, if any. When it failed: its ``on_fail(error)``, then
        the error raised (redis ConnectionError / TimeoutError as they are, anything else as
        :class:`WriteFailed`). Each failure is raised once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        future, on_fail = pending
        exc = future.exception()
        if exc is None:
            return
        self.failed += 1
        on_fail(exc)
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            raise exc
        raise WriteFailed(exc) from exc

    def close(self) -> None:
        """Settle (a failure is logged, not raised) and stop the worker thread."""
        try:
            self.settle()
        except Exception as exc:  # shutting down: nothing will replay it in this process
            log.warning("a vLLM write in flight at shutdown failed: %s", exc)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
