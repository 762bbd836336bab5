"""The controller's own metrics: lookups, and scrape-time gauges of the fleet.

Lookups (``kvlookup_lookups_total``, ``kvlookup_lookup_seconds``,
``kvlookup_lookup_matched_tokens``) are counted by the controller's /lookup; they live here,
in a module only the app imports, so a standalone sidecar's ``/metrics`` does not show them.

Live instances/workers and records per location are computed when Prometheus scrapes (one
pipelined pass over the index sets, no SCAN), so every controller replica and gunicorn worker
reports the same fleet-wide values and nothing has to be kept in sync between processes.
"""

from __future__ import annotations

import logging

import redis
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvlookup.index.fleet import Fleet

log = logging.getLogger(__name__)

#: outcome: hit, miss, redis_error.
LOOKUPS = Counter("kvlookup_lookups_total", "Lookups answered", ["outcome"])
#: Every /lookup by outcome and the miss cause its walk knew at no extra read (kvlookup.index.walk):
#: (hit, hit); (miss, no_holder | dead_instance | ranks | short_prompt | unclassified).
#: ``unclassified``: the walk ran in Lua (lookup_cache: off on one Redis), which does not say.
OUTCOMES = Counter("kvlookup_lookup_outcomes_total", "Lookups by outcome and miss cause", ["outcome", "cause"])
#: Every /lookup the event loop could have tried from the copies (app.asgi.LoopOdds): ``tried``
#: (it did, then answered or handed it to a thread) or ``skipped`` (its recent tries mostly missed,
#: so it went to a thread at once, read by digest).
LOOP_ATTEMPTS = Counter("kvlookup_lookup_loop_attempts_total", "Lookups the event loop tried from its copies, "
                        "or skipped because its recent tries mostly missed", ["attempt"])
LOOP_READS = Counter("kvlookup_lookup_loop_reads_total", "Lookups read by digest from the event loop "
                     "(answered there, or sent on to a thread after all)", ["outcome"])
#: Every /lookup/explain by the cause it found (kvlookup.index.explain._cause): hit,
#: profile_mismatch_suspected, namespace, ranks, dead_instance, evicted, short_prompt, no_holder.
EXPLAINED = Counter("kvlookup_explained_lookups_total", "Explained lookups by the cause found", ["cause"])
LOOKUP_SECONDS = Histogram(
    "kvlookup_lookup_seconds", "Lookup latency inside the controller (hash + Redis walk)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
LOOKUP_MATCHED_TOKENS = Histogram(
    "kvlookup_lookup_matched_tokens", "Longest matched prefix per lookup (tokens)",
    buckets=(0, 256, 1024, 4096, 16384, 65536, 262144),
)


class FleetCollector(Collector):
    """Yields ``kvlookup_live{kind="instances"|"workers"}`` and
    ``kvlookup_records{instance_id, location}``; ``kvlookup_index_up`` is 0 when Redis failed."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self):
        up = GaugeMetricFamily(
            "kvlookup_index_up", "1 when the registry in Redis was readable at scrape time"
        )
        try:
            live, records = self._read()
        except redis.RedisError as exc:
            log.warning("metrics: registry unreadable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield live
        yield records

    def _read(self):
        fleet = self.fleet
        workers = fleet.workers()
        alive = fleet.alive(fleet.instance_ids())
        live_workers = [w for w in workers if fleet.worker_live(w, alive.get(w.instance_id, False))]
        live = GaugeMetricFamily(
            "kvlookup_live", "Live instances and workers in the registry", labels=["kind"]
        )
        live.add_metric(["instances"], sum(1 for ok in alive.values() if ok))
        live.add_metric(["workers"], len(live_workers))
        totals: dict[tuple[str, str], int] = {}
        for w, counts in zip(workers, fleet.key_counts(workers), strict=True):
            for loc, n in counts.items():
                totals[(w.instance_id, loc)] = totals.get((w.instance_id, loc), 0) + n
        records = GaugeMetricFamily(
            "kvlookup_records",
            "(chunk, holder) records of current holders",
            labels=["instance_id", "location"],
        )
        for (inst, loc), n in sorted(totals.items()):
            records.add_metric([inst, loc], n)
        return live, records
