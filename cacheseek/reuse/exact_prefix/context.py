"""`ManagerContext`: the state the manager's roles share (lookup, restore, invalidation, ingest,
eviction, demotion).

One context per `WorldKVManager`; every role holds the same one, so a setting changed on the
facade (``manager.store = ...``) reaches all of them. Locks, outermost first: ``evict_lock`` (one
eviction or demotion pass at a time), the forest's ``lock`` (trie state: blobs, references,
claims; held only to choose and claim, never around a store call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs

from cacheseek.eviction import EvictionConfig, StoreOffers
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.trie import NamespaceForest

__all__ = ["ManagerContext"]


def _reprobe(ctx: "ManagerContext", _attr: Any, store: Any) -> Any:
    ctx.offers = StoreOffers.of(store)
    return store


@attrs.define(eq=False)
class ManagerContext:
    """The forest and store one manager works on, its settings and its counters.

    ``clock``: time source of ``last_access`` and the usage timeline. ``policy``: the eviction
    policy built from ``eviction.policy``; ``metrics``: what it counts; ``offers``: the store's
    capabilities, probed again when ``store`` is set."""

    forest: NamespaceForest
    store: Any = attrs.field(on_setattr=_reprobe)
    cfg: WorldKVConfig
    clock: Callable[[], float]
    eviction: EvictionConfig
    policy: Any
    metrics: CacheMetrics
    evict_lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)
    offers: StoreOffers = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.offers = StoreOffers.of(self.store)
