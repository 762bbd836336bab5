"""A vLLM rank's record write left in flight while the next batch decodes (issue 18 item 3).

Each batch a vLLM ingest applies ends in one write (sidecar.vllm_apply.BatchApplier.flush: its
chunk ops, engine map changes and persisted seq, one pipelined round trip per space). With
overlap on, :class:`Writer` sends that write (``Store.apply_send``: redis-py's connection sends
the packed commands, their replies are read later on the same connection) and returns: the
sidecar reads and decodes the next batch while Redis works (a round trip's wait is much of a
batch's cost on a small box: docs/benchmarks-notes.md). At most :data:`DEPTH` write is in flight:
:meth:`submit` settles the one before first. Everything stays on the loop's thread (a writer
thread was measured and lost: docs/benchmarks-notes.md); a Redis Cluster writes at once.

The ingest settles (reads the replies of) the write in flight before anything that reads or
replaces what it writes: an engine map read, a wipe, a catch-up, replay or first contact, the
next write, and whenever its loop finds no message waiting. A write that failed calls its
``on_fail`` first (sidecar.vllm_ingest puts the rank back to the seq before the batch and forgets
its engine map mirror, so the next message shows a gap that replay heals), then :meth:`settle`
raises: the Redis error itself when Redis was unreachable (the loop backs off, as before), else
:class:`WriteFailed`. Off (``vllm_overlap_writes`` false), each write's replies are read at once
and a failure raises as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

#: Writes in flight at most (per ingest, i.e. per vLLM instance).
DEPTH = 1

#: Reads a sent write's replies (raises what the write raises).
Finish = Callable[[], object]
#: Sends a write; returns its :data:`Finish`, or None when it is already complete.
Write = Callable[[], Finish | None]
OnFail = Callable[[BaseException], None]


class WriteFailed(Exception):
    """A write left in flight failed with something other than an unreachable Redis (a script
    error, an ownership refusal...): its ``on_fail`` ran; ``cause`` is the error."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class Writer:
    """Runs writes in order, one at most in flight (``overlap``) or each read at once.

    Counters: ``submitted`` (writes), ``failed`` (writes whose failure was settled), ``peak``
    (most writes in flight at once: never above :data:`DEPTH`)."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._pending: tuple[Finish, OnFail] | None = None
        self.submitted = 0
        self.failed = 0
        self.peak = 0

    @property
    def in_flight(self) -> int:
        """Writes sent and not yet settled (0 or 1)."""
        return 1 if self._pending is not None else 0

    def submit(self, write: Write, on_fail: OnFail) -> None:
        """Send ``write`` after settling the one in flight (which may raise, see :meth:`settle`;
        then ``write`` is not sent). What ``write()`` raises raises here, ``on_fail`` not called
        (the caller's own error path runs, as before); with overlap off its replies are read here
        too, their errors raised here the same way."""
        self.settle()
        self.submitted += 1
        finish = write()
        if finish is None:
            return
        if not self.overlap:
            finish()
            return
        self._pending = (finish, on_fail)
        self.peak = max(self.peak, self.in_flight)

    def settle(self) -> None:
        """Read the replies of the write in flight, if any. When it failed: its
        ``on_fail(error)``, then the error raised (redis ConnectionError / TimeoutError as they
        are, anything else as :class:`WriteFailed`). Each failure is raised once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        finish, on_fail = pending
        try:
            finish()
        except Exception as exc:
            self.failed += 1
            on_fail(exc)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise
            raise WriteFailed(exc) from exc

    def close(self) -> None:
        """Settle; a failure is logged, not raised (shutting down)."""
        try:
            self.settle()
        except Exception as exc:  # nothing will replay it in this process
            log.warning("a vLLM write in flight at shutdown failed: %s", exc)
