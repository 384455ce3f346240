"""`TableArena`: one reused mapping that a Plan client writes its FXPLANV1 tables into.

A plan table is tiny ((2 + n) * 8 bytes: 658 B for the 80 values of a 480p LingBot chunk) but
lives from a plan's start to its end, and the reader dereferences it. Tables of one client lie in
one private anonymous mapping, carved by a `FirstFitAllocator` and reused across plans (nothing is
allocated per call), so a reader can check that a table address lies inside the client's arena
(`PlanClientInfo.table_arena`, `cacheseek.plan.table.decode_plan_table`) before it reads a word.

Sizing (`table_arena_for`): from the geometry, room for ``LIVE_TABLES`` live plans of
``CHUNKS_PER_PLAN`` chunks' values each (a read of a 32-chunk window is one plan), at least
64 KiB; 1 MiB when the geometry is unknown. Not thread-safe: the client calls it under its lock.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from typing import Optional

from cacheseek.errors import ConfigError, PlanError, StoreClosedError
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.table import encode_plan_table, plan_table_nbytes

__all__ = ["TableArena", "table_arena_for", "LIVE_TABLES", "CHUNKS_PER_PLAN"]

LIVE_TABLES = 32
CHUNKS_PER_PLAN = 32
_MIN = 64 << 10
_MAX = 64 << 20
_DEFAULT = 1 << 20
_ALIGN = 64


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
    want = LIVE_TABLES * (-(-plan_table_nbytes(CHUNKS_PER_PLAN * per_chunk) // _ALIGN) * _ALIGN)
    return -(-min(max(want, _MIN), _MAX) // mmap.PAGESIZE) * mmap.PAGESIZE


class TableArena:
    """``length`` bytes of private anonymous memory holding plan tables. ``field`` names the config
    field that sizes it (in the error when it is full)."""

    def __init__(self, length: int, field: str) -> None:
        self.length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        self.field = field
        self._mm: Optional[mmap.mmap] = mmap.mmap(-1, self.length, flags=mmap.MAP_PRIVATE)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.ptr = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open
        self._alloc = FirstFitAllocator(self.length, _ALIGN)

    @classmethod
    def check_fits(cls, length: int, field: str, value_bytes: Optional[int], chunk_bytes: Optional[int]) -> None:
        """`ConfigError` when ``length`` cannot hold the table of one chunk's values."""
        per_chunk = values_per_chunk(value_bytes, chunk_bytes)
        if per_chunk is not None and plan_table_nbytes(per_chunk) > length:
            raise ConfigError(field, f"{length} bytes cannot hold the plan table of one chunk's {per_chunk} values",
                              f"set it to at least {plan_table_nbytes(per_chunk)}, or auto")

    @property
    def bounds(self) -> Optional[tuple[int, int]]:
        """``(ptr, length)``, or None once closed."""
        return None if self._mm is None else (self.ptr, self.length)

    @property
    def used(self) -> int:
        return self._alloc.used

    def write(self, pointers: Sequence[int]) -> tuple[int, int]:
        """Encode a table of ``pointers``; ``(offset, address)``. `PlanError` when the arena is
        full (the live tables fill it), `StoreClosedError` after `close`."""
        if self._mm is None:
            raise StoreClosedError("plan table arena used after close()")
        off = self._alloc.alloc(plan_table_nbytes(len(pointers)))
        if off is None:
            raise PlanError(f"plan table arena full ({self._alloc.used} of {self.length} B in live tables, "
                            f"{plan_table_nbytes(len(pointers))} B wanted); end plans sooner or raise {self.field}")
        encode_plan_table(self.ptr + off, pointers)
        return off, self.ptr + off

    def free(self, offset: int) -> None:
        self._alloc.free(offset)  # bookkeeping only: safe after close

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
