"""Prometheus metrics of the LMCache MP coordinator paths (app/coordinator.py)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

BATCHES = Counter("kvlookup_mp_batches_total", "POST /events batches by outcome", ["outcome"])
PLACEMENTS = Counter("kvlookup_mp_entries_total", "Entries of admitted-or-not POST /events batches, by event type",
                     ["event_type"])
REGISTRATIONS = Counter("kvlookup_mp_registrations_total", "POST /instances by kind (new, re_registered)", ["kind"])
TIMEOUTS = Counter("kvlookup_mp_instance_timeouts_total", "MP instances departed for heartbeat silence")
DELAY = Histogram("kvlookup_mp_delivery_delay_seconds", "Arrival time minus the batch's ts (emitter clock)",
                  buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))


def observe_events(batches, outcome: dict, now: float | None = None) -> None:
    """Count one POST /events: batch outcomes, entries per event type, delivery delay."""
    now = time.time() if now is None else now
    BATCHES.labels("applied").inc(outcome["applied"])
    BATCHES.labels("duplicate").inc(outcome["duplicates"])
    BATCHES.labels("stale").inc(outcome["stale"])
    for b in batches:
        if b.entries:
            PLACEMENTS.labels(b.event_type).inc(len(b.entries))
        if b.ts > 0:
            DELAY.observe(max(0.0, now - b.ts))
