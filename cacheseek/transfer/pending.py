"""Work in flight: `Event` (a marker on a stream) and `PendingBatch` (a submitted batch).

Asynchronous batch lifecycle (capability `AsyncTransfer`, offered by `TransferRuntimeBase`)::

    new_stream()                          -> a stream of the runtime's own (CUDA: non-blocking, so
                                             it neither waits for nor blocks the legacy stream)
    record_event(stream)                  -> an `Event` marking everything submitted on it so far
    submit_batch(batch, stream=s, after=[events or pending batches])
        validates like copy_batch (TransferError, nothing submitted), makes ``s`` wait for every
        ``after`` event, submits, records a completion event -> `PendingBatch` (nothing waited)
        a submission failure synchronizes ``s`` before raising, so nothing of it is in flight
    stream_wait(stream, pending_or_event) -> later work on ``stream`` starts after it (no host wait)
    PendingBatch.done() / .wait()         -> query / block until every copy has landed; wait()
                                             records the stats and frees the event; idempotent
    release_event(event), destroy_stream(stream)
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import TransferError, TransferTimeoutError
from cacheseek.transfer.batch import CopyBatch, Direction

__all__ = ["Event", "PendingBatch", "EventSource"]

# Poll schedule of `PendingBatch.wait`: from 20 us doubling to 100 us (or every ``poll_s``) for 50 ms
# after the expected time (a restore lands in 1-10 ms: a coarser poll would add up to a millisecond
# to it), then doubling to 1 ms (long waits: writes, flushes).
_FIRST_POLL_S = 2e-5
_FINE_POLL_S = 1e-4
_FINE_PHASE_S = 0.05
_COARSE_POLL_S = 1e-3


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_FINE_SLACK_NS = 1000
_prctl: Any = None


@contextlib.contextmanager
def fine_sleeps() -> Iterator[None]:
    """The calling thread's sleeps end within a microsecond of their time for the block (Linux:
    the thread's timer slack, 50 us by default, is set to 1 us and restored after; elsewhere
    nothing changes). A poll every 20 us would otherwise wake every 70 us."""
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _prctl = False
    if not _prctl:
        yield
        return
    before = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if before <= _FINE_SLACK_NS or _prctl(_PR_SET_TIMERSLACK, _FINE_SLACK_NS, 0, 0, 0) != 0:
        yield
        return
    try:
        yield
    finally:
        _prctl(_PR_SET_TIMERSLACK, before, 0, 0, 0)


@attrs.define(eq=False)
class Event:
    """A runtime's marker on a stream (see the module docstring); made by `record_event` or by
    `submit_batch`. ``handle`` is the runtime's own (a CUDA event, or None when the host runtime
    has nothing to wait for)."""

    handle: Any
    stream: Any
    released: bool = False


class EventSource(Protocol):
    """What a `PendingBatch` asks of the runtime that submitted it (`TransferRuntimeBase`)."""

    wait_timeout_s: float

    def _event_query(self, event: Event) -> bool: ...

    def _event_synchronize(self, event: Event) -> None: ...

    def release_event(self, event: Event) -> None: ...

    def _record_dirs(self, per_dir: dict[Direction, tuple[int, int]], seconds: float) -> None: ...


class PendingBatch:
    """A submitted batch: ``done()`` asks, ``wait()`` blocks until every copy has landed (then
    records the runtime's stats and frees the event). ``wait`` is idempotent and thread-safe; a
    failed wait raises `TransferError` every time it is called. Every wait is bounded (``timeout_s``,
    default the runtime's ``wait_timeout_s``): past it, `TransferTimeoutError`, and the batch stays
    pending (its buffers are still in use: the caller must not free them; a later wait may
    succeed)."""

    def __init__(self, runtime: EventSource, batch: CopyBatch, stream: Any, event: Event, t0: float) -> None:
        self._runtime = runtime
        self._per_dir = batch.by_direction()
        self.nbytes = batch.nbytes
        self.copies = len(batch)
        self.stream = stream
        self.event = event
        self.submitted_at = t0
        self.completed_at: Optional[float] = None
        self._error: Optional[TransferError] = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            if self.completed_at is not None or self._error is not None:
                return True
            return self._runtime._event_query(self.event)

    def wait(self, *, poll_s: Optional[float] = None, expected_s: float = 0.0,
             timeout_s: Optional[float] = None) -> None:
        """Block until the batch has landed, at most ``timeout_s`` seconds (default the runtime's
        ``wait_timeout_s``). ``expected_s``: sleep that long first; then query every ``poll_s``
        (default: from 20 us, doubling up to 100 us) for 50 ms, and after that at intervals
        doubling up to 1 ms (a wait that outlives its estimate, e.g. behind other work on the
        stream, stops spinning). Polling keeps the interpreter free for other threads whatever the
        bindings do with the GIL, and bounds the wait (a blocking synchronize could not be)."""
        bound = self._runtime.wait_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._error is not None:
                raise self._error
            if self.completed_at is not None:
                return
            try:
                with fine_sleeps():
                    self._poll(bound, poll_s, expected_s)
                self._runtime._event_synchronize(self.event)
            except TransferTimeoutError:
                raise
            except TransferError as exc:
                self._error = exc
                self._runtime.release_event(self.event)
                raise
            self.completed_at = time.perf_counter()
            self._runtime.release_event(self.event)
            self._runtime._record_dirs(self._per_dir, self.completed_at - self.submitted_at)

    def _poll(self, bound: float, poll_s: Optional[float], expected_s: float) -> None:
        """Sleep ``expected_s``, then query the event on the schedule of `wait` until it has
        completed; `TransferTimeoutError` past ``bound`` seconds."""
        deadline = time.monotonic() + bound
        if expected_s > 0:
            time.sleep(min(expected_s, bound))
        fine_until = time.monotonic() + _FINE_PHASE_S
        interval = poll_s if poll_s is not None else _FIRST_POLL_S
        fine_cap = poll_s if poll_s is not None else _FINE_POLL_S
        while not self._runtime._event_query(self.event):
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeoutError(
                    f"a batch of {self.copies} copies ({self.nbytes} bytes) has not landed after "
                    f"{bound} s; its buffers are still in use (raise the transfer runtime's "
                    "wait_timeout_s if the device is that slow)")
            time.sleep(interval)
            cap = fine_cap if now < fine_until else max(_COARSE_POLL_S, fine_cap)
            interval = min(interval * 2, cap)

    @property
    def seconds(self) -> Optional[float]:
        return None if self.completed_at is None else self.completed_at - self.submitted_at
