"""`counted_failures`: a binding's hook failures are counted and the first of each kind logged.

TeleFuser catches every exception of a hook, logs a warning and runs cold: a failing binding
would be invisible. So each hook runs inside `counted_failures`, which counts the failure in the
manager's metrics (``hook_failures`` by hook), logs the first failure of each hook and kind with
its cause, then re-raises for the runtime's fallback (or the caller's own handling).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("cacheseek.reuse.exact_prefix.telefuser_lingbot")

__all__ = ["counted_failures"]


@contextlib.contextmanager
def counted_failures(binding: Any, hook: str) -> Iterator[None]:
    """Count and (the first time) log an exception of ``binding``'s ``hook``, then re-raise it."""
    try:
        yield
    except Exception as exc:
        if binding.manager.metrics.record_hook_failure(hook, type(exc).__name__):
            log.error("CacheSeek %s failed (the runtime falls back to a cold run; later failures of "
                      "this kind are only counted): %s: %s", hook, type(exc).__name__, exc, exc_info=exc)
        raise
