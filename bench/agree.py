"""How often kvlookup and LMCache's controller agree, and who is right when they differ.

The reference ("truth") is the simulated fleet's own state: for every instance, the longest
run of chunks from token 0 that it holds (in any tier) -- what a router can actually reuse.
An answer is a map instance -> matched prefix length (tokens); locations are compared apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

#: Disagreement kinds, per instance.
OMITTED = "omitted holder"            # truth > 0, answer lacks the instance
SUFFIX_ONLY = "suffix-only credit"    # answer credits an instance that holds no prefix from token 0
OVER = "over-credit"                  # answer > truth > 0 (credited past the instance's first gap)
UNDER = "under-credit"                # 0 < answer < truth


def truth_tokens(truth_chunks: dict[str, int], ends: Sequence[int]) -> dict[str, int]:
    """Chunk counts -> token lengths."""
    return {inst: ends[n - 1] for inst, n in truth_chunks.items() if n}


def lengths(answer: dict) -> dict[str, int]:
    """layout_info {instance: [location, length]} -> {instance: length}."""
    return {inst: int(v[1]) for inst, v in answer.items()}


def classify(truth: dict[str, int], got: dict[str, int]) -> list[str]:
    """Per-instance differences of one answer from the truth (empty when it is right)."""
    kinds = []
    for inst in sorted(set(truth) | set(got)):
        t, g = truth.get(inst, 0), got.get(inst, 0)
        if t == g:
            continue
        if g == 0:
            kinds.append(OMITTED)
        elif t == 0:
            kinds.append(SUFFIX_ONLY)
        elif g > t:
            kinds.append(OVER)
        else:
            kinds.append(UNDER)
    return kinds


class Agreement:
    """Accumulates per-request comparisons of two controllers against the truth."""

    def __init__(self, max_examples: int = 5):
        self.n = 0
        self.same = 0
        self.same_best = 0
        self.same_location = 0
        self.right = {"kvlookup": 0, "lmcache": 0}
        self.kinds = {"kvlookup": Counter(), "lmcache": Counter()}
        self.hits = 0
        self.examples: list[dict] = []
        self.max_examples = max_examples

    def add(self, index: int, truth: dict[str, int], kv: dict, lm: dict) -> None:
        """truth: {instance: tokens}; kv/lm: layout_info answers."""
        self.n += 1
        kv_len, lm_len = lengths(kv), lengths(lm)
        self.hits += bool(truth)
        if kv_len == lm_len:
            self.same += 1
        if max(kv_len.values(), default=0) == max(lm_len.values(), default=0):
            self.same_best += 1
        common = set(kv) & set(lm)
        if all(kv[i][0] == lm[i][0] for i in common):
            self.same_location += 1
        for name, got in (("kvlookup", kv_len), ("lmcache", lm_len)):
            kinds = classify(truth, got)
            if not kinds:
                self.right[name] += 1
            self.kinds[name].update(kinds)
        if kv_len != lm_len and len(self.examples) < self.max_examples:
            self.examples.append({"request": index, "truth": truth, "kvlookup": kv_len, "lmcache": lm_len,
                                  "lmcache_wrong": classify(truth, lm_len),
                                  "kvlookup_wrong": classify(truth, kv_len)})

    def result(self) -> dict:
        n = max(self.n, 1)
        return {
            "requests": self.n, "with_a_holder": self.hits,
            "identical_answers_pct": round(100 * self.same / n, 2),
            "same_best_length_pct": round(100 * self.same_best / n, 2),
            "same_location_where_both_name_instance_pct": round(100 * self.same_location / n, 2),
            "right_pct": {k: round(100 * v / n, 2) for k, v in self.right.items()},
            "wrong_kinds": {k: dict(v) for k, v in self.kinds.items()},
            "examples": self.examples,
        }
