"""`BesideWrites`: a store's writer of the values kept beside a chunk (its frames, its decoder's
state), so that their write leaves the request path.

Once the writer has a place for it, the caller captures on its own thread what must be captured
at that moment (a device-side copy of state the runtime overwrites next, ordered by an event);
the rest is one job: copy completion, digest, ``put_skeleton``, the chunk's check. One daemon thread per store runs the
jobs in submission order (`PendingWrites` and its `WriteBackWorker`, the KV tiers' write-back).

Bounded: at most ``limit`` jobs of one ``kind`` are in flight (queued or running), so at most that
many captured values are held (the default, 1, keeps one decoder state of 1.76 GiB at 480p). A
submit past it is refused at once (False: the caller drops the value and counts it), never
blocks, and nothing is captured. ``limit`` 0 runs the job in the caller's thread (the write on
the request path).

Lifecycle::

    submit(capture, kind, limit) -> True: captured and queued (the thread starts on first
                    use); False: refused, nothing captured
    flush(bound_s)  returns once no job is in flight; `StoreTimeoutError` past ``bound_s``
    close(bound_s)  flush, then the thread stopped; later submits are refused (a closed store
                    never sees a write arrive)

A job owns its failures: one that raises is logged and counted as done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import StoreTimeoutError
from cacheseek.stores.write_back import PendingWrites

log = logging.getLogger(__name__)

__all__ = ["BesideWrites", "FLUSH_S"]

FLUSH_S = 120.0  # the bound of `flush` and `close` where the store names none
_DEPTH = 64  # jobs queued at most, every kind together


class _Counts:
    """What `PendingWrites` counts (``pending_writes``) and each kind's share of it."""

    def __init__(self) -> None:
        self.pending_writes = 0
        self.by_kind: dict[str, int] = {}


class BesideWrites:
    """The beside-chunk writer of the store named ``name`` (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._pending: Optional[PendingWrites] = None
        self._closed = False

    def submit(self, capture: Callable[[], Callable[[], Any]], *, kind: str, limit: int) -> bool:
        """Take a place for a job of ``kind`` and, holding it, call ``capture()`` in this thread
        (what must be captured now; it returns the job), then queue the job for the writer
        thread. False, ``capture`` not called, when ``limit`` jobs of ``kind`` are in flight or
        the writer is closed. ``limit`` 0: capture and run the job now, in this thread. What
        ``capture`` raises is raised (its place given back)."""
        if limit <= 0:
            if self._closed:
                return False
            capture()()
            return True
        with self._lock:
            counts = self._counts
            if self._closed or counts.by_kind.get(kind, 0) >= limit or counts.pending_writes >= _DEPTH:
                return False
            if self._pending is None:
                self._pending = PendingWrites(self._lock, counts, self._run, write_back=True, depth=_DEPTH,
                                              name=f"{self.name}-beside")
            counts.pending_writes += 1
            counts.by_kind[kind] = counts.by_kind.get(kind, 0) + 1
            pending = self._pending
        try:
            job = capture()
        except BaseException:
            self._settle(kind)
            raise
        pending.submit((kind, job))  # never blocks: fewer than _DEPTH are queued
        return True

    def in_flight(self, kind: Optional[str] = None) -> int:
        """Jobs queued or running (of ``kind``)."""
        with self._lock:
            return self._counts.pending_writes if kind is None else self._counts.by_kind.get(kind, 0)

    def _run(self, item: tuple[str, Callable[[], Any]]) -> None:
        kind, job = item
        try:
            job()
        except BaseException:  # noqa: BLE001 - the thread outlives any one job
            log.exception("%s: a write beside a chunk (%s) failed", self.name, kind)
        finally:
            self._settle(kind)

    def _settle(self, kind: str) -> None:
        """One job of ``kind`` ended (or never started): its place given back."""
        with self._lock:
            self._counts.by_kind[kind] -= 1
            assert self._pending is not None
            self._pending.done()

    def flush(self, bound_s: float = FLUSH_S) -> None:
        """Wait until no job is in flight, at most ``bound_s``; `StoreTimeoutError` past it."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.flush(bound_s)

    def close(self, bound_s: float = FLUSH_S) -> None:
        """Refuse new jobs, wait for those in flight and stop the thread (bounded: a
        `StoreTimeoutError` names what is still running)."""
        with self._lock:
            self._closed = True
            pending = self._pending
        if pending is None:
            return
        pending.flush(bound_s)
        if not pending.stop(bound_s):
            raise StoreTimeoutError(f"{self.name}: the writer beside chunks did not stop within {bound_s} s")
