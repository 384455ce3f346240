"""`split_at_joints`: copies cut where two host registrations meet, so none spans both.

A mapping registered in pieces (`cacheseek.transfer.registrations`) is several registrations side
by side. CUDA treats a host range that crosses from one registration into the next as memory
that is not pinned: a copy over it is refused or staged (slow), although every byte of it is
registered. So every runtime cuts such a copy at each *joint* (an address where one registration
ends and the next begins, `HostIndex.joints`) into consecutive copies before it validates and
submits the batch: ``[p, p + n)`` over a joint ``j`` becomes ``[p, j)`` and ``[j, p + n)``, the
other side offset alike. Only host sides are cut (H2D and H2H sources, D2H and H2H
destinations); device ranges are not registrations.

Cost: nothing when no two registrations touch (no joints: the batch is returned as it is); else
two ``searchsorted`` calls per host side over the batch's arrays, and Python work only for the
copies that cross a joint (a few per batch: a joint every piece, 1 GiB by default).
"""

from __future__ import annotations

from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.registrations import HostIndex

np = LazyModule("numpy")

__all__ = ["split_at_joints"]


def split_at_joints(batch: CopyBatch, hosts: HostIndex) -> CopyBatch:
    """``batch`` with every copy whose host side crosses a joint of ``hosts`` cut there (module
    docstring); the cut copies stay in place, in order. ``batch`` itself when nothing crosses."""
    joints = hosts.joints
    if len(joints) == 0 or len(batch) == 0:
        return batch
    codes, sizes = batch.codes, batch.sizes
    src_host = (codes == Direction.H2D.code) | (codes == Direction.H2H.code)
    dst_host = (codes == Direction.D2H.code) | (codes == Direction.H2H.code)
    crossing = np.zeros(len(batch), dtype=bool)
    for ptrs, on_host in ((batch.srcs, src_host), (batch.dsts, dst_host)):
        inner = np.searchsorted(joints, ptrs + sizes, side="left") - np.searchsorted(joints, ptrs, side="right")
        crossing |= on_host & (inner > 0)
    cut = np.flatnonzero(crossing)
    if len(cut) == 0:
        return batch
    offsets = {}
    for i in cut.tolist():
        size = int(sizes[i])
        at: set[int] = set()
        for ptr, on_host in ((int(batch.srcs[i]), src_host[i]), (int(batch.dsts[i]), dst_host[i])):
            if on_host:
                lo, hi = np.searchsorted(joints, [ptr, ptr + size], side="right")
                at.update(int(j) - ptr for j in joints[lo:hi] if ptr < j < ptr + size)
        offsets[i] = [0, *sorted(at)]
    counts = np.ones(len(batch), dtype=np.int64)
    counts[cut] = [len(offsets[i]) for i in cut.tolist()]
    first = np.cumsum(counts) - counts
    off = np.zeros(int(counts.sum()), dtype=np.int64)
    length = np.repeat(sizes, counts)
    for i, offs in offsets.items():
        lo = int(first[i])
        ends = [*offs[1:], int(sizes[i])]
        off[lo:lo + len(offs)] = offs
        length[lo:lo + len(offs)] = [e - o for o, e in zip(offs, ends)]
    return CopyBatch(np.repeat(batch.dsts, counts) + off, np.repeat(batch.srcs, counts) + off, length,
                     np.repeat(codes, counts))
