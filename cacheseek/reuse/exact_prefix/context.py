"""`ManagerContext`: the state the manager's roles share (lookup, restore, invalidation, ingest,
eviction, demotion).

One context per `WorldKVManager`; every role holds the same one, so a setting changed on the
facade (``manager.store = ...``) reaches all of them. Locks, outermost first: ``evict_lock`` (one
eviction or demotion pass at a time), the forest's ``lock`` (trie state: blobs, references,
claims; held only to choose and claim, never around a store call), ``stats_lock`` (the legacy
counters only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs

from cacheseek.eviction import EvictionConfig
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.trie import NamespaceForest

__all__ = ["STAT_NAMES", "ManagerContext"]

# The legacy ``WorldKVManager.stats`` counters, in the order callers have always seen them.
STAT_NAMES = (
    "lookups", "hits", "misses", "below_break_even", "restore_failures", "ingests",
    "reingest_kept", "evictions", "invalidations", "restore_retries", "dropped_writes",
)


@attrs.define(eq=False)
class ManagerContext:
    """The forest and store one manager works on, its settings and its counters.

    ``clock``: time source of ``last_access`` and the usage timeline. ``policy``: the eviction
    policy built from ``eviction.policy``. ``stats``: the legacy counters (`STAT_NAMES`), bumped
    through `count`; ``metrics`` is the full record."""

    forest: NamespaceForest
    store: Any
    cfg: WorldKVConfig
    clock: Callable[[], float]
    eviction: EvictionConfig
    policy: Any
    metrics: CacheMetrics
    stats: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(STAT_NAMES, 0))
    stats_lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)
    evict_lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the legacy counter ``name``."""
        with self.stats_lock:
            self.stats[name] += n
