"""vLLM KV event streams -> index: sequence tracking, replay, resync (no sockets here).

One :class:`VllmIngest` per vLLM instance; each data-parallel rank is its own stream with
its own seq (vLLM's ``itertools.count()``, 0 at engine start). Per rank:

- seq == last + 1: apply.
- seq > last + 1 (a forward gap): replay from last + 1 through ``replay(rank, start)``; if
  replay is off, fails, or no longer reaches back to last + 1, the rank's records are cleared
  and it is marked resyncing (``resync:<rank>`` in the instance hash, why).
- seq at or below the highest live seq seen (the live stream went backwards): the engine
  restarted; the rank is cleared and starts over as a fresh stream.
- seq already applied through replay: skipped, so every batch is applied once.

At first contact (sidecar start) a rank resumes from the seq and payload digest it persisted
in Redis when replay proves the engine is the same one (the persisted batch replays with the
same digest); otherwise it is cleared and rebuilt from replay (from seq 0) when possible.
A cleared rank gets a new epoch (``Store.register_worker``): its old records stop counting at
once and are purged later.

Catch-up (:meth:`VllmIngest.catch_up`, called by the loop at start and whenever a rank's SUB
socket (re)connects) does the same without waiting for a live batch: replay from the last
applied seq; the same digest continues the stream, anything else is a new engine (cleared and
rebuilt from seq 0) or a buffer that no longer reaches back (cleared, ``replay_miss``).

Writes (``overlap`` on: the sidecar's ``vllm_overlap_writes``) may be left in flight while the next
batch decodes (sidecar.vllm_writer): one at a time, settled before any engine map read, wipe,
catch-up, first contact or next write, and by the loop when no message waits (:meth:`settle`). A
write that failed puts its rank back to the seq before its batch (``write_failed`` counted and
logged, the engine map mirror forgotten), so the next message is a gap and replay heals it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from kvlookup import kinds, metrics
from kvlookup.index.store import OtherWriter, Refused, Store
from kvlookup.index.vllm_groups import GroupSpec
from kvlookup.index.vllm_ranks import VllmRanks, prefix_space, rank_fields
from kvlookup.sidecar.admission import OwnershipGate, QuietLog
from kvlookup.sidecar.vllm_apply import BatchApplier, Mirror, RankContext
from kvlookup.sidecar.vllm_writer import WriteFailed, Writer
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import decode_batch, parse_live

log = logging.getLogger(__name__)

#: ``replay(rank, start_seq)`` -> the contiguous replayed (seq, payload) run, possibly empty,
#: or None when replay is not configured or did not answer.
ReplayFn = Callable[[int, int], list[tuple[int, bytes]] | None]


@dataclass
class RankState:
    last: int | None = None  # last applied seq; None: nothing applied since the last clear/start
    live_high: int = -1  # highest seq seen on the live stream
    contacted: bool = False
    last_digest: str | None = None  # digest of the batch at ``last``
    chains: set[tuple[int, int]] = field(default_factory=set)  # prefix chains (block size, lookahead)
    groups: dict[int, GroupSpec] = field(default_factory=dict)  # KV cache groups learned from stores
    legacy_space: str = ""  # space of engine map entries written without one
    #: the rank's engine map as this sidecar read and wrote it (sidecar.vllm_apply.Mirror)
    mirror: Mirror = field(default_factory=Mirror)


def digest(payload: bytes) -> str:
    """Short digest of a batch payload (hex), persisted to recognise the same engine."""
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


class VllmIngest:
    """Applies one vLLM instance's event streams (one per DP rank) to the index.

    store: the index. instance_id: the name lookups report. replay: see :data:`ReplayFn`
    (None = no replay endpoint). owner: the sidecar id that owns the instance (renews its
    lease). Counters: ``rejected`` (events/batches per reason), ``skipped`` (remote_tier,
    remove_unknown, sparse_unplaced), ``duplicates``, ``resyncs`` (per reason). model: the served model, when
    discovered (:meth:`set_model`). :meth:`catch_up` asks replay for what a rank missed.
    gate: a :class:`kvlookup.sidecar.admission.OwnershipGate`: while another writer holds the
    instance (issue 20 item 10: a live claimer, a live first owner, an MP registration) every
    batch is dropped and counted (``rejected[reason]``) and the ranks are forgotten, so once it
    is this sidecar's again they start over from what Redis holds (first contact).
    overlap: leave each write in flight while the next batch decodes (module doc; the sidecar's
    ``vllm_overlap_writes``); off (the default here), every write completes before the call returns.
    """

    def __init__(self, store: Store, instance_id: str, replay: ReplayFn | None = None, owner: str = "",
                 gate: OwnershipGate | None = None, overlap: bool = False):
        self.store = store
        self.gate = gate
        self.instance_id = instance_id
        self.replay = replay
        self.owner = owner
        self.ranks: dict[int, RankState] = {}
        self.rejected: Counter = Counter()
        self.skipped: Counter = Counter()
        self.resyncs: Counter = Counter()
        self.duplicates = 0
        self.model: str | None = None
        self.ranks_state = VllmRanks(store, instance_id)
        self.quiet = QuietLog()
        self.writer = Writer(overlap)
        #: ranks whose write failed: the loop schedules a catch-up for each (replay heals them
        #: even when no live message follows)
        self.replay_due: set[int] = set()

    def settle(self) -> None:
        """Wait for the write in flight (if any); a failure is handled (its rank put back,
        counted, logged) and only an unreachable Redis raises (redis ConnectionError / TimeoutError)."""
        try:
            self.writer.settle()
        except WriteFailed:
            pass

    def close(self) -> None:
        """Settle and stop the writer's thread (at shutdown)."""
        self.writer.close()

    def set_model(self, model: str | None) -> None:
        """The served model's name (discovered): written to the instance hash (``model``) now when
        the instance is registered, else when a rank registers; lookups naming another model skip it."""
        self.model = model
        if model and not self._held_by_other():
            self.ranks_state.write_model(model, only_if_vllm=True)

    def handle_live(self, rank: int, frames: list[bytes]) -> None:
        """One live SUB message of ``rank``. Never raises except for Redis outages."""
        self.handle_live_many(rank, [frames])

    def handle_live_many(self, rank: int, messages: list[list[bytes]]) -> None:
        """Live SUB messages of ``rank`` that arrived together, in order. A run of them that
        continues the rank's stream one seq after another (the normal case) is written as one
        batch (its events in order, one write; the seq and digest of its last are persisted);
        anything else (a first contact, a gap, a duplicate, an engine restart, a bad frame) goes
        one by one. Never raises except for Redis outages."""
        if self._held_by_other(len(messages)):
            return
        run: list[tuple[int, bytes]] = []
        for frames in messages:
            try:
                _topic, seq, payload = parse_live(frames)
            except WireError as exc:
                self._guarded(rank, run)
                run = []
                self._reject(exc.reason, str(exc))
                continue
            metrics.MESSAGES.labels("vllm_batch").inc()
            st = self.ranks.get(rank)
            if st is not None and st.contacted and st.last is not None and seq > st.live_high \
                    and seq == (run[-1][0] if run else st.last) + 1:
                st.live_high = seq
                run.append((seq, payload))
                continue
            self._guarded(rank, run)
            run = []
            self._guarded(rank, [(seq, payload)], single=True)
        self._guarded(rank, run)

    def _guarded(self, rank: int, run: list[tuple[int, bytes]], single: bool = False) -> None:
        if not run:
            return
        try:
            if single:
                self.writer.settle()  # what follows may read, replay or clear
                self._on_live(rank, *run[0])
            else:
                self._apply_run(rank, self.ranks[rank], run)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # the loop waits; the lost messages show up as a gap and are replayed
        except WriteFailed:
            pass  # a write left in flight failed: handled (_write_failed); this run waits for replay
        except Refused as exc:  # another writer took the instance meanwhile (Store.own)
            self.ranks.clear()
            self._reject(exc.reason, str(exc))
        except Exception:
            self._reject("handler_error", f"rank {rank} seq {run[0][0]}..{run[-1][0]}")
            log.exception("failed to apply %s rank %d seq %d..%d", self.instance_id, rank, run[0][0], run[-1][0])

    def _held_by_other(self, batches: int = 0) -> bool:
        """True while another writer holds the instance (the gate says who): ``batches`` are
        counted as rejected and the ranks forgotten."""
        who = self.gate.other(self.instance_id) if self.gate is not None else ""
        if not who:
            return False
        self.ranks.clear()
        if batches:
            refused = OtherWriter(self.instance_id, who)
            self.rejected[refused.reason] += batches
            metrics.REJECTED.labels("vllm", refused.reason).inc(batches)
            self.quiet.warn(refused.reason, f"dropped {batches} batch(es): {refused}")
        return True

    # -- sequence -------------------------------------------------------------------------

    def _on_live(self, rank: int, seq: int, payload: bytes) -> None:
        st = self.ranks.setdefault(rank, RankState())
        if not st.contacted:
            st.contacted = True
            self._first_contact(rank, st, seq, payload)
            return
        if seq <= st.live_high:
            log.warning("%s rank %d: seq went back from %d to %d (engine restart)", self.instance_id, rank,
                        st.live_high, seq)
            self._count_resync("engine_restart")
            self._start_fresh(rank, st, seq, payload)
            return
        st.live_high = seq
        if st.last is not None and seq <= st.last:
            self.duplicates += 1
            return
        if st.last is not None and seq > st.last + 1:
            metrics.SEQ_GAPS.labels("vllm").inc()
            log.warning("%s rank %d: gap, last %d, got %d", self.instance_id, rank, st.last, seq)
            self._heal(rank, st, st.last + 1)
            if st.last is not None and seq <= st.last:
                return
        self._apply(rank, st, seq, payload)

    # -- catch-up on (re)connect ----------------------------------------------------------------

    def catch_up(self, rank: int) -> str:
        """Ask the replay endpoint for what ``rank`` missed, without waiting for a live batch:
        called at sidecar start and whenever its SUB socket (re)connects (a publisher that
        restarts and sends one batch before the SUB has joined, then goes quiet, is otherwise
        never caught up). At most three replays, each bounded by the replay client. Returns
        and counts the outcome (``kvlookup_vllm_catchups_total``). Raises only Redis errors."""
        if self._held_by_other():
            outcome = "refused"
        else:
            try:
                self.writer.settle()
                outcome = self._catch_up(rank) if self.replay is not None else "no_answer"
            except Refused as exc:  # taken by another writer meanwhile (Store.own)
                self._reject(exc.reason, str(exc))
                outcome = "refused"
            except WriteFailed:  # handled (_write_failed); the next catch-up or live message replays
                outcome = "write_failed"
        metrics.CATCHUPS.labels(outcome).inc()
        if outcome not in ("current", "no_answer", "refused", "write_failed"):
            log.info("%s rank %d: catch-up on connect: %s (last seq %s)", self.instance_id, rank, outcome,
                     self.ranks[rank].last)
        return outcome

    def _catch_up(self, rank: int) -> str:
        assert self.replay is not None
        st = self.ranks.setdefault(rank, RankState())
        if not st.contacted:
            self._load(rank, st)
        if st.last is not None:
            msgs = self.replay(rank, st.last)
            if msgs is None:
                return "no_answer"
            if msgs and msgs[0][0] == st.last and digest(msgs[0][1]) == st.last_digest:
                fresh = [(q, p) for q, p in msgs[1:] if q > st.last]
                for q, p in fresh:
                    self._apply(rank, st, q, p)
                resumed = not st.contacted
                st.contacted = True
                return "resumed" if resumed else ("caught_up" if fresh else "current")
            if msgs and msgs[0][0] > st.last:  # the same stream, its buffer no longer reaches back
                st.contacted = True
                self._clear(rank, st, resync="replay_miss")
                for q, p in msgs:
                    self._apply(rank, st, q, p)
                return "replay_miss"
        return self._rebuild(rank, st)

    def _rebuild(self, rank: int, st: RankState) -> str:
        """A new engine (or a stream never seen): everything from seq 0, or nothing yet."""
        assert self.replay is not None
        had = st.last is not None
        msgs = self.replay(rank, 0)
        if msgs is None:
            return "no_answer"
        if not msgs and not had:
            return "current"  # nothing published, nothing held
        if had:
            self._count_resync("engine_restart")
        st.contacted = True
        st.live_high = -1
        self._clear(rank, st, resync=None if not msgs or msgs[0][0] == 0 else "replay_miss")
        for q, p in msgs:
            self._apply(rank, st, q, p)
        if not msgs:
            return "cleared"
        return "rebuilt" if msgs[0][0] == 0 else "replay_miss"

    def _first_contact(self, rank: int, st: RankState, seq: int, payload: bytes) -> None:
        p_digest = self._load(rank, st)
        if st.last is not None:
            if self._resume(rank, st, seq, p_digest):
                self._on_live(rank, seq, payload)  # now an ordinary live message: dup, next or gap
                return
        self._start_fresh(rank, st, seq, payload)

    def _load(self, rank: int, st: RankState) -> str | None:
        """Load the rank's persisted state (seq, chains, groups) when it is still registered;
        returns the persisted digest. st.last stays None when there is nothing to resume."""
        saved = self.ranks_state.persisted(rank)
        if saved.seq is None or not self.store.is_registered(self.instance_id, rank):
            return None
        if saved.old_layout:
            log.info("%s rank %d: records of an earlier layout (one holder per medium); rebuilding",
                     self.instance_id, rank)
            return None
        st.last = int(saved.seq)
        st.chains = set(saved.chains)
        st.legacy_space = prefix_space(saved.chains[0][0]) if len(saved.chains) == 1 else ""
        for g, value in saved.groups.items():
            spec = GroupSpec.parse(value)
            if spec is not None:
                st.groups[g] = spec
        st.last_digest = saved.digest
        return st.last_digest

    def _resume(self, rank: int, st: RankState, seq: int, p_digest: str | None) -> bool:
        """Continue a persisted stream when the engine is provably the same one."""
        assert st.last is not None
        if self.replay is None:
            return seq == st.last + 1  # no way to check more; a restart this exact seq would be missed
        msgs = self.replay(rank, st.last)
        if not msgs or msgs[0][0] != st.last or digest(msgs[0][1]) != p_digest:
            return False
        log.info("%s rank %d: resuming after seq %d", self.instance_id, rank, st.last)
        for s, p in msgs[1:]:
            self._apply(rank, st, s, p)
        return True

    def _start_fresh(self, rank: int, st: RankState, seq: int, payload: bytes) -> None:
        """Clear the rank, then rebuild from seq 0 (replay) or mark it resyncing."""
        self._clear(rank, st, resync=None)
        st.live_high = seq
        if seq > 0:
            msgs = self.replay(rank, 0) if self.replay else None
            if not msgs or msgs[0][0] != 0:
                self._mark_resync(rank, "no_replay" if msgs is None else "replay_miss")
            for s, p in msgs or []:
                self._apply(rank, st, s, p)
            if st.last is not None and seq <= st.last:
                return
        self._apply(rank, st, seq, payload)

    def _heal(self, rank: int, st: RankState, start: int) -> None:
        msgs = self.replay(rank, start) if self.replay else None
        if msgs and msgs[0][0] == start:
            for s, p in msgs:
                self._apply(rank, st, s, p)
            return
        self._clear(rank, st, resync="no_replay" if msgs is None else "replay_miss")
        for s, p in msgs or []:
            self._apply(rank, st, s, p)

    # -- writes ---------------------------------------------------------------------------

    def _apply(self, rank: int, st: RankState, seq: int, payload: bytes) -> None:
        self._apply_run(rank, st, [(seq, payload)])

    def _apply_run(self, rank: int, st: RankState, run: list[tuple[int, bytes]]) -> None:
        """Apply consecutive batches as one (their events in order, one write)."""
        seq, payload = run[-1]
        d = digest(payload)
        persist = rank_fields(rank, seq=seq, digest=d)
        prev, first = (st.last, st.last_digest), run[0][0]
        writer = self.writer
        ctx = RankContext(self.store, self.instance_id, rank, lambda: self._wipe(rank, st),
                          lambda: self._register_rank(rank), self.rejected, self.skipped,
                          chains=st.chains, groups=st.groups, legacy_space=st.legacy_space,
                          ranks_state=self.ranks_state, mirror=st.mirror,
                          submit=lambda write: writer.submit(
                              write, lambda exc: self._write_failed(rank, st, prev, (first, seq), exc)),
                          settle=writer.settle)
        events: list = []
        for s, p in run:
            try:
                events += decode_batch(p).events
            except WireError as exc:
                self._reject(exc.reason, f"rank {rank} seq {s}: {exc}")
        try:
            BatchApplier(ctx).run(events, persist)
        except BaseException:
            st.mirror.forget()  # a write may have failed half way: read the map again
            raise
        st.legacy_space = ctx.legacy_space
        st.last, st.last_digest = seq, d

    def _write_failed(self, rank: int, st: RankState, prev: tuple[int | None, str | None], seqs: tuple[int, int],
                      exc: BaseException) -> None:
        """A write left in flight failed (Writer.settle, on this loop's thread): the rank goes back to
        the seq before the batch, so the next message is a gap and replay writes it again."""
        st.last, st.last_digest = prev
        st.mirror.forget()
        if isinstance(exc, Refused):  # another writer took the instance meanwhile (Store.own)
            self.ranks.clear()
            self._reject(exc.reason, str(exc))
            return
        self.rejected["write_failed"] += 1
        metrics.REJECTED.labels("vllm", "write_failed").inc()
        self.replay_due.add(rank)
        log.warning("%s rank %d: write of seq %d..%d failed (%s: %s); back to seq %s, replay heals it",
                    self.instance_id, rank, *seqs, type(exc).__name__, exc, prev[0])

    def _register_rank(self, rank: int) -> None:
        """A new epoch of the rank in the registry, owned by this sidecar (OtherWriter first,
        before any write, when another writer holds the instance)."""
        if self.owner:
            self.store.own(self.owner, self.instance_id)
        self.store.register_worker(self.instance_id, rank, kind=kinds.VLLM)
        if self.model:
            self.ranks_state.write_model(self.model)

    def _wipe(self, rank: int, st: RankState) -> None:
        """New epoch for the rank (its records stop counting), empty engine map, no learned
        chains or groups."""
        self.writer.settle()  # the write in flight first: it may write the map this clears
        st.mirror.forget()  # until the map is gone
        self._register_rank(rank)
        self.ranks_state.wipe(rank, st.groups)
        st.mirror.emptied()
        st.chains.clear()
        st.groups.clear()
        st.legacy_space = ""

    def _clear(self, rank: int, st: RankState, resync: str | None) -> None:
        self._wipe(rank, st)
        st.last, st.last_digest = None, None
        if resync:
            self._mark_resync(rank, resync)
        else:
            self.ranks_state.mark_resync(rank, None)

    def _mark_resync(self, rank: int, reason: str) -> None:
        self._count_resync(reason)
        log.warning("%s rank %d: records incomplete (%s); resyncing from live events", self.instance_id, rank,
                    reason)
        self.ranks_state.mark_resync(rank, reason)

    def _count_resync(self, reason: str) -> None:
        self.resyncs[reason] += 1
        metrics.RESYNCS.labels("vllm", reason).inc()

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        metrics.REJECTED.labels("vllm", reason).inc()
        log.warning("%s: rejected (%s): %s", self.instance_id, reason, detail)
