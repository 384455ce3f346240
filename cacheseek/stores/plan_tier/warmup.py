"""`Warmup`: the Plan tier's warm-up on the constructor's path, or on a thread of its own.

Warming a segment maps it, pre-faults it (2 MiB pages, several threads) and registers it with the
transfer runtime piece by piece (`TransferLink`: fault a piece, register it, the next), makes the
streams and the staging slots: about 0.2 s/GiB on an H200 host, so
5 s for a 24 GiB segment and 13 s for 64 GiB before the first request. ``foreground`` (the default)
runs it in the constructor: a store that returns is ready, and a failure raises there.
``background`` returns at once; until the warm-up ends the store serves every read as a miss and
refuses every write with `StoreWarmingError`; the binding, seeing ``ready`` False, runs such a
session as with no cache (no keys, no lookup, no writes), so the first request is served as soon
as with no cache at all. A background warm-up also yields to session start-up: between pieces it
waits while a session holds a `SessionStarts` token (`PlanTierStore.session_starting`, taken by
the binding from its creation until its ``on_runtime_created`` returns), at most
``warmup_yield_s`` per session start, so the runtime's allocations never queue behind a
registration.

Lifecycle::

    Warmup(run, background=False)   run() now; its exception propagates
    Warmup(run, background=True)    run() on thread "cacheseek-plan-warmup"; its exception is kept
    ready                           True once run() returned (never after a failure)
    wait(timeout_s) -> bool         block until it ended (ready or failed), at most timeout_s
    join(timeout_s)                 close(): bounded; `StoreTimeoutError` while it still runs, so
                                    that nothing is torn down under it
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

from cacheseek.errors import ConfigError, StoreTimeoutError, StoreWarmingError

log = logging.getLogger("cacheseek.stores.plan_tier")

__all__ = ["Warmup", "WARMUP_MODES"]

WARMUP_MODES = ("foreground", "background")


class Warmup:
    """One run of ``run`` (see the module docstring)."""

    def __init__(self, run: Callable[[], None], *, mode: str = "foreground") -> None:
        if mode not in WARMUP_MODES:
            raise ConfigError("store.warmup", f"must be one of {', '.join(WARMUP_MODES)}, got {mode!r}",
                              "foreground: ready when built; background: serve misses while warming")
        self.mode = mode
        self.error: Optional[BaseException] = None
        self.started_at = time.perf_counter()
        self.seconds: Optional[float] = None
        self._done = threading.Event()
        self._run = run
        self._thread: Optional[threading.Thread] = None
        if mode == "foreground":
            run()
            self._finish()
        else:
            self._thread = threading.Thread(target=self._background, name="cacheseek-plan-warmup", daemon=True)
            self._thread.start()

    def _background(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # kept: every write names it, close() does not re-raise it
            self.error = exc
            log.error("Plan tier warm-up failed; the store serves misses and refuses writes: %s", exc,
                      exc_info=exc)
        self._finish()

    def _finish(self) -> None:
        self.seconds = time.perf_counter() - self.started_at
        self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.error is None

    @property
    def ended(self) -> bool:
        return self._done.is_set()

    def refuse_write(self) -> StoreWarmingError:
        """The error a write gets before the store is ready."""
        if self.error is not None:
            return StoreWarmingError(f"the Plan tier's background warm-up failed: {self.error}")
        return StoreWarmingError(
            f"the Plan tier is still warming up in the background ({time.perf_counter() - self.started_at:.1f} s "
            "so far); this write is dropped")

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Block until the warm-up ended, at most ``timeout_s`` seconds; whether it is ready."""
        self._done.wait(timeout_s)
        return self.ready

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for a background warm-up before the store is torn down."""
        if self._thread is None or self._done.wait(timeout_s):
            return
        raise StoreTimeoutError(
            f"the Plan tier's background warm-up is still running after {timeout_s} s; close() "
            "leaves its segment and registrations alone (call close() again later)")
