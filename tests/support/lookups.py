"""Steady lookups that record every answer, for the end-to-end fault tests.

:class:`Lookups` looks up random known prompts, one every ``pace_s``, either through a
``Client``-like object (``matches(tokens)``: in-process, or :class:`HttpClient` over a
controller) or by POSTing to a controller's ``/lookup`` URL, and keeps an :class:`Answer` for
each; :meth:`Lookups.outage` and :meth:`Lookups.recovery` summarize what they saw after a fault.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import requests


@dataclass
class Answer:
    started: float  # monotonic
    ended: float
    prompt: int  # index into the prompts
    got: dict | None  # instance -> (location, matched prefix length); None: no answer
    status: int = 200  # the HTTP status of a POST /lookup; 0: no HTTP answer (refused, reset, timeout)
    error: str = ""  # why a Client-like lookup raised


@dataclass
class HttpMatch:
    instance_id: str
    location: str
    matched_prefix_length: int


class HttpClient:
    """``matches()`` through a controller process's POST /lookup (tests.support.procs.ControllerProc),
    so :class:`Lookups` and tests.support.ha_fleet.layouts_match can drive the HTTP path too."""

    def __init__(self, controller):
        self.controller = controller

    def matches(self, tokens: list[int]) -> list[HttpMatch]:
        return [HttpMatch(inst, loc, n) for inst, (loc, n) in self.controller.layout(tokens).items()]


class Lookups(threading.Thread):
    """Looks up a random one of ``prompts`` every ``pace_s`` and records every answer.

    source: a ``Client``-like object (any exception it raises is an answer with ``got`` None
    and its ``error``), or the URL of a controller's ``POST /lookup`` (any status but 200 is an
    answer with ``got`` None and that ``status``)."""

    def __init__(self, source, prompts: list[list[int]], seed: int = 7, pace_s: float = 0.01):
        super().__init__(daemon=True, name="lookups")
        self.source, self.prompts = source, prompts
        self.client = None if isinstance(source, str) else source
        self.rng = random.Random(seed)
        self.pace_s = pace_s
        self.answers: list[Answer] = []
        self.session = requests.Session()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.pace_s):
            i = self.rng.randrange(len(self.prompts))
            t0 = time.monotonic()
            got, status, error = self._ask(self.prompts[i])
            self.answers.append(Answer(t0, time.monotonic(), i, got, status, error))

    def _ask(self, tokens: list[int]) -> tuple[dict | None, int, str]:
        if self.client is None:
            try:
                resp = self.session.post(self.source, json={"tokens": tokens}, timeout=3)
                if resp.status_code != 200:
                    return None, resp.status_code, ""
                return {k: v for k, v in resp.json().items() if k != "event_id"}, 200, ""
            except (requests.RequestException, ValueError):
                return None, 0, ""
        try:
            found = self.client.matches(tokens)
            return {m.instance_id: (m.location, m.matched_prefix_length) for m in found}, 200, ""
        except Exception as exc:
            return None, 0, f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)

    def window(self, since: float, until: float | None = None) -> list[Answer]:
        """Answers that ended at ``since`` or later and (with ``until``) started by then."""
        return [a for a in self.answers if a.ended >= since and (until is None or a.started <= until)]

    def outage(self, since: float) -> dict:
        """What lookups saw from ``since`` (monotonic; the kill): errors, the first failing and
        the first succeeding lookup after the first failure, the longest time without an
        answer, and how long after ``since`` the first lookup started after it was answered."""
        after = self.window(since)
        failed = [a for a in after if a.got is None]
        first_fail = failed[0].ended if failed else None
        ok_after = [a for a in after if a.got is not None and (first_fail is None or a.ended > first_fail)]
        ends = sorted([since] + [a.ended for a in after if a.got is not None])
        started_after = [a for a in after if a.started >= since and a.got is not None]
        return {
            "errors": len(failed),
            "error_kinds": sorted({a.error.split(":")[0] for a in failed}),
            "failing_to_succeeding_s": (ok_after[0].ended - first_fail) if failed and ok_after else None,
            "longest_without_answer_s": max(b - a for a, b in zip(ends, ends[1:], strict=False)) if len(ends) > 1
            else None,
            "first_answer_after_s": (started_after[0].ended - since) if started_after else None,
            "max_latency_s": max((a.ended - a.started for a in after), default=0.0),
        }

    def recovery(self, since: float, until: float | None = None) -> dict:
        """What lookups saw from ``since``: failed (not 200) answers, their statuses, when the
        first 200 after the last failure ended (seconds after ``since``; 0.0 with no failure),
        and the longest time without a 200."""
        window = self.window(since, until)
        failed = [a for a in window if a.got is None]
        last_fail = max((a.ended for a in failed), default=None)
        ok = sorted(a.ended for a in window if a.got is not None)
        recovered = next((t - since for t in ok if last_fail is None or t > last_fail), None) if failed else 0.0
        ends = [since, *ok]
        return {"lookups": len(window), "failed": len(failed), "statuses": sorted({a.status for a in failed}),
                "answered_again_s": recovered,
                "longest_without_answer_s": max((b - a for a, b in zip(ends, ends[1:], strict=False)), default=None)}
