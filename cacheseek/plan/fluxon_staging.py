"""Host staging of the Fluxon public Plan client: how large, and how a plan's values are carved.

A put plan's values are copied (D2H) into staging, not into Fluxon; the commit then has Fluxon
copy each value from its staging block into the owner's segment, and frees the plan's region.
Each value takes a block of its length rounded up to ``STAGING_ALIGN`` (256) bytes (`block_bytes`),
so every put source starts 256-byte aligned; a plan's blocks are one contiguous region.

Sizing (`staging_for`): one chunk's KV (so that a chunk is one wave of plans) and at least four
values, within 64 MiB..4 GiB; 256 MiB when the geometry is unknown. A chunk larger than the
staging is written in waves of plans of at most `max_values` values each (the Plan tier splits
it). A staging that cannot hold one value is a `ConfigError` at construction
(`resolve_staging_bytes`).

`Staging` lifecycle: mapped (and pre-faulted) by the client when its segments are first asked
for; `reserve` a region per plan; `free` it at commit or abort; a region whose put timed out is
`quarantine`d instead (the stuck call may still read it) and never freed; `close` unmaps
(only when nothing is quarantined: the client leaves it mapped to process exit otherwise).
"""

from __future__ import annotations

from typing import Any, Optional

from cacheseek.errors import ConfigError, StoreFullError
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.base import SegmentTimers
from cacheseek.plan.segment import HostSegment, page_round
from cacheseek.sizes import AUTO, parse_size

__all__ = ["STAGING_ALIGN", "Staging", "block_bytes", "max_values", "resolve_staging_bytes", "staging_for"]

STAGING_ALIGN = 256  # staging blocks (and so every put source) start on 256-byte boundaries
STAGING_FIELD = "store.client_options.staging_bytes"
_STAGING_FIX = f"raise {STAGING_FIELD}"
_STAGING_MIN = 64 << 20
_STAGING_MAX = 4 << 30
_STAGING_DEFAULT = 256 << 20


def block_bytes(value_len: int) -> int:
    """The staging bytes one value of ``value_len`` bytes takes."""
    return -(-value_len // STAGING_ALIGN) * STAGING_ALIGN


def max_values(staging_bytes: int, value_len: int) -> int:
    """How many values of ``value_len`` bytes one plan can stage in ``staging_bytes``."""
    return staging_bytes // block_bytes(value_len)


def staging_for(value_bytes: Optional[int], chunk_bytes: Optional[int]) -> int:
    """The staging size from the geometry: one chunk's KV (so a chunk is one wave of plans) and
    at least 4 values, within 64 MiB..4 GiB (a larger chunk is written in several waves); 256 MiB
    when the geometry is unknown."""
    if value_bytes is None and chunk_bytes is None:
        return _STAGING_DEFAULT
    want = max(chunk_bytes or 0, 4 * block_bytes(value_bytes or 1))
    size = min(max(want, _STAGING_MIN), _STAGING_MAX)
    if value_bytes is not None:
        size = max(size, block_bytes(value_bytes))
    return block_bytes(size)


def resolve_staging_bytes(staging_bytes: Any, value_bytes: Optional[int], chunk_bytes: Optional[int]) -> int:
    """``staging_bytes`` as given (a size), or for auto/None `staging_for` the geometry; a
    `ConfigError` when it cannot stage one value of ``value_bytes``."""
    size = parse_size(staging_bytes, STAGING_FIELD, minimum=STAGING_ALIGN, allow_auto=True, allow_none=True)
    if size is None or size == AUTO:
        size = staging_for(value_bytes, chunk_bytes)
    if value_bytes is not None and block_bytes(value_bytes) > size:
        raise ConfigError(
            STAGING_FIELD,
            f"{size} bytes cannot stage one value of {value_bytes} bytes (one layer's K or V of "
            "a chunk): no write could ever start",
            f"set it to at least {block_bytes(value_bytes)}, or auto to size it from the geometry")
    return size


class Staging:
    """``length`` bytes of private host memory at ``ptr`` (at least the size asked, whole pages),
    carved into plan regions; see the module docstring."""

    def __init__(self, nbytes: int, *, prefault: bool) -> None:
        self._segment = HostSegment(page_round(nbytes), "private", None, 1, prefault=prefault, hugepages=False)
        self.ptr = self._segment.ptr
        self.length = self._segment.length
        self._alloc = FirstFitAllocator(self.length, STAGING_ALIGN)
        self.quarantined = 0  # bytes of regions left to stuck puts

    @property
    def used(self) -> int:
        """Bytes reserved by live or stuck plans."""
        return self._alloc.used

    def timers(self) -> SegmentTimers:
        seg = self._segment
        return SegmentTimers(seg.map_seconds, seg.fault_seconds, seg.fault_method, seg.threads, -1, seg.length)

    @property
    def fault_method(self) -> str:
        return self._segment.fault_method

    @property
    def fault_seconds(self) -> float:
        return self._segment.fault_seconds

    def reserve(self, n: int, value_len: int) -> tuple[int, int]:
        """A region of ``n`` blocks for values of ``value_len`` bytes: ``(offset, block)``, value
        i at ``ptr + offset + i * block``. `StoreFullError` when it does not fit."""
        block = block_bytes(value_len)
        off = self._alloc.alloc(block * n)
        if off is None:
            stuck = f" ({self.quarantined} left to stuck puts)" if self.quarantined else ""
            raise StoreFullError(
                f"fluxon Plan staging full: need {block * n} bytes ({n} values of {value_len} B), "
                f"{self._alloc.used} of {self.length} reserved by uncommitted plans{stuck}; {_STAGING_FIX}")
        return off, block

    def free(self, offset: int) -> None:
        """Give a region back (bookkeeping only: safe after `close`)."""
        self._alloc.free(offset)

    def quarantine(self, nbytes: int) -> None:
        """A region of ``nbytes`` stays reserved for good: a put from it timed out."""
        self.quarantined += nbytes

    def close(self) -> None:
        """Unmap (idempotent)."""
        self._segment.close()
