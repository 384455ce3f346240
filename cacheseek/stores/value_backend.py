"""The contract between a generic tier (`cacheseek.stores.kv_tier.KeyValueTier`) and the
backend that holds its values (a dict, files, Fluxon), the tier's counters, and its config checks.

A full medium: a backend raises `StoreFullError` from ``write``. When the backend says the tier
accounts for its medium (``full_caps_tier``: a LocalDisk root at ENOSPC), the tier lowers
``capacity_bytes`` to the bytes it holds at that moment (logged; the medium holds no more), so
the manager's watermarks apply from then on, and a write-through ``put_async`` (or
``put_skeleton``) raises that `StoreFullError` after removing what it wrote, like a capacity
refusal, so the manager evicts and retries once; a write-back blob fails on its handle. A shared
store that evicts by itself (Fluxon) reports the failure on the handle and caps nothing.

Stalled media: with ``op_timeout_s`` (LocalDisk: ``store.op_timeout_s``) every backend call
(write, read, delete, exists, listing) runs through `BoundedCalls`: a call that does not return
within the bound is a `StoreTimeoutError` for its caller (a read is a failed restore and the
session runs cold; a write fails on its handle, a dropped write), and it goes on in the
background. A write that lands after its blob was reported failed is removed again unless a
later write holds its key. While 4 calls are stuck, new ones fail at once: sessions run uncached,
never hang. Without ``op_timeout_s`` (an in-memory dict) calls are direct.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import ConfigError
from cacheseek.sizes import AUTO, parse_size

__all__ = ["ValueBackend", "TierStats", "check_read_parallelism"]


class ValueBackend(Protocol):
    """Where a generic tier's values live. Values are CPU tensors or plain Python objects."""

    def write(self, key: str, value: Any) -> Any:
        """Store ``value``; a backend with ``checks_digests`` returns the value's checksum."""
        ...

    def read(self, key: str) -> Optional[Any]:
        """The value or None. A backend with ``checks_digests`` takes ``expect`` (a checksum
        ``write`` returned) and raises `CorruptValueError` when the value's differs."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...

    def close(self) -> None: ...


@attrs.define
class TierStats:
    """Counters of one tier, shown in the CLI report and written to results.json."""

    puts: int = 0
    put_bytes: int = 0
    put_seconds: float = 0.0
    gets: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    failed_writes: int = 0
    corrupt_values: int = 0
    frees: int = 0
    pending_writes: int = 0
    refused_full: int = 0
    used_bytes: int = 0
    peak_bytes: int = 0
    capacity_bytes: Optional[int] = None
    last_error: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def check_read_parallelism(value: Any) -> int:
    """``store.read_parallelism``: an int >= 1, else `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("store.read_parallelism", f"must be an integer >= 1, got {value!r}",
                          "1 reads one value after another; 4 overlaps the reads of a restore's values")
    return value


def _check_capacity(value: Any) -> Optional[int]:
    """Bytes or None; ``auto`` that no workload resolved (the store built directly) is unbounded."""
    n = parse_size(value, "store.capacity_bytes", allow_none=True, allow_auto=True)
    return None if n == AUTO else n
