"""`TableArena`: where an in-process Plan client writes its FXPLANV1 plan tables.

A small private host mapping of its own (`HostSegment`, pre-faulted, no huge pages), carved
64-byte aligned by a `FirstFitAllocator`: one table per live plan, written by `write` when the
plan needs it (a put at start, a get at transfer) and freed by `free` when the plan ends. The
arena's ``(ptr, length)`` is what the caller checks table addresses against
(`PlanClientInfo.table_arena`). A table that does not fit is `PlanError` naming the fix
(``full_fix``: the option that sizes the arena). Not thread-safe: the client's lock guards it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheseek.errors import PlanError
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.segment import HostSegment
from cacheseek.plan.table import encode_plan_table, plan_table_nbytes

__all__ = ["TableArena", "TABLE_ALIGN"]

TABLE_ALIGN = 64


class TableArena:
    """``length`` bytes of plan tables at ``ptr``; see the module docstring."""

    def __init__(self, length: int, *, full_fix: str) -> None:
        self._segment = HostSegment(length, "private", None, 1, prefault=True, hugepages=False)
        self.ptr = self._segment.ptr
        self.length = self._segment.length
        self._alloc = FirstFitAllocator(self.length, TABLE_ALIGN)
        self._full_fix = full_fix

    @property
    def used(self) -> int:
        """Bytes in live tables."""
        return self._alloc.used

    def write(self, pointers: Sequence[int]) -> tuple[int, int]:
        """Write a table of ``pointers``; ``(offset, address)`` of it. Free the offset later."""
        off = self._alloc.alloc(plan_table_nbytes(len(pointers)))
        if off is None:
            raise PlanError(f"plan table arena full ({self._alloc.used} of {self._alloc.capacity} B in live "
                            f"tables); end plans sooner or {self._full_fix}")
        encode_plan_table(self.ptr + off, pointers)
        return off, self.ptr + off

    def free(self, offset: int) -> None:
        """Free the table at ``offset`` (bookkeeping only: safe after `close`)."""
        self._alloc.free(offset)

    def close(self) -> None:
        """Unmap the arena (idempotent); table addresses are invalid afterwards."""
        self._segment.close()
