"""`run_in_order`: n calls with at most ``width`` in flight, their results settled in order.

The Fluxon public Plan client makes one round-trip-bound call per value (a put of a commit, a
get of a get plan); a few in flight are much faster than one at a time (4 were 1.4-3x faster
than 1 on a 2-core machine, experiments/fluxon_plan). ``call(i)`` runs on ``pool`` (inline when
``width`` is 1 or there is no pool); ``settle(i, future)`` sees every issued call's outcome in index order, on the
calling thread. Issuing stops once ``stop()`` is true or ``i`` reaches ``limit()``, both asked
before each call; the calls already issued are still settled before this returns (each call
must be bounded in time by itself).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, Optional

__all__ = ["run_in_order"]


def run_in_order(n: int, call: Callable[[int], Any], settle: Callable[[int, Future], None], stop: Callable[[], bool],
                 *, width: int, pool: Optional[Callable[[], Executor]] = None,
                 limit: Optional[Callable[[], int]] = None) -> None:
    """Run ``call(i)`` for i in 0..n-1 (see the module docstring). ``pool``: a function giving
    the executor (asked only when ``width`` > 1)."""
    def more(i: int) -> bool:
        return not stop() and (limit is None or i < limit())

    if width == 1 or pool is None:
        for i in range(n):
            if not more(i):
                break
            fut: Future = Future()
            try:
                fut.set_result(call(i))
            except BaseException as exc:  # noqa: BLE001 - handed to settle
                fut.set_exception(exc)
            settle(i, fut)
        return
    executor = pool()
    in_flight: collections.deque[tuple[int, Future]] = collections.deque()
    i = 0
    while True:
        while i < n and len(in_flight) < width and more(i):
            in_flight.append((i, executor.submit(call, i)))
            i += 1
        if not in_flight:
            return
        j, fut = in_flight.popleft()
        settle(j, fut)
