"""Prometheus metrics counted by the sidecars (and by the controller's control calls), one
definition each, in prometheus-client's default registry.

The lookup metrics (``LOOKUPS``, ``LOOKUP_SECONDS``, ``LOOKUP_MATCHED_TOKENS``) are the
controller's alone: they are defined in kvlookup.app.fleet_metrics, which only the app imports, so
a standalone sidecar's ``/metrics`` does not carry them at zero.
"""

from __future__ import annotations

from prometheus_client import Counter

#: outcome: applied; unregistered (its worker is not registered: dropped, as LMCache 0.5 does);
#: superseded (dropped unapplied: its worker re-registered, deregistered or began a full sync
#: first); redis_error (dropped after repeated Redis errors).
INGEST_OPS = Counter("kvlookup_ingest_ops_total", "Chunk operations received", ["kind", "outcome"])
MESSAGES = Counter("kvlookup_messages_total", "Worker messages handled", ["type"])
REJECTED = Counter("kvlookup_rejected_frames_total", "Frames or events rejected", ["source", "reason"])
UNPARSABLE = Counter("kvlookup_unparsable_records_total", "Registry records a loop could not parse and skipped",
                     ["where"])
SEQ_GAPS = Counter("kvlookup_seq_gaps_total", "Sequence gaps seen", ["source"])
RESYNCS = Counter("kvlookup_resyncs_total", "Instances cleared or asked to resync", ["source", "reason"])
#: outcome: resumed (a persisted stream continued), caught_up (batches after the last applied),
#: current (nothing missed), rebuilt (a new engine's batches from seq 0), cleared (a new engine
#: with nothing published yet), replay_miss (the buffer no longer reaches back), no_answer.
CATCHUPS = Counter("kvlookup_vllm_catchups_total", "Replays asked for when a vLLM SUB socket (re)connects "
                   "or the sidecar starts", ["outcome"])
REAPED = Counter("kvlookup_reaped_workers_total", "Workers deregistered by the reaper on evidence they are gone")
PROBES = Counter("kvlookup_worker_probes_total", "Health calls a sidecar made to workers it had no news of",
                 ["outcome"])
CONTROL_CALLS = Counter("kvlookup_control_calls_total", "Controller -> worker control calls",
                        ["message", "outcome"])
# Live instances/workers and records per instance and location are computed from Redis at
# scrape time: see kvlookup.app.fleet_metrics (kvlookup_live, kvlookup_records).


def count_ops(ops, outcome: str) -> None:
    """Count a batch of ops in ``kvlookup_ingest_ops_total`` by kind: (op, chunk hash) pairs,
    or a folded {chunk hash text: op} mapping."""
    from kvlookup.index.store import ADMIT

    admits = list(ops.values()).count(ADMIT) if isinstance(ops, dict) else \
        sum(1 for op, _ in ops if op == ADMIT)  # list.count: in C (a generator cost ~0.25 us an op)
    if admits:
        INGEST_OPS.labels("admit", outcome).inc(admits)
    if len(ops) - admits:
        INGEST_OPS.labels("evict", outcome).inc(len(ops) - admits)
