"""Sampling a value while a fault runs, and reading the samples: liveness lease margins,
/health outages, purges of retired holders."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvlookup.index import keys
from tests.support.helpers import wait


class Sampler(threading.Thread):
    """Calls ``fn()`` every ``every_s`` seconds until stopped (started at once); keeps (time, value)."""

    def __init__(self, fn: Callable[[], float], every_s: float):
        super().__init__(daemon=True, name="sampler")
        self.fn, self.every_s = fn, every_s
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.fn()))
            if self.stop_event.wait(self.every_s):
                return

    def stop(self) -> list[float]:
        self.stop_event.set()
        self.join(5)
        return [v for _t, v in self.samples]


def lowest_and_renewed(samples: list[tuple[float, float]], since: float) -> tuple[float, float | None]:
    """From lease margins sampled from ``since``: the lowest, and when the lease was renewed
    after it (seconds after ``since``)."""
    after = [(t, v) for t, v in samples if t >= since]
    i = min(range(len(after)), key=lambda k: after[k][1])
    return after[i][1], (after[i + 1][0] - since) if i + 1 < len(after) else None


def lease_margin_s(r, names: list[str]) -> float:
    """The shortest time left on the liveness lease of any of ``names`` (negative: lapsed)."""
    now_ms = time.time() * 1000
    scores = dict(r.zrange(keys.alive_key(), 0, -1, withscores=True))
    return min(scores.get(n, float("-inf")) - now_ms for n in names) / 1000


def purge_time(r, holder: str, timeout: float = 60.0) -> float:
    """Seconds until a retired holder's records are purged and the holder forgotten."""
    return wait(lambda: r.hget(keys.records_key(), holder) is None and r.zscore(keys.dead_holders_key(), holder)
                is None, timeout, f"holder {holder} purged")


def outage_of_health(samples: list[tuple[float, tuple]], since: float, healthy: Callable[[tuple], bool]) -> dict:
    """From /health samples taken from ``since``: when it first answered 503, when it was first
    healthy again after that, and every status seen in between (the 503 must hold until then)."""
    after = [(t - since, v) for t, v in samples if t >= since]
    first_503 = next((t for t, v in after if v[0] == 503), None)
    back = next((t for t, v in after if first_503 is not None and t > first_503 and healthy(v)), None)
    between = {v[0] for t, v in after if first_503 is not None and first_503 <= t < (back or float("inf"))}
    return {"first_503_s": first_503, "healthy_s": back, "between": sorted(between)}
