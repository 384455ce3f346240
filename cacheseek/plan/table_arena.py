"""`TableArena`: one reused mapping that a Plan client writes its FXPLANV1 plan tables into.

A plan table is tiny ((2 + n) * 8 bytes: 658 B for the 80 values of a 480p LingBot chunk) but
lives from a plan's start to its end, and the reader dereferences it. A client's tables lie in a
small private host mapping of its own (`HostSegment`, pre-faulted, no huge pages), carved 64-byte
aligned by a `FirstFitAllocator`: one table per live plan, written by `write` when the plan needs
it (a put at start, a get at transfer) and freed by `free` when the plan ends. Nothing is
allocated per call, and a reader can check that a table address lies inside the arena
(``bounds``, `PlanClientInfo.table_arena`, `cacheseek.plan.table.decode_plan_table`) before it
reads a word. A table that does not fit is `PlanError` naming the fix (``full_fix``).

Sizing (`table_arena_for`): from the geometry, room for ``LIVE_TABLES`` live plans of
``CHUNKS_PER_PLAN`` chunks' values each (a read of a 32-chunk window is one plan), at least
64 KiB; 1 MiB when the geometry is unknown. Not thread-safe: the client's lock guards it.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Optional

from cacheseek.errors import ConfigError, PlanError, StoreClosedError
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.segment import HostSegment
from cacheseek.plan.table import encode_plan_table, plan_table_nbytes

__all__ = ["TableArena", "TABLE_ALIGN", "table_arena_for", "LIVE_TABLES", "CHUNKS_PER_PLAN"]

TABLE_ALIGN = 64
LIVE_TABLES = 32
CHUNKS_PER_PLAN = 32
_MIN = 64 << 10
_MAX = 64 << 20
_DEFAULT = 1 << 20


def values_per_chunk(value_bytes: Optional[int], chunk_bytes: Optional[int]) -> Optional[int]:
    """Values of one chunk (2 * n_layers for equal K and V), or None when the geometry is unknown."""
    if not value_bytes or not chunk_bytes:
        return None
    return -(-chunk_bytes // value_bytes)


def table_arena_for(value_bytes: Optional[int], chunk_bytes: Optional[int]) -> int:
    """The arena size from the geometry (see the module docstring)."""
    per_chunk = values_per_chunk(value_bytes, chunk_bytes)
    if per_chunk is None:
        return _DEFAULT
    want = LIVE_TABLES * (-(-plan_table_nbytes(CHUNKS_PER_PLAN * per_chunk) // TABLE_ALIGN) * TABLE_ALIGN)
    return -(-min(max(want, _MIN), _MAX) // mmap.PAGESIZE) * mmap.PAGESIZE


class TableArena:
    """``length`` bytes of plan tables at ``ptr``; see the module docstring."""

    def __init__(self, length: int, *, full_fix: str) -> None:
        self._segment: Optional[HostSegment] = HostSegment(length, "private", None, 1, prefault=True,
                                                           hugepages=False)
        self.ptr = self._segment.ptr
        self.length = self._segment.length
        self._alloc = FirstFitAllocator(self.length, TABLE_ALIGN)
        self._full_fix = full_fix

    @staticmethod
    def check_fits(length: int, field: str, value_bytes: Optional[int], chunk_bytes: Optional[int]) -> None:
        """`ConfigError` when ``length`` cannot hold the table of one chunk's values."""
        per_chunk = values_per_chunk(value_bytes, chunk_bytes)
        if per_chunk is not None and plan_table_nbytes(per_chunk) > length:
            raise ConfigError(field, f"{length} bytes cannot hold the plan table of one chunk's {per_chunk} values",
                              f"set it to at least {plan_table_nbytes(per_chunk)}, or auto")

    @property
    def bounds(self) -> Optional[tuple[int, int]]:
        """``(ptr, length)``, or None once closed."""
        return None if self._segment is None else (self.ptr, self.length)

    @property
    def used(self) -> int:
        """Bytes in live tables."""
        return self._alloc.used

    def write(self, pointers: Sequence[int]) -> tuple[int, int]:
        """Write a table of ``pointers``; ``(offset, address)`` of it. Free the offset later.
        `PlanError` when the live tables fill the arena, `StoreClosedError` after `close`."""
        if self._segment is None:
            raise StoreClosedError("plan table arena used after close()")
        off = self._alloc.alloc(plan_table_nbytes(len(pointers)))
        if off is None:
            raise PlanError(f"plan table arena full ({self._alloc.used} of {self._alloc.capacity} B in live "
                            f"tables, {plan_table_nbytes(len(pointers))} B wanted); end plans sooner or "
                            f"{self._full_fix}")
        encode_plan_table(self.ptr + off, pointers)
        return off, self.ptr + off

    def free(self, offset: int) -> None:
        """Free the table at ``offset`` (bookkeeping only: safe after `close`)."""
        self._alloc.free(offset)

    def close(self) -> None:
        """Unmap the arena (idempotent); table addresses are invalid afterwards."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None
