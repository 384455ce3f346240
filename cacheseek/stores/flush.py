"""A bounded wait for a store's pending writes to drain: the one loop behind every ``flush``.

A store that completes writes on another thread keeps a count of pending writes under a lock and
notifies a `threading.Condition` on that lock whenever one completes (succeeded or failed).
`wait_drained` waits on that condition until the count is zero, at most ``bound_s`` seconds, and
raises the store's own error past the bound (built when it is raised, so it can name how many
writes are still pending; they go on, and a later flush may succeed). It wakes at least once a
second, so a missed notification costs at most that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["wait_drained"]

POLL_S = 1.0  # the longest sleep between two looks at the count


def wait_drained(idle: threading.Condition, pending: Callable[[], int], bound_s: float,
                 timeout_error: Callable[[int], BaseException]) -> None:
    """With ``idle``'s lock held: return once ``pending()`` is 0; past ``bound_s`` seconds raise
    ``timeout_error(pending())``. ``idle`` must be notified when a pending write completes."""
    deadline = time.monotonic() + bound_s
    while (n := pending()) > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timeout_error(n)
        idle.wait(timeout=min(remaining, POLL_S))
