"""The first-fit block allocator both in-process Plan clients use for values and plan tables."""

from __future__ import annotations

import bisect
from typing import Optional

from cacheseek.errors import PlanError

__all__ = ["FirstFitAllocator"]


class FirstFitAllocator:
    """First-fit allocator over ``[0, capacity)`` in ``alignment``-byte blocks; frees coalesce.

    Offsets only: the caller owns the memory. Freeing an offset that is not allocated raises.
    Not thread-safe; the Plan clients call it under their own lock."""

    def __init__(self, capacity: int, alignment: int) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self._free: list[list[int]] = [[0, capacity]]  # [offset, size], sorted by offset
        self._live: dict[int, int] = {}
        self.used = 0

    def block(self, nbytes: int) -> int:
        return -(-max(nbytes, 1) // self.alignment) * self.alignment

    def alloc(self, nbytes: int) -> Optional[int]:
        size = self.block(nbytes)
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = [off + size, free - size]
                self._live[off] = size
                self.used += size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._live.pop(offset, None)
        if size is None:
            raise PlanError(f"allocator: free of offset {offset} that is not allocated")
        self.used -= size
        i = bisect.bisect_left(self._free, [offset, 0])
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1][1] += size
        else:
            self._free.insert(i, [offset, size])
