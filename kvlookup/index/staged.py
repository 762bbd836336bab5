"""The client-side lookup: a prompt's chunks read in stages through any executor of plain
commands, holders resolved with a cache, the walk in Python (kvlookup.index.walk).

Used by the cluster backend (kvlookup.index.cluster: commands to every master at once) and by
the single-node backend when its reads are cached (kvlookup.index.tracking: most lookups then cost no
round trip at all). Round 1 reads the first :data:`FIRST_STAGE` chunks of every chain and the
registry version; later rounds read :data:`STAGE_GROWTH` times more of the chains that may still
extend, and resolve the holders the cache does not know (one RESOLVE on the registry's slot).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_

from kvlookup.index import keys
from kvlookup.index.copies import MISS, Digests
from kvlookup.index.io import raise_errors
from kvlookup.index.keys import CHUNK_DIGEST_MEMBER
from kvlookup.index.records import Chain, Liveness, Match, Matches, walk_registry_keys
from kvlookup.index.walk import ChainWalk, Holder, resolved

#: Chunks of each chain read in a lookup's first round; later rounds read 8x the previous.
FIRST_STAGE = 128
STAGE_GROWTH = 8
#: A lookup that resolves holders also resolves, in the same RESOLVE, the known holders whose
#: answers lapse within this long (ms): leases of a fleet resolved together lapse together (within
#: their renewal interval, <= 1 s), and one RESOLVE then renews them all, not one per lookup.
RENEW_AHEAD_MS = 2000
#: Walk answers a HolderCache keeps (all are dropped when it is full, or when an answer changes).
MEMO_MAX = 4096

#: Whether a lookup read by digest on a backend with cached reads (a fresh prompt's first miss,
#: tracking.UNTRACKED) takes the chunks the copies have from them and reads only the rest
#: (StagedLookup ``peek``); False: it reads every chunk's head from Redis, as before
#: (app.asgi sets it from ``KVLOOKUP_FIRST_MISS=digest-all``; docs/benchmarks-notes.md, fresh18e).
MISS_COPIES = True

#: ``execute(commands) -> results``: plain commands (name, key, ...) and EVALSHA, in one round trip.
Execute = Callable[[Sequence[tuple]], list]


class HolderCache:
    """RESOLVE answers kept across lookups while the registry version stays the same
    (``keys.registry_version_key``: every retirement, registration or deregistration moves it).

    A holder that does not count (retired, unknown) stays so until the version moves; one that
    counts does until its ``until`` (its lease's expiry, or its last heartbeat + the worker TTL):
    after that it is asked again (the lease was probably renewed), unless RESOLVE said its lease
    had lapsed already on Redis server time (``lapsed``): a lease write that revives a lapsed
    lease moves the version (scripts._REVIVE), so until then it stays out without asking (a
    prompt held by a dead fleet costs no RESOLVE a lookup). So a lookup whose holders are all
    known needs no RESOLVE, and its answer is the one a RESOLVE would give.
    """

    def __init__(self):
        self.version: str | None = None
        #: holder id -> (holder or None, until, lapsed): :func:`kvlookup.index.walk.resolved`
        self.entries: dict[str, tuple[Holder | None, float, bool]] = {}
        #: walk answers of :class:`StagedLookup` (memo=True), valid while no entry changes:
        #: key -> (answer, its :meth:`window`, the member lists it was walked over)
        self.memo: dict[tuple, tuple[Matches, tuple[float, float], list]] = {}
        self.gen = 0  # moves whenever an entry (or the version) changes

    def _changed(self) -> None:
        self.gen += 1
        self.memo.clear()

    def clear(self) -> None:
        """Forget every answer (the next lookup resolves its holders)."""
        self.entries.clear()
        self.version = None
        self._changed()

    def at(self, version: str) -> None:
        """The registry's version as a lookup read it: a new one drops every answer."""
        if version != self.version:
            self.entries.clear()
            self.version = version
            self._changed()

    def get(self, hid: str, now_ms: int) -> tuple[bool, Holder | None]:
        """(known, holder) for this lookup: known is False when it must be resolved."""
        entry = self.entries.get(hid)
        if entry is None:
            return False, None
        holder, until, lapsed = entry
        if holder is None:
            return True, None
        if until >= now_ms:
            return True, holder
        return (True, None) if lapsed else (False, None)

    def window(self, holders: dict[str, Holder | None]) -> tuple[float, float]:
        """(after, until): the lookup times (unix ms) at which an answer walked over ``holders``
        (a lookup's view: id -> Holder, or None where it did not count) is still the one a new
        walk gives: ``after < now <= until``. until: the earliest ``until`` of those that counted;
        after: the latest ``until`` of those left out only because it had passed (a lapsed
        lease, kept out without asking): at an earlier ``now`` (a clock frozen while Redis
        refuses writes, kvlookup.index.clock) they would count."""
        after, until = float("-inf"), float("inf")
        entries = self.entries
        for hid, holder in holders.items():
            entry = entries.get(hid)
            if entry is None or entry[0] is None:
                continue
            if holder is not None:
                until = min(until, entry[1])
            else:
                after = max(after, entry[1])
        return after, until

    def put(self, version: str, hids: Sequence[str], texts: Sequence[str]) -> None:
        """RESOLVE's answers. Kept walk answers stay when no holder's answer changed (only its
        ``until`` moved on: a renewed lease); each still expires at its own ``until``."""
        self.at(version)
        changed = False
        for hid, text in zip(hids, texts, strict=True):
            entry = resolved(text)
            old = self.entries.get(hid)
            changed = changed or old is None or old[0] != entry[0] or old[2] != entry[2]
            self.entries[hid] = entry
        if changed:
            self._changed()


class StagedLookup:
    """One lookup's rounds. Round 1 reads the first :data:`FIRST_STAGE` chunks of every chain
    and the registry version; the holders found are taken from the :class:`HolderCache` when it
    knows them. Each later round resolves the holders the previous round found that the cache did
    not know (one RESOLVE on the registry's slot) *and*, in the same round trip, reads the next
    stage of every chain that may still extend (its last chunk read had holders). So a prompt of
    up to FIRST_STAGE chunks whose holders are known costs one round trip; two otherwise.

    memo: the executor shares equal member lists as one object (kvlookup.index.copies), so a
    lookup that read its whole answer in its first round, with every holder known, keeps its
    answer in the cache (:attr:`HolderCache.memo`) under the runs of those objects; a later
    lookup whose first round reads the same runs (the same prompt, or any prompt whose chunks
    have the same holders in the same runs) gets that answer without walking, while no cache
    entry changed and no holder's ``until`` passed. Walking 1,024 holders costs milliseconds in
    Python; the memo makes the cost of a held prefix independent of how many hold it."""

    def __init__(self, execute: Execute, resolve_sha: str, cache: HolderCache, chains: Sequence[Chain],
                 live: Liveness, memo: bool = False, digests: Digests | None = None, heads: str | None = None,
                 peek: Callable[[list[tuple[str, str]]], list] | None = None):
        self.execute, self.resolve_sha, self.cache = execute, resolve_sha, cache
        #: ``peek([(name, key)])``: kept copies or MISS, sending nothing (tracking.CachedReads.peek): a
        #: lookup read by digest takes from it the chunks (and registry version) it has and
        #: reads only the rest, so a fresh prompt's held prefix is not read again from Redis
        self.peek = peek
        self.memo = memo
        self.digests = digests
        self.heads = heads  # sha of scripts.CHUNK_HEADS: one command reads every chunk's head
        self.chains, self.live = chains, live
        self.walks = [ChainWalk(c.chunk_size, c.n_tokens) for c in chains]
        # as this lookup sees them; a chunk set's digest member is no holder
        self.holders: dict[str, Holder | None] = {CHUNK_DIGEST_MEMBER: None}
        self.read_upto = [0] * len(chains)  # chunks read per chain
        self.unfed: list[list] = [[] for _ in chains]  # member lists read, not walked yet
        self.stage = [FIRST_STAGE] * len(chains)
        #: set when :meth:`run` answered from the memo: that answer's HolderCache.window
        self.kept_window: tuple[float, float] | None = None

    def run(self) -> Matches:
        new_hids: list[str] = []
        first = True
        cache = self.cache
        memo = None  # (key, member lists, cache generation) of this lookup's first round
        rounds = 0
        while True:
            reads = [(ci, self._next_span(ci)) for ci in range(len(self.chains)) if self._may_extend(ci)]
            reads = [(ci, span) for ci, span in reads if span]
            if not reads and not new_hids:
                break
            version = first and not new_hids
            known = self._peek_ahead(reads, version) if self.peek is not None else None
            read_keys = [k for _ci, span in reads for k in span]
            res = self._round(read_keys, new_hids, version, known)
            rounds += 1
            if new_hids:
                cache.put(res[-1][0], new_hids, res[-1][1:])
                for hid in new_hids:
                    self.holders[hid] = cache.get(hid, self.live.now_ms)[1]
            elif first:
                cache.at(res[-1] or "0")
                if self.memo:
                    memo = self._memo_key(reads, res, cache.gen)
                    hit = cache.memo.get(memo[0]) if memo is not None else None
                    if hit is not None and hit[1][0] < self.live.now_ms <= hit[1][1]:
                        self.kept_window = hit[1]
                        return hit[0]
            first = False
            self._feed()  # what the previous round read is resolved now
            new_hids = self._take(reads, res)
            if not new_hids:
                self._feed()
        found = [Match(inst, wid, end, locs) for w in self.walks for inst, wid, end, locs in w.matches()]
        causes = [w.miss for w in self.walks if w.miss]
        out = Matches.of(found, next((c for c in causes if c != "no_holder"), causes[0] if causes else ""))
        if memo is not None and rounds == 1:
            self._remember(out, *memo)
        return out

    def _peek_ahead(self, reads: list[tuple[int, list[str]]], version: bool) -> list:
        """The copies :attr:`peek` holds of the keys of ``reads`` (then, with ``version``, of the
        registry version), MISS where it holds none. A chain whose span the copies hold whole, each
        chunk with holders, reads its next stage in this round too (its span in ``reads`` grows in
        place), until a chunk is lacked or known empty or the chain ends: a held prefix with a new
        last chunk costs one round trip, not one a stage. After a chunk known empty nothing more
        of its chain is asked (given as empty: the walk ends there)."""
        per = self._peek_spans([span for _ci, span in reads], version)
        ver = per.pop() if version else []
        while grow := [i for i, (ci, _span) in enumerate(reads) if per[i] and MISS not in per[i]
                       and all(per[i]) and self.read_upto[ci] < len(self.chains[ci].hashes)]:
            more = [self._next_span(reads[i][0]) for i in grow]
            for i, span, got in zip(grow, more, self._peek_spans(more, False), strict=True):
                reads[i][1].extend(span)
                per[i].extend(got)
        for got in per:
            if () in got:  # known empty (copies are tuples; MISS equals nothing): the rest is never walked
                j = got.index(())
                got[j + 1:] = [()] * (len(got) - j - 1)
        return [v for got in per for v in got] + ver

    def _peek_spans(self, spans: list[list[str]], version: bool) -> list[list]:
        """:attr:`peek` of the chunk keys of each span (one call), per span; with ``version``, a last
        list of the registry version's copy."""
        assert self.peek is not None
        got = self.peek([("ZRANGE", k) for span in spans for k in span]
                        + ([("GET", keys.registry_version_key())] if version else []))
        out, pos = [], 0
        for span in spans:
            out.append(got[pos:pos + len(span)])
            pos += len(span)
        if version:
            out.append(got[pos:])
        return out

    def _round(self, read_keys: list[str], new_hids: list[str], version: bool, known: list | None = None) -> list:
        """One round trip (none when the copies have it all): the member lists of ``read_keys``,
        then RESOLVE's answer of ``new_hids`` or, with ``version``, the registry version.
        known: :meth:`_peek_ahead`'s copies of them (MISS: asked of Redis); None: no copies."""
        got_version = None
        if known is not None:
            if version:
                got_version = known.pop()
                if got_version is MISS:
                    got_version = None
            lacked = list(compress(range(len(read_keys)), map(is_, known, repeat(MISS))))  # (in C)
            sent = [read_keys[i] for i in lacked]
        else:
            sent = read_keys
        if self.heads is not None and sent:
            cmds: list[tuple] = [("EVALSHA", self.heads, len(sent), *sent)]
        elif self.digests is not None:
            cmds = [("ZRANGE", k, 0, 1, "WITHSCORES") for k in sent]
        else:
            cmds = [("ZRANGE", k, 0, -1) for k in sent]
        if new_hids:
            cmds.append(("EVALSHA", self.resolve_sha, 6, *walk_registry_keys(), keys.registry_version_key(),
                         *self.live.argv(), *new_hids))
        elif version and got_version is None:
            cmds.append(("GET", keys.registry_version_key()))
        res = self.execute(cmds) if cmds else []
        if self.heads is not None and sent:
            res[0:1] = raise_errors(res[0:1])[0]
        if self.digests is not None:
            self._by_digest(sent, res)
        if known is None:
            return res
        out = known[:len(read_keys)]
        for i, members in zip(lacked, res, strict=False):
            out[i] = members
        if new_hids or version:
            out.append(res[len(lacked)] if got_version is None else got_version)
        return out

    def _by_digest(self, read: list[str], res: list) -> None:
        """Turn the ``ZRANGE key 0 1 WITHSCORES`` replies (or ``CHUNK_HEADS`` strings) of the chunk
        keys ``read`` (the first ``len(read)`` of ``res``) into member tuples: a digest seen before is its kept set, a
        set without a digest has at most one holder; the members of a new digest are read once
        (one round trip, one chunk per digest; a set that changed meanwhile is read chunk by
        chunk). A set of two holders or more without a digest (written before digests) is read
        in full, as a list (never kept)."""
        dg = self.digests
        assert dg is not None
        todo: dict[int, list[int]] = {}  # new digest -> positions
        full: list[int] = []
        prev = ""
        for i in range(len(read)):
            head = _head(raise_errors([res[i]])[0])
            if head == "=":  # CHUNK_HEADS: the digest of the key before
                head = prev
            prev = head
            if not head:
                res[i] = ()
            elif head[0] == "-":
                d = -1 - int(float(head))
                kept = dg.get(d)
                if kept is None:
                    todo.setdefault(d, []).append(i)
                else:
                    res[i] = kept
            elif head == "*":
                full.append(i)
            else:
                res[i] = dg.one(head)
        if not todo and not full:
            return
        reps = [pos[0] for pos in todo.values()]
        lists = raise_errors(self.execute([("ZRANGE", read[i], 0, -1) for i in reps + full]))
        for i, members in zip(full, lists[len(reps):], strict=True):
            res[i] = members
        again: list[int] = []
        for (d, pos), members in zip(todo.items(), lists[:len(reps)], strict=True):
            if keys.set_digest(members) == d:
                kept = dg.put(d, tuple(members))
                for i in pos:
                    res[i] = kept
            else:
                again += pos
        for i, members in zip(again, raise_errors(self.execute([("ZRANGE", read[i], 0, -1) for i in again])),
                              strict=True):
            res[i] = members

    def _memo_key(self, reads, res, gen: int) -> tuple[tuple, list, int] | None:
        """The memo key of a first round: per chain its shape and the runs of member-list
        objects read (object id, length); those objects (kept alive, so no id is reused); and
        ``gen``. None when a list was not shared (read past the copies: ids would never repeat)."""
        key: list = [self.live.worker_ttl_ms, self.live.check_alive]
        objs: list = []
        pos = 0
        for ci, span in reads:
            chain = self.chains[ci]
            key += (ci, chain.chunk_size, chain.n_tokens, len(chain.hashes))
            prev, n = None, 0
            for members in res[pos:pos + len(span)]:
                if type(members) is not tuple:
                    return None
                if members is prev:
                    n += 1
                    continue
                if n:
                    key.append(n)
                key.append(id(members))
                objs.append(members)
                prev, n = members, 1
            key.append(n)
            pos += len(span)
        return tuple(key), objs, gen

    def _remember(self, out: Matches, key: tuple, objs: list, gen: int) -> None:
        """Keep a one-round answer, valid in its :meth:`HolderCache.window`."""
        cache = self.cache
        window = cache.window(self.holders)
        if cache.gen != gen:
            return  # another lookup changed the cache meanwhile: what this one saw may be gone
        if len(cache.memo) >= MEMO_MAX:
            cache.memo.clear()
        out.kept = True  # shared by every lookup that gets it: never changed (kvlookup.client)
        cache.memo[key] = (out, window, objs)

    def _may_extend(self, ci: int) -> bool:
        walk, unfed = self.walks[ci], self.unfed[ci]
        if walk.done or self.read_upto[ci] >= len(self.chains[ci].hashes):
            return False
        last = unfed[-1] if unfed else (walk.prev_members if walk.i else True)
        return bool(last)  # an empty chunk ends every match

    def _next_span(self, ci: int) -> list[str]:
        start = self.read_upto[ci]
        stop = start + self.stage[ci]
        self.stage[ci] *= STAGE_GROWTH
        self.read_upto[ci] = min(stop, len(self.chains[ci].hashes))
        return self.chains[ci].chunk_keys(start, stop)

    def _take(self, reads, res) -> list[str]:
        """Buffer the member lists read; returns the holder ids to resolve (not known to this
        lookup, and not answered by the cache)."""
        pos, seen, prev = 0, set(), None
        for ci, span in reads:
            lists = res[pos:pos + len(span)]
            pos += len(span)
            self.unfed[ci].extend(lists)
            for members in lists:
                if members is not prev and members != prev:  # runs of the same holders are common
                    seen.update(members)
                    prev = members
        new = []
        now = self.live.now_ms
        for hid in seen:
            if hid in self.holders:
                continue
            known, holder = self.cache.get(hid, now)
            if known:
                self.holders[hid] = holder
            else:
                new.append(hid)
        if new:  # a round trip anyway: renew, in it, the answers that would lapse soon too
            soon = now + RENEW_AHEAD_MS
            entries = self.cache.entries
            asked = set(new)
            new += [h for h in seen if h not in asked and self.holders.get(h) is not None
                    and entries.get(h, (None, 0.0))[1] < soon]
        return sorted(new)

    def _feed(self) -> None:
        for ci, lists in enumerate(self.unfed):
            if lists:
                self.walks[ci].feed(lists, self.holders)
                self.unfed[ci] = []


def _head(reply) -> str:
    """A chunk set's head as ``CHUNK_HEADS`` answers it ('' none, ``-1 - D`` digest, '=' the
    digest before, the only holder, '*' several without a digest), from that string or a ``ZRANGE key 0 1 WITHSCORES``
    reply (RESP2 flat, or RESP3 pairs)."""
    if type(reply) is str:
        return reply
    if reply and isinstance(reply[0], list):
        reply = [x for pair in reply for x in pair]
    if not reply:
        return ""
    if reply[0] == CHUNK_DIGEST_MEMBER:
        return str(reply[1])  # always negative
    return reply[0] if len(reply) == 2 else "*"
