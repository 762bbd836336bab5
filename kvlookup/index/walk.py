"""The prefix walk in Python, fed chunk by chunk (the cluster backend reads chunks in stages).

The one walk of every backend: every live group — an
instance (worker_rule 'all': every registered TP rank must hold a chunk) or one rank of an
instance (worker_rule 'any', vLLM DP ranks) — is credited with its longest run of
consecutive chunks from chunk 0; per location, the tokens of those chunks it holds there (a
chunk held in two locations counts for both). tests/contract/test_walk_model.py pins both walks
against one plain model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvlookup.index.keys import SEP


@dataclass(frozen=True)
class Holder:
    """How one holder counts in a lookup (from the RESOLVE script)."""

    group: str
    instance_id: str
    worker_id: str  # "" for worker_rule 'all'
    rank: str
    location: str
    need: int

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """From RESOLVE's ``<instance>\\t<worker or ''>\\t<rank>\\t<location>\\t<need>``; '' -> None."""
        if not text:
            return None
        inst, wid, rank, loc, need = text.split(SEP)
        return cls(inst + SEP + wid if wid else inst, inst, wid, rank, loc, int(need))


def resolved(text: str) -> tuple[Holder | None, float, bool]:
    """One answer of the RESOLVE script (kvlookup.index.scripts): (holder or None when it does not
    count while the registry version stays, until (unix ms; inf), lapsed: its lease lapsed on
    Redis server time, so after ``until`` it stays out until the version moves)."""
    if not text:
        return None, float("inf"), False
    head, _, lapsed = text.rpartition(SEP)
    head, _, until = head.rpartition(SEP)
    return Holder.parse(head), float(until), lapsed == "1"


@dataclass
class _Group:
    instance_id: str
    worker_id: str
    need: int
    upto: int = 0  # chunks matched
    end: int = 0  # tokens matched
    tokens: dict[str, int] = field(default_factory=dict)


class ChainWalk:
    """The walk of one chain; :meth:`feed` it the member lists of the next chunks.

    chunk_size, n_tokens: as :class:`kvlookup.index.records.Chain` (chunk i ends at
    ``min((i + 1) * chunk_size, n_tokens)``).

    ``miss`` names why chunk 0 extended no group (for the miss counter; '' otherwise):
    ``no_holder`` (no record), ``dead_instance`` (records of holders that do not count: retired,
    lease expired, heartbeat stale), ``ranks`` (held by only some of an instance's TP ranks).
    report: also keep, per group, the ranks that held the chunk where it stopped short of its
    need (:meth:`stops`; kvlookup.index.explain), which costs a dict write per such chunk.
    """

    def __init__(self, chunk_size: int, n_tokens: int, report: bool = False):
        self.size = chunk_size
        self.last = n_tokens
        self.groups: dict[str, _Group] = {}
        self.i = 0  # chunks fed so far
        self.prev_end = 0
        self.prev_members: Sequence[str] | None = None
        self.extended: list[tuple[_Group, set[str]]] = []
        self.done = False
        self.miss = ""
        self.short: dict[str, set[str]] | None = {} if report else None

    def feed(self, member_lists: Sequence[Sequence[str]], holders: Mapping[str, Holder | None]) -> bool:
        """Walk the next chunks (their holder ids); False once no group can extend any more.

        A run of chunks with the same holders as the chunk that opened it extends the same
        groups in the same locations: it is only counted, and settled when it ends.
        """
        for members in member_lists:
            if self.done:
                break
            prev = self.prev_members
            if self.i == 0 or (members is not prev and members != prev):  # shared copies: `is`
                self._settle()
                self.extended = self._extend(members, holders)
                self.done = not self.extended
                if self.done and self.i == 0:
                    self.miss = self._miss_cause(members, holders)
                self.prev_members = members
            self.i += 1
        return not self.done

    def _settle(self) -> None:
        """Credit the chunks walked since the last settle to the groups that extended."""
        end = min(self.i * self.size, self.last)
        if self.extended and end > self.prev_end:
            for g, locations in self.extended:
                g.upto, g.end = self.i, end
                for loc in locations:
                    g.tokens[loc] = g.tokens.get(loc, 0) + end - self.prev_end
        self.prev_end = end

    def _extend(self, members: Sequence[str], holders: Mapping[str, Holder | None]) -> list:
        seen: dict[str, tuple[_Group, set[str], set[str]]] = {}
        for hid in members:
            h = holders.get(hid)
            if h is None:
                continue
            g = self.groups.get(h.group)
            if g is None:
                if self.i:
                    continue
                g = self.groups[h.group] = _Group(h.instance_id, h.worker_id, h.need)
            if g.upto != self.i:
                continue  # it missed an earlier chunk
            entry = seen.get(h.group)
            if entry is None:
                entry = seen[h.group] = (g, set(), set())
            entry[1].add(h.rank)
            entry[2].add(h.location)
        if self.short is not None:
            for key, (g, ranks, _locs) in seen.items():
                if len(ranks) < g.need:
                    self.short[key] = ranks
        return [(g, locations) for g, ranks, locations in seen.values() if len(ranks) >= g.need]

    @staticmethod
    def _miss_cause(members: Sequence[str], holders: Mapping[str, Holder | None]) -> str:
        if not members:
            return "no_holder"
        return "ranks" if any(holders.get(hid) is not None for hid in members) else "dead_instance"

    def stops(self) -> dict[str, tuple[str, str, int, int, set[str] | None]]:
        """Per group (its key: instance, or instance and rank): (instance_id, worker_id, chunks
        matched, tokens matched, ranks that held the next chunk when too few did, else None).
        The walk stopped each group at chunk index ``chunks matched``. Needs ``report``."""
        if not self.done:
            self._settle()
        short = self.short or {}
        return {key: (g.instance_id, g.worker_id, g.upto, g.end, short.get(key)) for key, g in self.groups.items()}

    def matches(self) -> list[tuple[str, str, int, dict[str, int]]]:
        """(instance_id, worker_id, matched end, tokens per location) of every group matched."""
        if not self.done:
            self._settle()
        return [(g.instance_id, g.worker_id, g.end, {k: v for k, v in g.tokens.items() if v > 0})
                for g in self.groups.values() if g.upto > 0]
