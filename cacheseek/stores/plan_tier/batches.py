"""Copy batches of the Plan tier, built with numpy: the staging layout of a snapshot, the pieces
of an overlapped device-to-host copy, the direction between two kinds of memory, one batch
copied and waited for.

Every batch is a `CopyBatch` of int64 arrays (one entry per copy), so no step here costs Python
work per copy: a 480p chunk is thousands of copies.
"""

from __future__ import annotations

from typing import Any, Optional

from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import MemoryRange

__all__ = ["ALIGN", "copy_now", "direction", "nbytes", "split", "staging_layout"]

np = LazyModule("numpy")

ALIGN = 256  # bytes between snapshot entries in a staging slot


def nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


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


def direction(src_on_device: bool, dst_on_device: bool) -> Direction:
    return {(False, True): Direction.H2D, (True, False): Direction.D2H,
            (True, True): Direction.D2D, (False, False): Direction.H2H}[(src_on_device, dst_on_device)]


def copy_now(transfer: Any, batch: CopyBatch, ranges: list[MemoryRange], *, producer: Any, on: Optional[Any]) -> None:
    """One batch on stream ``on`` after the ``producer`` stream's work, waited for (on a runtime
    without streams, ``on`` is None: synchronous on the producer stream)."""
    if on is None:
        transfer.copy_batch(batch.descriptors(), stream=producer, device_ranges=ranges)
        return
    event = transfer.record_event(producer)
    try:
        transfer.copy_batch(batch, stream=on, device_ranges=ranges, after=[event])
    finally:
        transfer.release_event(event)
