"""`Histogram`: a cumulative, fixed-bucket distribution of one quantity, as Prometheus keeps one.

The counters of `cacheseek.metrics` keep their distributions here (restore and write bytes and
seconds, time to first frame, per-chunk wall, shared-index probe latency); the endpoint
(`cacheseek.prometheus`) and ``results.json`` render the same object. An observation is a
``bisect`` over a tuple of at most ~20 upper bounds and two additions, under the caller's lock: a
few hundred nanoseconds, no allocation. Buckets never reset, so a scraper's ``rate()`` works.

Bounds are upper bounds (``le``) in the quantity's base unit (seconds, bytes, chunks); the last
bucket, ``+Inf``, is implicit.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["Histogram", "BYTES_BUCKETS", "SECONDS_BUCKETS", "DEPTH_BUCKETS"]

# 1 KiB .. 64 GiB in powers of 4: a tiny test chunk (hundreds of bytes) to a 480p one (3.57 GiB).
BYTES_BUCKETS: tuple[float, ...] = tuple(float(1024 * 4 ** i) for i in range(14))
# 100 us .. 60 s: a restore of a 480p chunk takes 2-70 ms, computing one about 3 s.
SECONDS_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# chunks restored by one hit (its depth K)
DEPTH_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


class Histogram:
    """Counts per bucket (``counts[i]``: observations ``<= bounds[i]`` and above the previous
    bound; the last entry is ``+Inf``), their ``sum`` and ``count``. Not locked itself: its owner
    (`CacheMetrics`) holds one lock around every update and every read."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram bounds must be strictly increasing, got {bounds!r}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum: float = 0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, observations <= le), ...]`` ending with ``("+Inf", count)``: Prometheus's form."""
        out, running = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            running += c
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out

    def copy(self) -> "Histogram":
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum, h.count = self.bounds, list(self.counts), self.sum, self.count
        return h

    def as_dict(self) -> dict[str, Any]:
        """``count``, ``sum`` and the cumulative ``buckets`` (``{le: n}``), for results.json."""
        return {"count": self.count, "sum": self.sum, "buckets": dict(self.cumulative())}
