"""`FakeRangeKernel`: the range-copy kernel (`cacheseek.transfer.copy_kernel`) over a `FakeCudart`'s
stream queues, so CPU tests check the packing and the runtime's use of it with a GPU's ordering."""

from __future__ import annotations

from typing import Any

from cacheseek.errors import TransferError
from cacheseek.transfer.copy_kernel import RangeTable

__all__ = ["FakeRangeKernel"]


class FakeRangeKernel:
    """The kernel over a `FakeCudart`: every tile of a table becomes a queued copy on the stream
    (checked like a copy: both sides must be memory the fake knows), performed when the stream is
    waited for. ``host_readable`` as the real device reports it (tests set it)."""

    def __init__(self, cudart: Any, *, host_readable: bool = True) -> None:
        self._rt = cudart
        self.host_readable = host_readable
        self.launches: list[tuple[int, int, int]] = []  # (stream, ranges, tiles)

    def launch(self, table: RangeTable, stream: int) -> None:
        tiles = list(table.ranges())
        for _, dst, src, nbytes in tiles:
            if not self._rt.memory.check_copy(dst, src, nbytes, None):
                raise TransferError(f"fake range-copy kernel: tile [{src:#x}, +{nbytes}) -> {dst:#x} is not memory the device can reach")
        with self._rt.mutex:
            self._rt.streams.enqueue(stream, [(dst, src, nbytes) for _, dst, src, nbytes in tiles])
        self.launches.append((stream, table.n, table.tiles))
