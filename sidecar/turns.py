"""The guard around a sidecar loop's turns: a loop never dies.

A Redis error (unreachable, BUSY, OOM, READONLY...) backs off, 0.1 s doubling to 1 s (so a
promoted replica or a restarted server is written within a second of answering, and leases are
renewed before an outage's grace ends), and what is queued stays queued for the next turn; any other error is counted
(``kvlookup_rejected_frames_total{reason="loop_error"}``) and logged, and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from kvlookup import metrics
from kvlookup.proc.lifetime import Backoff

log = logging.getLogger(__name__)

#: The longest wait between two tries while Redis fails (seconds).
MAX_BACKOFF_S = 1.0


def run_turns(turn: Callable[[], None], stop: threading.Event, source: str) -> None:
    """Call ``turn()`` until ``stop`` is set (source: the metric label and log prefix)."""
    backoff = Backoff(0.1, MAX_BACKOFF_S)
    while not stop.is_set():
        try:
            turn()
            backoff.reset()
        except redis.RedisError as exc:
            delay = backoff.next()
            log.warning("%s: redis error (%s); retrying in %.1fs", source, exc, delay)
            stop.wait(delay)
        except Exception:
            metrics.REJECTED.labels(source, "loop_error").inc()
            log.exception("%s loop error", source)
            stop.wait(0.1)
