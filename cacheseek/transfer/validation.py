"""`validate_batch`: the whole-batch check every runtime runs before it submits anything.

A batch passes when every copy has a positive size and addresses, each side lies inside memory
of the kind its `Direction` names (a registered host mapping, writable for a destination, or a
declared device range, else memory the runtime recognises as device memory), and no two
destinations overlap. Otherwise `TransferError` names the first bad copy, and nothing of the
batch was submitted.

The check is vectorized (numpy, one pass per side); only the copies that fail the fast check are
looked at one by one (a device range may also be undeclared device memory; overlapping host
mappings may hold a copy that the nearest one does not), so a valid batch costs no Python work
per copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.errors import TransferError
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import DeviceRanges, MemoryRange
from cacheseek.transfer.registrations import HostIndex

np = LazyModule("numpy")

__all__ = ["validate_batch"]


def validate_batch(batch: CopyBatch, hosts: HostIndex, device_ranges: "Sequence[MemoryRange] | DeviceRanges",
                   is_device_memory: Callable[[int, int], bool]) -> None:
    """Raise `TransferError` for the first copy of ``batch`` that is not allowed (module
    docstring). ``hosts``: the registered mappings; ``device_ranges``: those the caller declared (a `DeviceRanges` is used as it is);
    ``is_device_memory(ptr, nbytes)``: asked only for a device side outside every declared range."""
    n = len(batch)
    if n == 0:
        return
    dsts, srcs, sizes, codes = batch.dsts, batch.srcs, batch.sizes, batch.codes
    bad = np.flatnonzero((sizes <= 0) | (dsts <= 0) | (srcs <= 0))
    if len(bad):
        i = int(bad[0])
        raise TransferError(
            f"descriptor {i}: dst {int(dsts[i]):#x}, src {int(srcs[i]):#x}, {int(sizes[i])} B: "
            "addresses and size must be positive; nothing of the batch was submitted"
        )
    host_index = hosts.entries
    declared = DeviceRanges.of(device_ranges)
    d_starts, d_ends = declared.starts, declared.ends
    src_dev = (codes == Direction.D2H.code) | (codes == Direction.D2D.code)
    dst_dev = (codes == Direction.H2D.code) | (codes == Direction.D2D.code)
    for side, ptrs, on_dev, write in (("src", srcs, src_dev, False), ("dst", dsts, dst_dev, True)):
        ok = np.empty(n, dtype=bool)
        ok[on_dev] = _inside(d_starts, d_ends, ptrs[on_dev], sizes[on_dev])[0]
        host = ~on_dev
        inside, idx = _inside(hosts.starts, hosts.ends, ptrs[host], sizes[host])
        if write and len(idx):
            inside &= hosts.writable[np.clip(idx, 0, None)] if len(hosts.writable) else False
        ok[host] = inside
        for i in np.flatnonzero(~ok):
            i = int(i)
            ptr, nbytes = int(ptrs[i]), int(sizes[i])
            if on_dev[i]:
                devs = [(r.ptr, r) for r in declared.ranges]
                good = _find(devs, [p for p, _ in devs], ptr, nbytes) is not None or is_device_memory(ptr, nbytes)
                where = "a declared device range"
            else:
                reg = _find(host_index, [p for p, _ in host_index], ptr, nbytes, key=lambda r: r.mapping.range)
                good = reg is not None and (not write or reg.mapping.writable)
                where = ("a writable " if write else "a ") + "registered host mapping"
            if not good:
                raise TransferError(
                    f"descriptor {i} ({batch.direction(i).value}): {side} [{ptr:#x}, +{nbytes}) is "
                    f"not inside {where}; nothing of the batch was submitted"
                )
    if n > 1:
        order = np.argsort(dsts, kind="stable")
        starts, ends = dsts[order], dsts[order] + sizes[order]
        clash = np.flatnonzero(starts[1:] < ends[:-1])
        if len(clash):
            raise TransferError(
                f"descriptors overlap at destination {int(starts[int(clash[0]) + 1]):#x}; "
                "nothing of the batch was submitted"
            )


def _inside(starts: np.ndarray, ends: np.ndarray, ptrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per copy: does ``[ptr, ptr + size)`` lie in the range that starts last at or before ptr?
    (ranges sorted by start). Returns ``(inside, index of that range or -1)``."""
    if len(ptrs) == 0:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    if len(starts) == 0:
        return np.zeros(len(ptrs), dtype=bool), np.full(len(ptrs), -1, dtype=np.int64)
    idx = np.searchsorted(starts, ptrs, side="right") - 1
    inside = (idx >= 0) & (ptrs + sizes <= ends[np.clip(idx, 0, None)])
    return inside, idx


def _find(index: list, starts: list[int], ptr: int, nbytes: int, key: Optional[Callable[[Any], MemoryRange]] = None) -> Any:
    """The entry of a ptr-sorted index whose range holds ``[ptr, ptr + nbytes)``, or None."""
    i = bisect.bisect_right(starts, ptr) - 1
    while i >= 0:
        entry = index[i][1]
        rng = key(entry) if key is not None else entry
        if rng.contains(ptr, nbytes):
            return entry
        i -= 1
    return None
