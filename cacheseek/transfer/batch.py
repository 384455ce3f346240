"""What a copy is: `Direction`, `CopyDescriptor` (one copy) and `CopyBatch` (many, as arrays).

``Direction`` states where each side lives: ``H2D`` reads a host mapping and writes a device
range, ``D2H`` the reverse, ``H2H`` copies between host mappings, ``D2D`` between device ranges
(a snapshot of the live ring into a staging buffer); see `cacheseek.transfer.memory`. The same
contract holds for every runtime, whatever the physical memory behind a "device" range.

A batch is a sequence of `CopyDescriptor` values or a `CopyBatch`: the same copies as numpy
arrays, built and validated without a Python object per copy, which matters for thousands of
small copies. Shapes: ``dsts``, ``srcs``, ``sizes`` int64 ``[n]``; ``codes`` int8 ``[n]``
(`Direction.code`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Optional, Union

import attrs

from cacheseek.errors import TransferError
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import positive_int

np = LazyModule("numpy")

__all__ = ["Direction", "DIRECTIONS", "CopyDescriptor", "CopyBatch", "BatchLike"]


class Direction(str, enum.Enum):
    """Where a copy's source and destination live: H(ost mapping) or D(evice range)."""

    H2D = "h2d"
    D2H = "d2h"
    H2H = "h2h"
    D2D = "d2d"

    @property
    def src_on_device(self) -> bool:
        return self in (Direction.D2H, Direction.D2D)

    @property
    def dst_on_device(self) -> bool:
        return self in (Direction.H2D, Direction.D2D)

    @property
    def code(self) -> int:
        return DIRECTIONS.index(self)


DIRECTIONS = (Direction.H2D, Direction.D2H, Direction.H2H, Direction.D2D)
"""Every direction, indexed by `Direction.code`."""


@attrs.frozen(slots=True)
class CopyDescriptor:
    """Copy ``nbytes`` bytes from address ``src`` to address ``dst``; both ranges are raw
    addresses in this process (device addresses for device ranges)."""

    dst: int = attrs.field(validator=positive_int)
    src: int = attrs.field(validator=positive_int)
    nbytes: int = attrs.field(validator=positive_int)
    direction: Direction = attrs.field(converter=Direction)


def _int64(values: Any, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim == 0 and n is not None:
        arr = np.full(n, int(arr), dtype=np.int64)
    return np.ascontiguousarray(arr.reshape(-1))


@attrs.frozen(slots=True, eq=False)
class CopyBatch:
    """A batch of copies as int64 arrays (``dsts``, ``srcs``, ``sizes``) and direction codes
    (`Direction.code`), one entry per copy. Build with `of` (one direction), `from_descriptors`
    or `concat`; the arrays are not copied again on submission."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    codes: np.ndarray

    @classmethod
    def of(cls, dsts: Any, srcs: Any, sizes: Any, direction: Direction) -> "CopyBatch":
        d = _int64(dsts)
        s = _int64(srcs, len(d))
        n = _int64(sizes, len(d))
        if not len(d) == len(s) == len(n):
            raise TransferError(f"copy batch arrays differ in length: {len(d)}, {len(s)}, {len(n)}")
        return cls(d, s, n, np.full(len(d), Direction(direction).code, dtype=np.int8))

    @classmethod
    def from_descriptors(cls, descriptors: Sequence[CopyDescriptor]) -> "CopyBatch":
        for i, d in enumerate(descriptors):
            if not isinstance(d, CopyDescriptor):
                raise TransferError(f"descriptor {i} is a {type(d).__name__}, not a CopyDescriptor")
        return cls(_int64([d.dst for d in descriptors]), _int64([d.src for d in descriptors]),
                   _int64([d.nbytes for d in descriptors]),
                   np.array([d.direction.code for d in descriptors], dtype=np.int8))

    @classmethod
    def coerce(cls, batch: Union["CopyBatch", Sequence[CopyDescriptor]]) -> "CopyBatch":
        return batch if isinstance(batch, CopyBatch) else cls.from_descriptors(list(batch))

    @classmethod
    def concat(cls, batches: Sequence["CopyBatch"]) -> "CopyBatch":
        batches = list(batches)
        if not batches:
            return cls.of([], [], [], Direction.H2D)
        return cls(*(np.concatenate([getattr(b, f) for b in batches]) for f in ("dsts", "srcs", "sizes", "codes")))

    def __len__(self) -> int:
        return len(self.dsts)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def direction(self, i: int) -> Direction:
        return DIRECTIONS[int(self.codes[i])]

    def descriptors(self) -> list[CopyDescriptor]:
        """The copies as `CopyDescriptor` values (tests, diagnostics)."""
        return [
            CopyDescriptor(int(d), int(s), int(n), DIRECTIONS[int(c)])
            for d, s, n, c in zip(self.dsts, self.srcs, self.sizes, self.codes)
        ]

    def by_direction(self) -> dict[Direction, tuple[int, int]]:
        """``{direction: (bytes, copies)}`` of the directions present."""
        nbytes = np.bincount(self.codes, weights=self.sizes, minlength=len(DIRECTIONS))
        copies = np.bincount(self.codes, minlength=len(DIRECTIONS))
        return {d: (int(nbytes[i]), int(copies[i])) for i, d in enumerate(DIRECTIONS) if copies[i]}


BatchLike = Union[CopyBatch, Sequence[CopyDescriptor]]
"""What every batch call accepts: a `CopyBatch` or a sequence of `CopyDescriptor` values."""
