"""The bounded queue of chunk operations an ingest has decoded but not written yet.

Ops are queued per holder (instance, worker, location) in arrival order and folded per chunk to
the last op (ADMIT or EVICT), so writing a batch in any order leaves the index as applying the
ops one by one would. ``queued_ops`` counts what waits: the sidecar stops reading pushed traffic
past ``max_queued_ops`` (back pressure, never a drop). Any ingest can queue into one: the writer
takes slices oldest first (:meth:`OpQueue.take`) and puts them back when a write fails.

Registry writes that Redis could not take (a registration or deregistration arriving while Redis
cannot answer: a stopped server, a failover) wait in ``registry``, one per worker, newest
kept; the ingest applies them before any queued op, so a worker's ops, queued after its
registration, are written after it (issue 20 item 4).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Batch:
    """Queued ops of one (instance, worker, location), already folded: chunk hash text ->
    its last op (ADMIT or EVICT), in first-seen order. ``implicit``: 0.3-era admits, which
    register their worker when the registry does not know it."""

    instance_id: str
    worker_id: int
    location: str
    ops: dict[str, str]
    implicit: bool = False
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class RegistryWrite:
    """A registration (``register``: the worker's ip, port and peer URL) or a deregistration
    (``register`` False) waiting for Redis."""

    register: bool
    ip: str = ""
    port: int = 0
    url: str | None = None
    queued_at: float = field(default_factory=time.monotonic)


class OpQueue:
    """Batches in arrival order; ``queued_ops``: the ops they hold; ``registry``: registry
    writes waiting for Redis, per (instance, worker), in arrival order."""

    def __init__(self) -> None:
        self.batches: deque[Batch] = deque()
        self.queued_ops = 0
        self.registry: dict[tuple[str, int], RegistryWrite] = {}

    def put_registry(self, instance_id: str, worker_id: int, write: RegistryWrite) -> None:
        """Queue a registry write of a worker; it replaces (and goes behind) an earlier one."""
        self.registry.pop((instance_id, worker_id), None)
        self.registry[(instance_id, worker_id)] = write

    def __bool__(self) -> bool:
        return bool(self.batches)

    def add(self, instance_id: str, worker_id: int, location: str, ops: Iterable[tuple[str, str]],
            implicit: bool = False) -> None:
        """Queue (chunk text, op) pairs: into the last batch when it is the same holder's, else
        a new one (so ops keep their order per holder), each chunk folded to its last op."""
        tail = self.batches[-1] if self.batches else None
        if not (tail and (tail.instance_id, tail.worker_id, tail.location, tail.implicit) == (
                instance_id, worker_id, location, implicit)):
            tail = Batch(instance_id, worker_id, location, {}, implicit)
            self.batches.append(tail)
        before = len(tail.ops)
        tail.ops.update(ops)
        self.queued_ops += len(tail.ops) - before

    def drop(self, instance_id: str, worker_id: int, location: str | None = None) -> list[Batch]:
        """Remove and return the queued batches of a worker (of one location, when given)."""
        keep: deque[Batch] = deque()
        gone: list[Batch] = []
        for b in self.batches:
            if b.instance_id == instance_id and b.worker_id == worker_id and location in (None, b.location):
                gone.append(b)
            else:
                keep.append(b)
        self.batches = keep
        self.queued_ops -= sum(len(b.ops) for b in gone)
        return gone

    def lag_s(self) -> float:
        """How long the oldest queued op or registry write has waited (seconds; 0 when nothing
        is queued)."""
        oldest = [w.queued_at for w in self.registry.values()] + ([self.batches[0].queued_at] if self.batches else [])
        return time.monotonic() - min(oldest) if oldest else 0.0

    def take(self, budget: int | None) -> list[Batch]:
        """Up to ``budget`` ops (all when None), oldest first; a batch larger than what is left
        of the budget is split (its rest stays at the head, in order: distinct chunks, so any
        split is exact)."""
        taken: list[Batch] = []
        n = 0
        while self.batches and (budget is None or n < budget):
            b = self.batches[0]
            room = len(b.ops) if budget is None else budget - n
            if len(b.ops) <= room:
                taken.append(self.batches.popleft())
            else:
                part = dict(itertools.islice(b.ops.items(), room))
                for k in part:
                    del b.ops[k]
                taken.append(Batch(b.instance_id, b.worker_id, b.location, part, b.implicit, b.queued_at))
            n += len(taken[-1].ops)
        self.queued_ops -= n
        return taken

    def put_back(self, taken: list[Batch]) -> None:
        """Return batches :meth:`take` gave (a write failed) to the head, in their order."""
        self.batches.extendleft(reversed(taken))
        self.queued_ops += sum(len(b.ops) for b in taken)
