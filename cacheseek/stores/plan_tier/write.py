"""The Plan tier's write path: `Writer` puts one chunk's KV, a latent, or another Plan store's
values into the client's reserved values, straight from the runtime's tensors (no CPU staging).

Write of one chunk (`put_async`)::

    keys {locator}:L{i}:k / :v, grouped by byte size (one value size per plan, `PutPlans`)
    start every plan -> decode every table
    overlap off: one D2H batch from the ring views on the write stream after the producer
        event; synchronize; commit every plan; check every status and key code; handle.ready;
        on_ready(handle); then return (in waves, when the client stages fewer values at once)
    overlap on: take a staging slot (blocks while ``staging_slots`` writes or
        ``max_inflight_bytes`` are in flight: backpressure, `StagingSlots`); snapshot the views
        into it with one device-side batch on the producer stream (the ring may be overwritten
        as soon as this returns); return the PENDING handle (with ``write_piece_bytes=0`` the
        whole D2H is submitted here too, after the snapshot). Then, on the completion thread
        (`Completion`, in submission order, started on first use): the D2H from the slot goes
        out in pieces of ``write_piece_bytes``, ``write_pieces_in_flight`` at a time, on the
        write stream after the snapshot's event; every piece waited for; the slot released;
        every plan committed and checked; handle.ready, counted, then on_ready(handle) (its
        failure is logged). ``flush`` and ``stop`` are bounded: a stuck copy gives
        `StoreTimeoutError`, and then nothing may be torn down under it.
    failure before commit: anything submitted is waited for, then every live uncommitted plan
    is aborted; failure at or after commit: wait for the submitted commits, then remove every
    key of them, so nothing of the blob stays in the store. handle.error is set and counted; a
    failure found in put_async raises a `StoreError`, one found by the completion thread is
    logged and reported on the handle (and in stats) only.

Why pieces: a copy the runtime makes in the same direction meanwhile (a frame read back, a
``.tolist()``) shares the copy engine: behind one 3.6 GiB batch it would wait ~70 ms, behind two
pieces of 32 MiB ~1.3 ms. Both batches of an overlapped write are validated whole before the
first copy goes out (docs/design.md section 2), although the D2H goes out later, in pieces.

The put plans of one write (`PutPlans`), grouped by value size; a plan is in exactly one of
``started`` and ``submitted``::

    start(keys, lengths)  one plan per value size (``local_fast_put_start``): -> started;
                          returns where each value goes (decoded from the plan's table)
    commit()              ``local_fast_put_commit`` of every started plan (-> submitted, before
                          the call, so a commit call that raised counts as submitted), then every
                          status and key code of this call's commits checked: `PlanError`
                          naming each failure, `StoreTimeoutError` past ``timeout_s``
    undo(exc)             ``put_abort`` of every started plan; each submitted plan's commit
                          waited for, then each of its keys removed (a submitted commit is never
                          aborted); a failure of these is a note on ``exc``

Copy batches are built with numpy (`staging_layout`, `split`): no step costs Python work per
copy (a 480p chunk is thousands of copies).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

import attrs

from cacheseek.errors import PlanError, StoreTimeoutError, add_note
from cacheseek.kv.handles import BlobHandle, Tier
from cacheseek.kv.locators import layer_keys
from cacheseek.kv.payload import LayerPayload
from cacheseek.plan.base import PlanClient, PutPlan
from cacheseek.plan.table import decode_plan_table
from cacheseek.stores.plan_tier.capacity import Slot, StagingSlots, split, staging_layout
from cacheseek.stores.plan_tier.read import Reader
from cacheseek.stores.plan_tier.segments import Attached, TransferLink, copy_now, direction, nbytes
from cacheseek.stores.plan_tier.stats import Counters, fail_write, land_write, settle, store_errors
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.pending import PendingBatch

__all__ = ["Completion", "PendingWrite", "PutPlans", "Writer", "group_by_size", "plan_waves"]

np = LazyModule("numpy")

def group_by_size(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Item indices by value size, in first-seen order (one Plan per size)."""
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    return groups


def plan_waves(sizes: Sequence[int], max_plan_values: Optional[Callable[[int], int]]) -> list[list[int]]:
    """Item indices in waves of plans whose staging fits the client at once (its optional
    ``max_plan_values(value_len)``); one wave when the client stages no bytes of its own or
    everything fits. Each wave is started, copied and committed before the next starts."""
    everything = [list(range(len(sizes)))]
    if max_plan_values is None:
        return everything
    by_size = group_by_size(sizes)
    fits = {n: int(max_plan_values(n)) for n in by_size}
    for n, cap in fits.items():
        if cap < 1:
            raise PlanError(f"the Plan client cannot stage one value of {n} bytes (raise its staging)")
    if sum(len(idxs) / fits[n] for n, idxs in by_size.items()) <= 1.0:
        return everything
    waves: list[list[int]] = [[]]
    share = 0.0
    for n, idxs in by_size.items():
        for i in idxs:
            if share + 1.0 / fits[n] > 1.0 + 1e-9:
                waves.append([])
                share = 0.0
            waves[-1].append(i)
            share += 1.0 / fits[n]
    return waves


class PutPlans:
    """The plans of one write on ``client`` (lifecycle: the module docstring)."""

    def __init__(self, client: PlanClient, counters: Counters, timeout_s: float) -> None:
        self._client = client
        self._counters = counters
        self._timeout_s = timeout_s
        self.started: list[PutPlan] = []
        self.submitted: list[PutPlan] = []
        self._futures: dict[PutPlan, Future] = {}

    def start(
        self, keys: Sequence[str], lengths: Sequence[int], arena: Optional[tuple[int, int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Returns the value pointers, the item indices and the sizes, in group order."""
        dsts: list[int] = []
        order: list[int] = []
        sizes: list[int] = []
        for value_len, idxs in group_by_size(lengths).items():
            plan, table = self._client.local_fast_put_start([keys[i] for i in idxs], value_len)
            self.started.append(plan)
            self._counters.count(plans_started=1)
            dsts += decode_plan_table(table, len(idxs), arena=arena)
            order += idxs
            sizes += [value_len] * len(idxs)
        return dsts, order, sizes

    def commit(self) -> None:
        now: list[PutPlan] = []
        while self.started:
            plan = self.started.pop(0)
            self.submitted.append(plan)
            now.append(plan)
            self._futures[plan] = self._client.local_fast_put_commit(plan)
        failures = []
        for plan in now:
            try:
                result = self._futures[plan].result(timeout=self._timeout_s)
            except FutureTimeout as exc:
                raise StoreTimeoutError(
                    f"commit of {len(plan.keys)} values not done after {self._timeout_s} s") from exc
            if not result.ok:
                bad = [f"{k}={c}" for k, c in zip(plan.keys, result.key_codes) if c]
                failures.append(f"commit of {len(plan.keys)} values of {plan.value_len} B: status "
                                f"{result.status}{', key codes ' + ', '.join(bad) if bad else ''}"
                                f"{' (' + result.message + ')' if result.message else ''}")
        if failures:
            raise PlanError("; ".join(failures))
        self._counters.count(plans_committed=len(now))

    def undo(self, exc: BaseException) -> None:
        for plan in self.started:
            try:
                self._client.put_abort(plan)
                self._counters.count(plans_aborted=1)
            except Exception as abort_error:
                add_note(exc, f"put_abort failed too: {abort_error!r}")
        for plan in self.submitted:
            future = self._futures.get(plan)
            if future is not None:
                try:
                    future.result(timeout=self._timeout_s)
                except Exception:
                    pass  # its keys are removed below whatever the commit's outcome
            for key in plan.keys:
                try:
                    self._client.remove(key)
                    self._counters.count(values_removed=1)
                except Exception as remove_error:
                    add_note(exc, f"remove({key!r}) after a failed commit failed too: {remove_error!r}")


class Writer:
    """Writes through ``link``: overlapped writes take a slot of ``slots`` and end on
    ``completion``; ``latent_sizes`` records each latent written."""

    def __init__(self, link: TransferLink, slots: StagingSlots, completion: Completion, counters: Counters,
                 latent_sizes: dict[str, int], *, piece_bytes: int, timeout_s: float) -> None:
        self._link = link
        self._client = link.client
        self._calls = link.calls
        self._slots = slots
        self._completion = completion
        self._counters = counters
        self._latent_sizes = latent_sizes
        self._piece_bytes = piece_bytes
        self._timeout_s = timeout_s

    def _plans(self) -> PutPlans:
        return PutPlans(self._client, self._counters, self._timeout_s)

    def put_async(self, locator: str, payload: Sequence[LayerPayload], *, tier: Tier,
                  on_ready: Optional[Callable[[BlobHandle], None]], stream: Any) -> BlobHandle:
        """`PlanTierStore.put_async`."""
        layers = list(payload)
        handle = BlobHandle(tier, locator, 0, len(layers))
        t0 = time.perf_counter()
        try:
            items = []
            for i, (k, v) in enumerate(layers):  # a layer is exactly (K, V)
                key_k, key_v = layer_keys(locator, i)
                items += [(key_k, k), (key_v, v)]
            if not items:
                raise PlanError(f"put of {locator}: empty payload")
            handle.nbytes = sum(nbytes(t) for _, t in items)
            attached = self._link.attached_for(items[0][1])
            if attached.overlap and len(self._waves(items)) == 1:
                self._put_overlapped(attached, handle, items, on_ready, stream, t0)
                self._counters.count(put_submit_seconds=time.perf_counter() - t0)
                return handle
            self._put_values(attached, items, stream=stream)
        except Exception as exc:
            error = fail_write(handle, exc, self._counters)
            if error is exc:
                raise
            raise error from exc
        elapsed = time.perf_counter() - t0
        land_write(handle, self._counters, elapsed, put_submit_seconds=elapsed)
        if on_ready is not None:
            on_ready(handle)
        return handle

    def put_latent(self, locator: str, latent: Any, *, stream: Any) -> None:
        with store_errors(f"put of latent {locator}"):
            self._put_values(self._link.attached_for(latent), [(locator, latent)], stream=stream)
        self._latent_sizes[locator] = nbytes(latent)

    def _waves(self, items: list[tuple[str, Any]]) -> list[list[int]]:
        limit = self._calls.max_plan_values
        if limit is None:  # the hot path: no sizes computed
            return [list(range(len(items)))]
        return plan_waves([nbytes(t) for _, t in items], limit)

    def _put_values(self, attached: Any, items: list[tuple[str, Any]], *, stream: Any) -> None:
        """Synchronous write: D2H straight from the tensors, then commit, wave by wave."""
        transfer, values = attached.transfer, attached.values
        ranges = [transfer.device_range(t) for _, t in items]
        plans = self._plans()
        try:
            for wave in self._waves(items):
                sub = [items[i] for i in wave]
                sub_ranges = [ranges[i] for i in wave]
                dsts, order, sizes = plans.start([k for k, _ in sub], [r.length for r in sub_ranges],
                                                 self._calls.arena())
                batch = CopyBatch.of(dsts, [sub_ranges[i].ptr for i in order], sizes, values.to_values)
                copy_now(transfer, batch, sub_ranges + values.device_ranges, producer=stream,
                         on=attached.write_stream)
                plans.commit()
        except BaseException as exc:
            plans.undo(exc)
            raise

    def _put_overlapped(self, attached: Any, handle: BlobHandle, items: list[tuple[str, Any]],
                        on_ready: Optional[Callable[[BlobHandle], None]], stream: Any, t0: float) -> None:
        """Start the plans, snapshot the views into a staging slot on the producer stream, D2H
        from the slot on the write stream; the completion thread does the rest."""
        transfer, value_ranges = attached.transfer, attached.values.device_ranges
        ranges = [transfer.device_range(t) for _, t in items]
        lengths, offsets, need = staging_layout([r.length for r in ranges])
        plans = self._plans()
        batches: list[PendingBatch] = []
        slot: Optional[Slot] = None
        try:
            dsts, order, sizes = plans.start([k for k, _ in items], [r.length for r in ranges], self._calls.arena())
            slot = self._slots.acquire(need, handle.nbytes, items[0][1])
            snap = CopyBatch.of(slot.ptr + offsets, [r.ptr for r in ranges], lengths, Direction.D2D)
            d2h = CopyBatch.of(dsts, slot.ptr + offsets[order], sizes, attached.values.to_values)
            transfer.validate(snap, device_ranges=ranges + [slot.range()])
            transfer.validate(d2h, device_ranges=[slot.range()] + value_ranges)
            snapshot = transfer.submit_batch(snap, stream=stream, device_ranges=ranges + [slot.range()])
            batches.append(snapshot)
            pieces = split(d2h, self._piece_bytes)
            copy: Optional[PendingBatch] = None
            if len(pieces) == 1:
                copy = transfer.submit_batch(d2h, stream=attached.write_stream,
                                             device_ranges=[slot.range()] + value_ranges, after=[snapshot])
                batches.append(copy)
                pieces = []
            else:  # the write stream is ordered after the snapshot now; pieces follow later
                transfer.stream_wait(attached.write_stream, snapshot)
        except BaseException as exc:
            for pending in batches:
                settle(pending, exc)
            plans.undo(exc)
            if slot is not None:
                self._slots.release(slot, handle.nbytes)
            raise
        self._counters.count(snapshot_bytes=handle.nbytes)
        self._completion.enqueue(PendingWrite(handle, plans, snapshot, copy, pieces, slot, on_ready, t0, handle.nbytes,
                                              attached))

    def copy_from(self, source: Reader, keys: Sequence[str], lengths: Optional[Sequence[int]]) -> Optional[int]:
        """`PlanTierStore.copy_values_from`."""
        attached = self._link.attached
        if attached is None:
            raise PlanError("copy between Plan stores needs a transfer runtime: build the store with "
                            "transfer= or device=")
        keys = list(keys)
        plans = self._plans()
        with store_errors(f"copy of {len(keys)} values between Plan stores"):
            with source.reading(keys, [len(keys)]) as read:
                table, n = read.transfer(lengths)
                if n < len(keys):
                    return None
                srcs = decode_plan_table(table, n, arena=source.calls.arena())
                if lengths is None:
                    lengths = source.lengths(read)
                dsts, order, sizes = plans.start(keys, list(lengths), self._calls.arena())
                batch = CopyBatch.of(dsts, [srcs[i] for i in order], sizes,
                                     direction(source.values.on_device, attached.values.on_device))
                try:
                    copy_now(attached.transfer, batch, attached.values.device_ranges + source.values.device_ranges,
                             producer=None, on=attached.write_stream)
                    plans.commit()
                except BaseException as exc:
                    plans.undo(exc)
                    raise
        for key, length in zip(keys, lengths):
            if key.endswith(":lat"):
                self._latent_sizes[key] = int(length)
        return batch.nbytes


log = logging.getLogger(__package__)

_POLL_S = 0.0005  # poll interval once a copy is due
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
    """The queue of pending writes and the one thread that ends them: ``pieces_in_flight`` pieces
    of a write in flight, the oldest polled every ``poll_s`` once due; ``timeout_s`` bounds
    ``flush`` (per pending write) and ``stop``."""

    def __init__(self, slots: StagingSlots, counters: Counters, *, pieces_in_flight: int, poll_s: float,
                 timeout_s: float) -> None:
        self._slots = slots
        self._counters = counters
        self._pieces_in_flight = pieces_in_flight
        self._poll_s = poll_s
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
        """`PlanTierStore.flush`."""
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
        """The thread, on the transfer runtime's device (`bind_thread`), never device 0 by default."""
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
        """The D2H pieces, ``pieces_in_flight`` at a time, the first after the snapshot."""
        transfer: Any = item.attached.transfer
        ranges = [item.slot.range()] + item.attached.values.device_ranges
        in_flight: collections.deque[PendingBatch] = collections.deque()
        after = [item.snapshot] if item.snapshot is not None else []
        try:
            for piece in item.pieces:
                while len(in_flight) >= self._pieces_in_flight:
                    oldest = in_flight.popleft()
                    oldest.wait(poll_s=self._poll_s, expected_s=0.8 * oldest.nbytes / (_EXPECTED_GIB_S * 2**30))
                in_flight.append(transfer.submit_batch(piece, stream=item.attached.write_stream,
                                                       device_ranges=ranges, after=after))
                after = []
                self._counters.count(write_pieces=1)
            while in_flight:
                in_flight.popleft().wait(poll_s=self._poll_s)
        except BaseException as exc:
            for pending in in_flight:
                settle(pending, exc)
            raise
