"""The memory a copy reads and writes: `MemoryRange` (device ranges declared per batch) and
`HostMapping` (host memory registered with a runtime).

- a *host mapping* is a range of host memory (a Plan store's segment) registered once with
  `TransferRuntime.register`, deduplicated by ``(ptr, length, generation)``; a read-only mapping
  can only be a copy source. A mapping may be registered as consecutive *pieces*
  (`HostMapping.pieces`, `TransferRuntimeBase.register_in_pieces`): each piece is a registration
  of its own, so no copy may span two of them (`cacheseek.transfer.joints`);
- a *device range* is the memory of one of the runtime's tensors (CUDA tensors for the CUDA
  runtime, CPU tensors for the host runtime), declared per batch with ``device_ranges`` (build
  them with `TransferRuntime.device_range`).

Addresses are raw ints in this process; lengths are bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import attrs

from cacheseek.transfer.lazy import LazyModule

np = LazyModule("numpy")

__all__ = ["MemoryRange", "HostMapping", "DeviceRanges", "positive_int", "non_negative_int", "PIECE_ALIGNMENT"]

PIECE_ALIGNMENT = 4096  # a piece of a registration is whole pages (the driver pins pages)


def positive_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: an int > 0 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def non_negative_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: an int >= 0 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(slots=True)
class MemoryRange:
    """``length`` bytes at address ``ptr``."""

    ptr: int = attrs.field(validator=positive_int)
    length: int = attrs.field(validator=positive_int)

    @property
    def end(self) -> int:
        return self.ptr + self.length

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.end


@attrs.frozen(eq=False)
class DeviceRanges:
    """Declared device ranges, sorted by address once, with their bounds as int64 arrays.

    A caller that declares the same ranges for many batches (a restore declares the 80 tensors of
    a 480p ring every time) builds this once; `validate_batch` then does no Python work per range.
    Iterates as its `MemoryRange` s, so it goes wherever a sequence of ranges does."""

    ranges: tuple[MemoryRange, ...]
    starts: Any
    ends: Any

    @classmethod
    def of(cls, ranges: Iterable[MemoryRange]) -> "DeviceRanges":
        if isinstance(ranges, DeviceRanges):
            return ranges
        ordered = tuple(sorted(ranges, key=lambda r: r.ptr))
        return cls(ordered, np.array([r.ptr for r in ordered], dtype=np.int64),
                   np.array([r.end for r in ordered], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[MemoryRange]:
        return iter(self.ranges)


@attrs.frozen(slots=True)
class HostMapping:
    """A host memory range a Plan store owns: ``length`` bytes at ``ptr``. ``generation`` changes
    when the store recreates the segment (a new registration even at the same address);
    ``writable`` is False for a read-only mapping (a copy source only)."""

    ptr: int = attrs.field(validator=positive_int)
    length: int = attrs.field(validator=positive_int)
    generation: int = attrs.field(validator=non_negative_int)
    writable: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @property
    def key(self) -> tuple[int, int, int]:
        """The deduplication key of a registration."""
        return (self.ptr, self.length, self.generation)

    @property
    def range(self) -> MemoryRange:
        return MemoryRange(self.ptr, self.length)

    def pieces(self, piece_bytes: Optional[int]) -> "tuple[HostMapping, ...]":
        """The mapping cut into consecutive pieces of ``piece_bytes`` (the last one shorter), each
        with this mapping's generation and writability; None or 0: the mapping itself, whole.
        ``piece_bytes`` must be a multiple of `PIECE_ALIGNMENT`, so every cut falls on a page."""
        if piece_bytes is None or piece_bytes == 0 or piece_bytes >= self.length:
            if piece_bytes is not None:
                _check_piece_bytes(piece_bytes)
            return (self,)
        _check_piece_bytes(piece_bytes)
        return tuple(HostMapping(self.ptr + off, min(piece_bytes, self.length - off), self.generation, self.writable)
                     for off in range(0, self.length, piece_bytes))


def _check_piece_bytes(piece_bytes: Any) -> None:
    if (not isinstance(piece_bytes, int) or isinstance(piece_bytes, bool) or piece_bytes < 0
            or piece_bytes % PIECE_ALIGNMENT):
        raise ValueError(f"piece_bytes must be 0 (one registration) or a positive multiple of "
                         f"{PIECE_ALIGNMENT}, got {piece_bytes!r}")
