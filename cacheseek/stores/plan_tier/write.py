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
        as soon as this returns); return the PENDING handle; the completion thread ends the
        write (`Completion`). With ``write_piece_bytes=0`` the whole D2H is submitted here as
        one batch after the snapshot.
    failure before commit: anything submitted is waited for, then every live uncommitted plan
    is aborted; failure at or after commit: wait for the submitted commits, then remove every
    key of them, so nothing of the blob stays in the store. handle.error is set and counted; a
    failure found here raises a `StoreError`, one found by the completion thread is reported on
    the handle (and in stats) only.

Both batches of an overlapped write are validated whole before the first copy goes out
(docs/design.md section 2), although the D2H goes out later, in pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.errors import PlanError
from cacheseek.kv.handles import BlobHandle, Tier
from cacheseek.kv.locators import layer_keys
from cacheseek.kv.payload import LayerPayload
from cacheseek.plan.table import decode_plan_table
from cacheseek.stores.plan_tier.batches import copy_now, direction, nbytes, split, staging_layout
from cacheseek.stores.plan_tier.capacity import Slot, StagingSlots
from cacheseek.stores.plan_tier.completion import Completion, PendingWrite
from cacheseek.stores.plan_tier.failures import as_store_error, settle
from cacheseek.stores.plan_tier.segment_registration import TransferLink
from cacheseek.stores.plan_tier.plans import PutPlans, plan_waves
from cacheseek.stores.plan_tier.read import Reader
from cacheseek.stores.plan_tier.stats import Counters
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.pending import PendingBatch

__all__ = ["Writer"]


class Writer:
    """Writes through ``link`` (see the module docstring): overlapped writes take a slot of
    ``slots`` and end on ``completion``; ``latent_sizes`` records each latent written."""

    def __init__(
        self,
        link: TransferLink,
        slots: StagingSlots,
        completion: Completion,
        counters: Counters,
        latent_sizes: dict[str, int],
        *,
        piece_bytes: int,
        timeout_s: float,
    ) -> None:
        self._link = link
        self._client = link.client
        self._slots = slots
        self._completion = completion
        self._counters = counters
        self._latent_sizes = latent_sizes
        self._piece_bytes = piece_bytes
        self._timeout_s = timeout_s

    def _plans(self) -> PutPlans:
        return PutPlans(self._client, self._counters, self._timeout_s)

    def put_async(
        self,
        locator: str,
        payload: Sequence[LayerPayload],
        *,
        tier: Tier,
        on_ready: Optional[Callable[[BlobHandle], None]],
        stream: Any,
    ) -> BlobHandle:
        """One chunk's KV (per layer ``(k, v)``) under ``{locator}:L{i}:k/v``; the handle ready,
        or PENDING with overlap. Raises a `StoreError` (handle.error set) for a failure found
        before it returns."""
        layers = list(payload)
        handle = BlobHandle(tier, locator, 0, len(layers))
        t0 = time.perf_counter()
        try:
            items = []
            for i, (k, v) in enumerate(layers):
                k_key, v_key = layer_keys(locator, i)
                items += [(k_key, k), (v_key, v)]
            if not items:
                raise PlanError(f"put of {locator}: empty payload")
            handle.nbytes = sum(nbytes(t) for _, t in items)
            self._link.transfer_for(items[0][1])
            if self._link.overlap and len(self._waves(items)) == 1:
                self._put_overlapped(handle, items, on_ready, stream, t0)
                self._counters.count(put_submit_seconds=time.perf_counter() - t0)
                return handle
            self._put_values(items, stream=stream)
        except Exception as exc:
            self._counters.count(put_failures=1)
            handle.fail(as_store_error(exc, f"put of {locator}"))
            if handle.error is exc:
                raise
            raise handle.error from exc
        elapsed = time.perf_counter() - t0
        self._counters.count(puts=1, put_bytes=handle.nbytes, put_seconds=elapsed, put_submit_seconds=elapsed)
        handle.publish()
        if on_ready is not None:
            on_ready(handle)
        return handle

    def put_latent(self, locator: str, latent: Any, *, stream: Any) -> None:
        """One latent as the value ``locator``, synchronously. Raises a `StoreError`."""
        try:
            self._put_values([(locator, latent)], stream=stream)
        except Exception as exc:
            error = as_store_error(exc, f"put of latent {locator}")
            if error is exc:
                raise
            raise error from exc
        self._latent_sizes[locator] = nbytes(latent)

    def _waves(self, items: list[tuple[str, Any]]) -> list[list[int]]:
        limit = self._link.calls.max_plan_values
        if limit is None:
            return [list(range(len(items)))]
        return plan_waves([nbytes(t) for _, t in items], limit)

    def _put_values(self, items: list[tuple[str, Any]], *, stream: Any) -> None:
        """Synchronous write: D2H straight from the tensors, then commit, wave by wave."""
        transfer = self._link.transfer_for(items[0][1])
        ranges = [transfer.device_range(t) for _, t in items]
        plans = self._plans()
        try:
            for wave in self._waves(items):
                sub = [items[i] for i in wave]
                sub_ranges = [ranges[i] for i in wave]
                dsts, order, sizes = plans.start([k for k, _ in sub], [r.length for r in sub_ranges],
                                                 self._link.calls.arena())
                batch = CopyBatch.of(dsts, [sub_ranges[i].ptr for i in order], sizes, self._link.to_values)
                copy_now(transfer, batch, sub_ranges + self._link.value_ranges, producer=stream,
                         on=self._link.write_stream)
                plans.commit()
        except BaseException as exc:
            plans.undo(exc)
            raise

    def _put_overlapped(
        self,
        handle: BlobHandle,
        items: list[tuple[str, Any]],
        on_ready: Optional[Callable[[BlobHandle], None]],
        stream: Any,
        t0: float,
    ) -> None:
        """Start the plans, snapshot the views into a staging slot on the producer stream, D2H
        from the slot on the write stream; the completion thread does the rest."""
        transfer: Any = self._link.transfer
        value_ranges = self._link.value_ranges
        ranges = [transfer.device_range(t) for _, t in items]
        lengths, offsets, need = staging_layout([r.length for r in ranges])
        plans = self._plans()
        batches: list[PendingBatch] = []
        slot: Optional[Slot] = None
        try:
            dsts, order, sizes = plans.start([k for k, _ in items], [r.length for r in ranges], self._link.calls.arena())
            slot = self._slots.acquire(need, handle.nbytes, items[0][1])
            snap = CopyBatch.of(slot.ptr + offsets, [r.ptr for r in ranges], lengths, Direction.D2D)
            d2h = CopyBatch.of(dsts, slot.ptr + offsets[order], sizes, self._link.to_values)
            transfer.validate(snap, device_ranges=ranges + [slot.range()])
            transfer.validate(d2h, device_ranges=[slot.range()] + value_ranges)
            snapshot = transfer.submit_batch(snap, stream=stream, device_ranges=ranges + [slot.range()])
            batches.append(snapshot)
            pieces = split(d2h, self._piece_bytes)
            copy: Optional[PendingBatch] = None
            if len(pieces) == 1:
                copy = transfer.submit_batch(
                    d2h, stream=self._link.write_stream, device_ranges=[slot.range()] + value_ranges,
                    after=[snapshot]
                )
                batches.append(copy)
                pieces = []
            else:  # the write stream is ordered after the snapshot now; pieces follow later
                transfer.stream_wait(self._link.write_stream, snapshot)
        except BaseException as exc:
            for pending in batches:
                settle(pending, exc)
            plans.undo(exc)
            if slot is not None:
                self._slots.release(slot, handle.nbytes)
            raise
        self._counters.count(snapshot_bytes=handle.nbytes)
        self._completion.enqueue(PendingWrite(handle, plans, snapshot, copy, pieces, slot, on_ready, t0, handle.nbytes))

    def copy_from(self, source: Reader, keys: Sequence[str], lengths: Optional[Sequence[int]]) -> Optional[int]:
        """Copy the published values ``keys`` that ``source`` reads into this store's values
        under the same keys: one get plan on the source, one batch straight from its values into
        the reserved ones, one synchronize, then commit: publication last (how tiers promote and
        demote without a staging copy). All or nothing: None, with nothing written, when a key is
        missing; a `StoreError` (nothing written) on any failure. Returns the bytes copied."""
        transfer: Any = self._link.transfer
        if transfer is None:
            raise PlanError("copy between Plan stores needs a transfer runtime: build the store with "
                            "transfer= or device=")
        keys = list(keys)
        plans = self._plans()
        try:
            with source.reading(keys, [len(keys)]) as read:
                table, n = read.transfer(lengths)
                if n < len(keys):
                    return None
                srcs = decode_plan_table(table, n, arena=source.link.calls.arena())
                if lengths is None:
                    lengths = source.lengths(read)
                dsts, order, sizes = plans.start(keys, list(lengths), self._link.calls.arena())
                batch = CopyBatch.of(dsts, [srcs[i] for i in order], sizes,
                                     direction(source.link.values_on_device, self._link.values_on_device))
                try:
                    copy_now(transfer, batch, self._link.value_ranges + source.link.value_ranges,
                             producer=None, on=self._link.write_stream)
                    plans.commit()
                except BaseException as exc:
                    plans.undo(exc)
                    raise
        except Exception as exc:
            error = as_store_error(exc, f"copy of {len(keys)} values between Plan stores")
            if error is exc:
                raise
            raise error from exc
        for key, length in zip(keys, lengths):
            if key.endswith(":lat"):
                self._latent_sizes[key] = int(length)
        return batch.nbytes
