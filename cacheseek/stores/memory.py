"""The in-memory tier: the embedded default. Values live in a dict in this process.

It receives caller-owned CPU snapshots (the binding clones the ring tail), so nothing in it
aliases the live ring. Works with plain Python objects as payloads too (tests use strings).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from cacheseek.kv.records import DictRecords
from cacheseek.registry import STORES
from cacheseek.sizes import AUTO, Size
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


@STORES.register("memory")
class InMemoryTierStore(KeyValueTier):
    """`KeyValueTier` over a `DictBackend`; writes complete before ``put_async`` returns.
    ``capacity_bytes``: the bytes of values (KV and latents) it may hold: a size (``"512MiB"``),
    None = unbounded, or ``"auto"``: unbounded when the workload fits in free memory, else capped
    there (`cacheseek.sizing`; unbounded when built directly, with no workload to fit). Above the
    manager's high watermark the manager evicts; a write that does not fit is refused. Its chunk
    records live in a dict beside the values: every manager (trie) on this store finds what the
    others wrote, as the workers of one process would. ``codec``/``codec_device``: how K and V are
    encoded (`cacheseek.codecs`; ``none`` keeps them as they are)."""

    def __init__(self, capacity_bytes: Optional[Size] = AUTO, codec: str = "none", codec_device: str = "auto") -> None:
        super().__init__(DictBackend(), name="memory", capacity_bytes=capacity_bytes, records=DictRecords(),
                         codec=codec, codec_device=codec_device)

    def keys(self) -> list[str]:
        return self.backend.keys()
