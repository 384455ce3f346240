"""The Plan tier's warm-up (`Warmup`, `WarmupOptions`), in the constructor or on a thread, and
the session starts it yields to.

The warm-up maps the segment, pre-faults it (2 MiB pages, several
threads) and registers it with the transfer runtime piece by piece (`TransferLink`), makes the
streams and the staging slots: about 0.2 s/GiB on an H200 host (5 s for 24 GiB, 13 s for 64 GiB)
before the first request. ``foreground`` (the default) runs it in the constructor: a store that
returns is ready, and a failure raises there. ``background`` returns at once, runs it on thread
"cacheseek-plan-warmup" and keeps its exception; until it ends the store serves every read as a
miss and refuses every write with `StoreWarmingError`; the binding, seeing ``ready`` False, runs
such a session as with no cache (no keys, no lookup, no writes), so the first request is served
as soon as with no cache at all. Between pieces a background warm-up waits while a session holds
a `SessionStarts` token (`PlanTierStore.session_starting`, taken by the binding from its creation
until its ``on_runtime_created`` returns), at most ``warmup_yield_s`` per session start, so the
runtime's allocations never queue behind a registration. ``close`` waits for it (bounded:
`StoreTimeoutError` while it still runs, so that nothing is torn down under it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Optional, Union

import attrs

from cacheseek.errors import ConfigError, StoreTimeoutError, StoreWarmingError
from cacheseek.sizes import Size, parse_size
from cacheseek.stores.plan_tier.stats import Counters
from cacheseek.stores.startup import NO_TOKEN, SessionStarts, StartToken, combine

__all__ = ["WARMUP_MODES", "Warmup", "WarmupOptions"]

log = logging.getLogger("cacheseek.stores.plan_tier")

WARMUP_MODES = ("foreground", "background")

# Threads that pre-fault the segment of a background warm-up (prefault_threads=0): every fault
# step holds the mmap lock that the runtime's own cudaMalloc calls wait for, so fewer threads
# keep the requests served meanwhile as fast as with no cache; the warm-up takes longer.
_BACKGROUND_FAULT_THREADS = 2
# Pause between two registered pieces of a background warm-up: the request thread's cudaMalloc
# calls, waiting for the driver's and the mmap locks, get them before the next piece does.
_BACKGROUND_PIECE_PAUSE_S = 1e-3
_PIECE_ROUND = 2 << 20  # register_piece_bytes rounds up to whole 2 MiB pages
# register_piece_bytes=auto in a background warm-up. On the H200 (24 GiB segment, experiments/warmup)
# the first request came 0.76 s after start with 1 GiB pieces, 0.61 s with 256 MiB, 0.24 s with
# 64 MiB and 0.14 s with 16 MiB (no cache: 0.06 s): each of the request's CUDA calls waits for the
# piece being registered. Smaller pieces cost registration time (2.5 s for 1536 pieces, 0.65 s for
# one call), which a background warm-up spends while requests run uncached.
_BACKGROUND_PIECE_BYTES = 16 << 20


@attrs.frozen(slots=True)
class WarmupOptions:
    """The store's warm-up options, checked: ``mode`` (``warmup``), ``piece_bytes``
    (``register_piece_bytes``: each host mapping is faulted and registered in pieces of this size,
    rounded up to 2 MiB, so no single driver call holds the driver's and the mmap locks for long;
    0 or None: one call; ``"auto"``: 16 MiB pieces in a background warm-up, one call in the
    foreground), ``prefault_threads``, ``yield_s`` (``warmup_yield_s``)."""

    mode: str
    piece_bytes: int
    prefault_threads: int
    yield_s: float

    @classmethod
    def of(cls, mode: str, register_piece_bytes: Union[Size, str, None], prefault_threads: int,
           warmup_yield_s: float) -> "WarmupOptions":
        if mode not in WARMUP_MODES:
            raise ConfigError("store.warmup", f"must be one of {', '.join(WARMUP_MODES)}, got {mode!r}",
                              "foreground: ready when built; background: serve misses while warming")
        if register_piece_bytes == "auto":
            register_piece_bytes = _BACKGROUND_PIECE_BYTES if mode == "background" else 0
        piece_bytes = parse_size(register_piece_bytes, "store.register_piece_bytes", allow_none=True) or 0
        if isinstance(warmup_yield_s, bool) or not isinstance(warmup_yield_s, (int, float)) or warmup_yield_s < 0:
            raise ConfigError("store.warmup_yield_s", f"must be seconds >= 0, got {warmup_yield_s!r}",
                              "0 never pauses the warm-up for a starting session")
        if mode == "background" and prefault_threads == 0:
            prefault_threads = _BACKGROUND_FAULT_THREADS  # leave the memory system to the requests
        return cls(mode, -(-piece_bytes // _PIECE_ROUND) * _PIECE_ROUND, prefault_threads, warmup_yield_s)

    @property
    def background(self) -> bool:
        return self.mode == "background"

    @property
    def piece_pause_s(self) -> float:
        return _BACKGROUND_PIECE_PAUSE_S if self.background else 0.0


class Warmup:
    """One run of the warm-up, and the session starts it yields to (``starts``): a background store is built for sessions about to start, so the warm-up waits
    for the first one's start-up too (released by it, by `wait`, by `close`, or after
    ``yield_s``), and its own setup does not run under the first request's allocations."""

    def __init__(self, options: WarmupOptions, counters: Counters) -> None:
        self.mode = options.mode
        self._counters = counters
        self.starts = SessionStarts(options.yield_s)
        self._first_start = self.starts.begin() if options.background else NO_TOKEN
        self.error: Optional[BaseException] = None
        self.started_at = time.perf_counter()
        self.seconds: Optional[float] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def yield_to(self) -> Optional[Callable[[], float]]:
        """What a background warm-up waits on before each step; None in the foreground."""
        return self.starts.wait_clear if self.mode == "background" else None

    def start(self, run: Callable[[], None]) -> None:
        self._run = run
        if self.mode == "foreground":
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

    def note_state(self) -> None:
        self._counters.note(warmup=self.mode, ready=self.ready,
                            warmup_error=None if self.error is None else repr(self.error))

    def warming(self, reads: int = 0, writes: int = 0) -> bool:
        """True (counting the call) while the segment is not ready to serve."""
        if self.ready:
            return False
        self._counters.count(reads_while_warming=reads, writes_while_warming=writes, reads=reads,
                             read_misses=reads)
        return True

    def session_starting(self) -> StartToken:
        """`PlanTierStore.session_starting`; the first session's token also ends the wait the
        warm-up begins with."""
        if self.ended:
            return NO_TOKEN
        first, self._first_start = self._first_start, NO_TOKEN
        return combine([self.starts.begin(), first])

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """`PlanTierStore.wait_ready`."""
        first, self._first_start = self._first_start, NO_TOKEN
        first.release()
        self._done.wait(timeout_s)
        return self.ready

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for a background warm-up before the store is torn down; no session
        start holds it any more (nor the first one)."""
        self.starts.close()
        if self._thread is None or self._done.wait(timeout_s):
            return
        raise StoreTimeoutError(
            f"the Plan tier's background warm-up is still running after {timeout_s} s; close() "
            "leaves its segment and registrations alone (call close() again later)")
