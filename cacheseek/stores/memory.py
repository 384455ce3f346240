"""The in-memory tier: the embedded default. Values live in a dict in this process.

It receives caller-owned CPU snapshots (the binding clones the ring tail), so nothing in it
aliases the live ring. Works with plain Python objects as payloads too (tests use strings).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

from cacheseek.registry import STORES
from cacheseek.sizes import Size
from cacheseek.stores.kv_tier import KeyValueTier

__all__ = ["InMemoryTierStore", "DictBackend"]


class DictBackend:
    """A thread-safe dict of values."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._lock = threading.Lock()

    def write(self, key: str, value: Any) -> None:
        with self._lock:
            self._values[key] = value

    def read(self, key: str) -> Optional[Any]:
        with self._lock:
            return self._values.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._values.pop(key, None)

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._values

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def close(self) -> None:
        pass


@dataclasses.dataclass
class InMemorySchema:
    _target_: str = "cacheseek.stores.memory.InMemoryTierStore"
    # Bytes of values (KV and latents) the tier may hold: a size (512MiB, 24GiB), null =
    # unbounded, or auto = unbounded when the workload fits in free memory, else capped there
    # (cacheseek.sizing). Above the manager's high watermark the manager evicts (manager.eviction);
    # a write that does not fit is refused.
    capacity_bytes: Any = "auto"


@STORES.register("memory", InMemorySchema)
class InMemoryTierStore(KeyValueTier):
    """`KeyValueTier` over a `DictBackend`; writes complete before ``put_async`` returns.
    ``capacity_bytes``: see `KeyValueTier` (bytes or a size like ``"512MiB"``; None = unbounded)."""

    def __init__(self, capacity_bytes: Optional[Size] = None) -> None:
        super().__init__(DictBackend(), name="memory", capacity_bytes=capacity_bytes)

    def keys(self) -> list[str]:
        return self.backend.keys()
