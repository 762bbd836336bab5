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


class MPCollector:
    """Gauges and counters of the MP directory read from Redis at scrape time (every process
    sees the same): keys, placements and bytes by tier, registered instances, batches by
    outcome, missing batches (seq gaps), dropped events, and per emitter its gap flag."""

    def __init__(self, directory):
        self.d = directory

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            stats, counters, cursors = self.d.stats(), self.d.counters(), self.d.cursors()
            registered = len(self.d.instances())
        except Exception:  # Redis down: the scrape still answers the process metrics
            return
        yield GaugeMetricFamily("kvlookup_mp_directory_keys", "MP object keys with a placement", stats["num_keys"])
        pl = GaugeMetricFamily("kvlookup_mp_directory_placements", "MP placements by tier", labels=["tier"])
        by = GaugeMetricFamily("kvlookup_mp_directory_placement_bytes", "size_bytes of MP placements by tier",
                               labels=["tier"])
        for tier in ("l1", "l2"):
            pl.add_metric([tier], stats[f"{tier}_count"])
            by.add_metric([tier], stats[f"{tier}_size_bytes"])
        yield pl
        yield by
        yield GaugeMetricFamily("kvlookup_mp_instances", "registered MP instances", registered)
        out = CounterMetricFamily("kvlookup_mp_ingest_batches", "POST /events batches (all controllers)",
                                  labels=["outcome"])
        for name in ("applied", "duplicate", "stale"):
            out.add_metric([name], counters[f"batches_{name}"])
        yield out
        yield CounterMetricFamily("kvlookup_mp_missing_batches", "batches skipped by seq jumps (gaps)",
                                  counters["batches_missing"])
        yield CounterMetricFamily("kvlookup_mp_dropped_events", "events emitters reported dropping",
                                  counters["events_dropped"])
        gap = GaugeMetricFamily("kvlookup_mp_emitter_gap", "1 when the emitter's slice is incomplete (gap or "
                                "dropped events since its incarnation began)", labels=["instance_id"])
        for inst, c in sorted(cursors.items()):
            gap.add_metric([inst], 1 if c["gap_detected"] else 0)
        yield gap
