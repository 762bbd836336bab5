"""Reads of the LMCache MP directory's records: interned names (spaces, tiers, epochs, instance
numbers; immutable, so kept once read), object key records and token bindings in the chunk
buckets (``keys.mp_names_key``, ``keys.mp_chunks_key``; formats in kvlookup.index.mp_values).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from kvlookup.index import keys as K
from kvlookup.index.mp_registry import UNBOUND_RECHECK_S, MPRegistry
from kvlookup.index.mp_values import Record, parse_record, parse_tokens
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis

#: Buckets read per script call: one call stays well under a millisecond of Redis time.
READ_SLICE = 1024


def needs_redis() -> None:
    """NeedsRedis under kvlookup.index.tracking's LOCAL_ONLY (app.asgi's event loop must not wait
    on Redis: the request is answered again in a thread)."""
    if LOCAL_ONLY.get():
        raise NeedsRedis("an MP read needs Redis")


class MPRecords(MPRegistry):
    """Names and records of :class:`kvlookup.index.mp.MPDirectory`."""

    def _reverse(self, kind: str, ids: Iterable[str]) -> dict[str, str]:
        want = {i for i in ids if f"r:{kind}{i}" not in self._names}
        if want:
            needs_redis()
            order = sorted(want)
            for i, text in zip(order, self.r.hmget(K.mp_names_key(), [f"r:{kind}{i}" for i in order]), strict=True):
                if text is not None:
                    self._names[f"r:{kind}{i}"] = text
        return {i: self._names.get(f"r:{kind}{i}", "") for i in ids}

    def space_ids(self, texts: Sequence[str]) -> list[str | None]:
        """Interned ids of space texts (None where never stored)."""
        missing = [t for t in texts if f"n:s{t}" not in self._names]
        if missing:
            needs_redis()
            for t, sid in zip(missing, self.r.hmget(K.mp_names_key(), [f"n:s{t}" for t in missing]), strict=True):
                if sid is not None:
                    self._names[f"n:s{t}"] = sid
        return [self._names.get(f"n:s{t}") for t in texts]

    def all_spaces(self, fresh: bool = True) -> dict[str, str]:
        """space id -> space text of every space ever stored (fresh=False: a list up to
        :data:`UNBOUND_RECHECK_S` old will do; spaces are only ever added)."""
        at, known = self._spaces
        if not fresh and time.monotonic() - at < UNBOUND_RECHECK_S:
            return known
        needs_redis()
        ids = (self.r.hget(K.mp_names_key(), "sps") or "").split(",")
        spaces = {i: t for i, t in self._reverse("s", [i for i in ids if i]).items()}
        self._spaces = (time.monotonic(), spaces)
        return spaces

    def placements(self, recs: Iterable[Record]) -> dict[tuple[str, str], dict]:
        """(tb, epoch) -> a placement dict skeleton (instance_id, incarnation, tier, backend, shared)."""
        return self.placement_skeletons({(tb, ep) for r in recs for tb, ep, _ in r.placements})

    def placement_skeletons(self, pairs: set[tuple[str, str]]) -> dict[tuple[str, str], dict]:
        """(tb, epoch) -> a placement dict skeleton, for the given (tb, epoch) pairs of records."""
        tbs = self._reverse("t", {tb for tb, _ in pairs})
        eps = self._reverse("e", {ep for _, ep in pairs})
        iids = self._reverse("i", {eps[ep].split("\t")[0] for _, ep in pairs if eps[ep]})
        out = {}
        for tb, ep in pairs:
            tier, backend, shared = tbs[tb].split("\t")
            iid, inc = eps[ep].split("\t")
            out[(tb, ep)] = {"instance_id": iids[iid], "incarnation": int(inc), "tier": tier, "backend": backend,
                             "shared": shared == "1"}
        return out

    def bucket_fields(self, refs: Sequence[tuple[str, Sequence[str]]]) -> list[str | None]:
        """The values of fields of chunk buckets: ``refs`` is ``(bucket, fields)`` with the same
        number of fields each; values in order, flat, None where missing. One script call per
        READ_SLICE refs (scripts.MP_READ_FIELDS), not one command per bucket."""
        if not refs:
            return []
        needs_redis()
        n = len(refs[0][1])
        out: list[str | None] = []
        for i in range(0, len(refs), READ_SLICE):
            part = refs[i:i + READ_SLICE]
            got = self._read_fields(keys=[K.mp_chunks_key(b) for b, _ in part],
                                    args=[n, *(f for _, fields in part for f in fields)])
            out += [v or None for v in got]
        return out

    def records(self, refs: Sequence[tuple[str, str]]) -> list[Record | None]:
        """The records of (bucket, field) refs, in order (:meth:`bucket_fields`)."""
        return [parse_record(v) if v else None for v in self.bucket_fields([(b, (f,)) for b, f in refs])]

    def token_bindings(self, refs: Sequence[tuple[str, str]]) -> list[tuple[list[int], int]]:
        return [parse_tokens(v) for v in self.bucket_fields([(b, (f,)) for b, f in refs])]
