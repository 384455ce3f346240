"""Capacity of the Plan tier: the staging slots and in-flight bytes of overlapped writes
(`StagingSlots`, on the runtime device), and the segment's own room (`SegmentCapacity`: what the
client reports in use, and what the manager's eviction frees).

Slot lifecycle (one per overlapped write)::

    acquire(need, nbytes, like) -> Slot (busy; nbytes reserved against max_inflight_bytes)
        blocks while every slot is busy or the reservation would pass max_inflight_bytes
        (backpressure, counted); StoreTimeoutError past timeout_s; StoreClosedError once closed
    release(slot, nbytes)   the slot free again, the reservation returned; a second release of
                            the same slot changes nothing (failure paths release where they stand)

A free slot too small for a chunk is replaced by a larger one; at most ``n_slots`` exist. The
first write over an empty reservation is always let through, whatever its size. A write's values
are packed into its slot by `staging_layout`; its D2H out of the slot is cut by `split`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import attrs

from cacheseek.errors import PlanError, StoreClosedError, StoreTimeoutError, WriteNotCompleteError
from cacheseek.kv.handles import BlobHandle
from cacheseek.kv.locators import layer_keys, node_key_of
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.plan.base import PlanClient
from cacheseek.stores.plan_tier.segments import ClientCalls
from cacheseek.stores.plan_tier.stats import Counters, store_errors
from cacheseek.transfer.batch import CopyBatch
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import MemoryRange

__all__ = ["ALIGN", "SLOT_ROUND", "SegmentCapacity", "Slot", "StagingSlots", "split", "staging_layout"]

np = LazyModule("numpy")

SLOT_ROUND = 2 << 20  # slot sizes are whole multiples of this
ALIGN = 256  # bytes between snapshot entries in a staging slot


def staging_layout(lengths: Any) -> tuple[Any, Any, int]:
    """``(lengths, offsets, need)`` of values packed into one staging slot: each value at an
    offset aligned to `ALIGN` bytes, in order; ``need`` is the bytes the slot must hold."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths), dtype=np.int64)
    offsets[1:] = np.cumsum(-(-lengths // ALIGN) * ALIGN)[:-1]
    return lengths, offsets, int(offsets[-1] + lengths[-1])


def split(batch: CopyBatch, piece_bytes: int) -> list[CopyBatch]:
    """``batch`` cut into pieces of about ``piece_bytes`` (copies larger than that are cut into
    sub-copies of contiguous bytes); one piece when ``piece_bytes`` is 0."""
    if piece_bytes <= 0 or batch.nbytes <= piece_bytes:
        return [batch]
    sizes = batch.sizes
    parts = -(-sizes // piece_bytes)
    idx = np.repeat(np.arange(len(sizes)), parts)
    starts = np.repeat(np.cumsum(parts) - parts, parts)
    off = (np.arange(len(idx)) - starts) * piece_bytes
    sub = np.minimum(piece_bytes, sizes[idx] - off)
    dsts, srcs, codes = batch.dsts[idx] + off, batch.srcs[idx] + off, batch.codes[idx]
    group = (np.cumsum(sub) - sub) // piece_bytes
    cuts = np.flatnonzero(np.diff(group)) + 1
    return [CopyBatch(d, s_, n, c) for d, s_, n, c in zip(
        np.split(dsts, cuts), np.split(srcs, cuts), np.split(sub, cuts), np.split(codes, cuts))]


@attrs.define(eq=False)
class Slot:
    """A staging buffer on the runtime device (a uint8 tensor) for one in-flight write."""

    tensor: Any
    ptr: int
    nbytes: int
    busy: bool = False

    def range(self) -> MemoryRange:
        return MemoryRange(self.ptr, self.nbytes)


class StagingSlots:
    """``n_slots`` staging slots of at least ``slot_bytes`` (0: sized by the first chunk) and the
    bytes of pending writes, bounded by ``max_inflight`` (0: only the slots bound them).
    ``allocate(nbytes, like)`` makes a slot's uint8 tensor; ``pending_writes()`` is quoted when an
    acquire times out."""

    def __init__(self, n_slots: int, slot_bytes: int, max_inflight: int, *, timeout_s: float,
                 allocate: Callable[[int, Any], Any], counters: Counters, pending_writes: Callable[[], int]) -> None:
        self._n_slots = n_slots
        self._slot_bytes = slot_bytes
        self._max_inflight = max_inflight
        self._timeout_s = timeout_s
        self._allocate = allocate
        self._counters = counters
        self._pending_writes = pending_writes
        self._cv = threading.Condition(threading.Lock())
        self._slots: list[Slot] = []
        self._inflight = 0
        self._peak = 0
        self._closed = False

    def fill(self, like: Any) -> None:
        """Allocate every slot now (warm-up), when ``slot_bytes`` is set."""
        if self._slot_bytes <= 0:
            return
        with self._cv:
            for _ in range(self._n_slots):
                self._slots.append(self._new(self._slot_bytes, like))

    def _new(self, nbytes: int, like: Any) -> Slot:
        size = -(-nbytes // SLOT_ROUND) * SLOT_ROUND
        tensor = self._allocate(size, like)
        return Slot(tensor, int(tensor.data_ptr()), size)

    def _take_locked(self, need: int, like: Any) -> Optional[Slot]:
        free = [s for s in self._slots if not s.busy]
        for s in free:
            if s.nbytes >= need:
                s.busy = True
                return s
        if len(self._slots) < self._n_slots or free:
            if len(self._slots) >= self._n_slots:
                self._slots.remove(free[0])  # too small for this chunk: replaced by a larger one
            slot = self._new(max(need, self._slot_bytes), like)
            slot.busy = True
            self._slots.append(slot)
            return slot
        return None

    def acquire(self, need: int, nbytes: int, like: Any) -> Slot:
        """A free slot of ``need`` bytes, ``nbytes`` reserved; blocks while every slot is busy
        or ``max_inflight`` would be exceeded (backpressure)."""
        waited_from: Optional[float] = None
        deadline = time.monotonic() + self._timeout_s
        with self._cv:
            while True:
                if self._closed:
                    raise StoreClosedError("Plan tier store closed while a write waited for a staging slot")
                bound_ok = (self._max_inflight == 0 or self._inflight == 0
                            or self._inflight + nbytes <= self._max_inflight)
                slot = self._take_locked(need, like) if bound_ok else None
                if slot is not None:
                    break
                if waited_from is None:
                    waited_from = time.perf_counter()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cv.wait(timeout=remaining):
                    if time.monotonic() >= deadline:
                        raise StoreTimeoutError(
                            f"no staging slot free after {self._timeout_s} s "
                            f"({self._pending_writes()} writes pending, {self._inflight} B in flight)"
                        )
            self._inflight += nbytes
            self._peak = max(self._peak, self._inflight)
        if waited_from is not None:
            self._counters.count(backpressure_waits=1, backpressure_seconds=time.perf_counter() - waited_from)
        return slot

    def release(self, slot: Slot, nbytes: int) -> None:
        with self._cv:
            if slot.busy:
                slot.busy = False
                self._inflight -= nbytes
            self._cv.notify_all()

    def close(self) -> None:
        """Wake every waiting acquire with `StoreClosedError`; no slot is handed out after."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def drop(self) -> None:
        """Forget every slot (their memory goes with the last reference)."""
        with self._cv:
            self._slots.clear()

    def snapshot(self) -> tuple[int, int, int]:
        """``(inflight_bytes, peak_inflight_bytes, staging_bytes)`` now."""
        with self._cv:
            return self._inflight, self._peak, sum(s.nbytes for s in self._slots)


class SegmentCapacity:
    """The segment's room: the client's `PlanUsage`, and the removals the manager's eviction and
    invalidation call (`free` of a blob's K/V values, `free_latent` of one latent).
    ``latent_sizes`` is the store's record of the latents it wrote (a freed latent leaves it);
    ``records`` the client's chunk records (a freed blob's record is retracted first)."""

    def __init__(self, client: PlanClient, counters: Counters, latent_sizes: dict[str, int],
                 records: ChunkRecords = NO_RECORDS) -> None:
        self._client = client
        self._records = records
        self._calls = ClientCalls.of(client)
        self._counters = counters
        self._latent_sizes = latent_sizes

    def usage(self) -> Any:
        """The client's `PlanUsage`, or None when it does not report it."""
        fn = self._calls.usage
        return fn() if fn is not None else None

    def free(self, handle: BlobHandle) -> None:
        """Remove every K/V value of the blob (idempotent): its chunk record first (no other
        process finds it from then on), then its values. Refuses a blob whose write is still in
        flight (`WriteNotCompleteError`); raises `PlanError` if any removal fails (after trying
        every one)."""
        if handle.in_flight:
            raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
        if self._records.shared:
            self._records.retract(node_key_of(handle.locator))
        errors: list[tuple[str, BaseException]] = []
        for layer in range(handle.n_layers):
            for key in layer_keys(handle.locator, layer):
                try:
                    self._client.remove(key)
                    self._counters.count(values_removed=1)
                except Exception as exc:
                    errors.append((key, exc))
        if errors:
            key, first = errors[0]
            raise PlanError(
                f"free of {handle.locator}: {len(errors)} removals failed, first {key}: {first}"
            ) from first

    def free_latent(self, locator: str) -> None:
        """Remove a latent (idempotent); raises a `StoreError` if the removal fails."""
        with store_errors(f"remove of latent {locator}"):
            self._client.remove(locator)
        self._counters.count(values_removed=1)
        self._latent_sizes.pop(locator, None)
