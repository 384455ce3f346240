"""The completion thread of overlapped writes: `Completion` takes each `PendingWrite` that
``put_async`` submitted and finishes it, in submission order (one write stream).

Lifecycle of a pending write (its handle is PENDING from ``enqueue`` until one of the two ends)::

    enqueue(PendingWrite)    the snapshot into the staging slot is submitted (and, without
                             pieces, the whole D2H after it); the thread starts on first use
    on the thread            the D2H from the slot to the Plan values goes out in pieces of
                             ``write_piece_bytes``, ``write_pieces_in_flight`` at a time, on the
                             write stream after the snapshot's event (so the runtime's own
                             device-to-host copies, which share the copy engine, never queue
                             behind a whole chunk); every piece waited for; the slot released;
                             every plan committed and checked
        success              handle.ready, counted, then on_ready(handle) (its failure is logged)
        failure              every plan undone (nothing of the blob stays), handle.error set,
                             counted and logged; nothing is raised
    flush(timeout_s)         returns once every enqueued write ended (bounded)

Why pieces: a copy the runtime makes in the same direction meanwhile (a frame read back, a
``.tolist()``) shares the copy engine: behind one 3.6 GiB batch it would wait ~70 ms, behind two
pieces of 32 MiB ~1.3 ms.
    stop(join_timeout_s)     the thread ends when the queue is empty; StoreTimeoutError if it
                             does not (a stuck copy), and then nothing may be torn down under it
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import attrs

from cacheseek.errors import StoreTimeoutError
from cacheseek.kv.handles import BlobHandle
from cacheseek.stores.plan_tier.capacity import Slot, StagingSlots
from cacheseek.stores.plan_tier.segments import Attached
from cacheseek.stores.plan_tier.stats import Counters, fail_write, land_write, settle
from cacheseek.transfer.pending import PendingBatch

if TYPE_CHECKING:
    from cacheseek.stores.plan_tier.write import PutPlans

__all__ = ["Completion", "PendingWrite"]

log = logging.getLogger(__package__)

_POLL_S = 0.0005  # poll interval once a copy is due
_PIECE_POLL_S = 0.0002
_EXPECTED_GIB_S = 60.0  # first sleep of the thread: bytes at this rate, then poll


@attrs.define(eq=False)
class PendingWrite:
    """One overlapped write between ``put_async`` and its end on the completion thread."""

    handle: BlobHandle
    plans: "PutPlans"  # started, not committed
    snapshot: Optional[PendingBatch]
    copy: Optional[PendingBatch]  # the whole D2H, submitted by put_async (write_piece_bytes=0)
    pieces: list  # else the D2H in pieces, submitted by the completion thread
    slot: Slot
    on_ready: Optional[Callable[[BlobHandle], None]]
    t0: float
    nbytes: int
    attached: Attached  # the runtime, the write stream and the values it copies with


class Completion:
    """The queue of pending writes and the one thread that ends them (see the module docstring).
    ``timeout_s`` bounds ``flush`` (per pending write) and ``stop``."""

    def __init__(
        self, slots: StagingSlots, counters: Counters, *, pieces_in_flight: int, timeout_s: float,
    ) -> None:
        self._slots = slots
        self._counters = counters
        self._pieces_in_flight = pieces_in_flight
        self._timeout_s = timeout_s
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[PendingWrite] = collections.deque()
        self._stopping = False
        self.thread: Optional[threading.Thread] = None

    @property
    def pending(self) -> int:
        """Writes enqueued and not yet ended."""
        return len(self._queue)

    def enqueue(self, item: PendingWrite) -> None:
        with self._cv:
            self._queue.append(item)
            if self.thread is None:
                self.thread = threading.Thread(target=self._drain, name="plan-tier-commit", daemon=True)
                self.thread.start()
            self._cv.notify_all()

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every pending write has committed or failed; at most ``timeout_s``
        (default: ``timeout_s`` per pending write, at least 4 of them), then `StoreTimeoutError`
        naming how many are pending (they go on)."""
        with self._cv:
            bound = timeout_s if timeout_s is not None else self._timeout_s * max(4, len(self._queue) + 1)
            deadline = time.monotonic() + bound
            while self._queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(
                        f"Plan tier: {len(self._queue)} writes still pending after {bound:.1f} s "
                        "(a stuck copy or commit?)")
                self._cv.wait(timeout=min(remaining, 1.0))

    def stop(self) -> None:
        """End the thread (it drains the queue first); `StoreTimeoutError` if it is still alive
        after ``timeout_s``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=self._timeout_s)
            if self.thread.is_alive():
                raise StoreTimeoutError(
                    f"Plan tier: the completion thread did not stop within {self._timeout_s} s; "
                    "streams, registrations and the client are left as they are")

    def _drain(self) -> None:
        """The thread: runs on the transfer runtime's device (`bind_thread`), never on device 0
        by default."""
        bound = False
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue[0]
            if not bound:  # the runtime is the same for every write: bound once, before the first
                bind, bound = getattr(item.attached.transfer, "bind_thread", None), True
                if callable(bind):
                    bind()
            try:
                self._complete(item)
            except BaseException:  # noqa: BLE001 - the thread must outlive any one write
                log.exception("Plan tier: completing the write of %s failed", item.handle.locator)
            finally:
                with self._cv:
                    self._queue.popleft()
                    self._cv.notify_all()

    def _complete(self, item: PendingWrite) -> None:
        handle, plans = item.handle, item.plans
        try:
            try:
                if item.copy is not None:
                    item.copy.wait(poll_s=_POLL_S, expected_s=0.9 * item.nbytes / (_EXPECTED_GIB_S * 2**30))
                else:
                    self._trickle(item)
            finally:
                if item.snapshot is not None:
                    settle(item.snapshot)
                self._slots.release(item.slot, item.nbytes)
            plans.commit()
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            plans.undo(exc)
            fail_write(handle, exc, self._counters)
            log.warning("Plan tier: write of %s failed after submission: %s", handle.locator, handle.error)
            return
        land_write(handle, self._counters, time.perf_counter() - item.t0)
        if item.on_ready is not None:
            try:
                item.on_ready(handle)
            except Exception:  # noqa: BLE001 - the write is done; the callback's failure is logged
                log.exception("Plan tier: on_ready of %s raised", handle.locator)

    def _trickle(self, item: PendingWrite) -> None:
        """Submit the D2H pieces on the write stream, at most ``pieces_in_flight`` at a time (the
        first after the snapshot's event); return when every piece has landed."""
        transfer: Any = item.attached.transfer
        ranges = [item.slot.range()] + item.attached.values.device_ranges
        in_flight: collections.deque[PendingBatch] = collections.deque()
        after = [item.snapshot] if item.snapshot is not None else []
        try:
            for piece in item.pieces:
                while len(in_flight) >= self._pieces_in_flight:
                    oldest = in_flight.popleft()
                    oldest.wait(poll_s=_PIECE_POLL_S, expected_s=0.8 * oldest.nbytes / (_EXPECTED_GIB_S * 2**30))
                in_flight.append(transfer.submit_batch(
                    piece, stream=item.attached.write_stream, device_ranges=ranges, after=after
                ))
                after = []
                self._counters.count(write_pieces=1)
            while in_flight:
                in_flight.popleft().wait(poll_s=_PIECE_POLL_S)
        except BaseException as exc:
            for pending in in_flight:
                settle(pending, exc)
            raise
