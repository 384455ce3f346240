"""`WorldKVManager`: decides what to restore, what to keep and what to evict; moves no bytes itself.

A facade over one role per module, all sharing one `ManagerContext` (forest, store, config,
clock, eviction settings and policy, metrics, locks); each role is an attribute of the manager:

- ``fast_forward`` (`lookup.FastForward`): the longest ready prefix, break-even, and the retry of
  the longest whole shorter prefix when a restore finds values gone;
- ``index`` (`shared_index.SharedIndex`): where the local trie ends, the store's chunk records
  (other processes' chunks, a previous run's) are asked for the next keys and adopted; a written
  chunk's record is published last;
- ``restorer`` (`restore.Restorer`): references the path, fetches everything, then publishes;
- ``invalidator`` (`invalidation.Invalidator`): drops the nodes whose values the store lost;
- ``ingestor`` (`ingest.Ingestor`): the write side; the store's completion callback publishes;
- ``frames`` (`frames.ChunkFrames`): each chunk's handed-out frames beside its KV, written off
  the request path, read when a restored chunk is handed out;
- ``evictor`` (`eviction.Evictor`) and ``demoter`` (`demotion.Demoter`): keep a bounded store,
  and each level of a tiered store, under the watermarks.

The facade keeps what callers use (docs/api.md, the binding, the orchestrator). Thread-safe
through the forest's lock, held only to choose and claim; every store call runs outside it (lock
order in `context`). Metrics: one `CacheMetrics` (pass a shared one to aggregate managers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.eviction import EvictionConfig, make_policy
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.config import SharedIndexConfig, WorldKVConfig
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.demotion import Demoter
from cacheseek.reuse.exact_prefix.eviction import Evictor
from cacheseek.reuse.exact_prefix.frames import ChunkFrames
from cacheseek.reuse.exact_prefix.ingest import Ingestor
from cacheseek.reuse.exact_prefix.invalidation import Invalidator
from cacheseek.reuse.exact_prefix.lookup import FastForward
from cacheseek.reuse.exact_prefix.restore import Restorer, RestoreWindow
from cacheseek.reuse.exact_prefix.shared_index import SharedIndex
from cacheseek.reuse.exact_prefix.trie import Namespace, NamespaceForest
from cacheseek.reuse.exact_prefix.types import ActionKey, FastForwardResult, TrieNode

__all__ = ["WorldKVManager", "RestoreWindow"]


class _Shared:
    """A facade attribute kept in the shared context, so that setting it (``manager.store =
    ...``) reaches every role."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj.ctx, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.ctx, self.name, value)


class WorldKVManager:
    """Trie bookkeeping over one store (see the module docstring).

    ``eviction``: an `EvictionConfig` (or a mapping with its fields; default LRU, 0.9/0.7).
    ``metrics``: a `CacheMetrics` to report into (default: a new one). ``clock``: the time
    source of ``last_access`` and the usage timeline (default ``time.monotonic``).
    ``shared_index``: a `SharedIndexConfig` (or a mapping of its fields; default on, 8 keys a
    probe): lookups continue past the local trie in the store's chunk records."""

    forest = _Shared()
    store = _Shared()
    cfg = _Shared()
    clock = _Shared()
    eviction = _Shared()
    policy = _Shared()
    metrics = _Shared()

    def __init__(
        self,
        forest: NamespaceForest,
        store: Any,
        cfg: WorldKVConfig,
        *,
        clock: Optional[Callable[[], float]] = None,
        eviction: Any = None,
        metrics: Optional[CacheMetrics] = None,
        shared_index: Any = None,
    ) -> None:
        if not isinstance(eviction, EvictionConfig):
            eviction = EvictionConfig.from_conf(eviction)
        metrics = metrics if metrics is not None else CacheMetrics()
        metrics.bind_store(store)
        self.ctx = ctx = ManagerContext(
            forest=forest, store=store, cfg=cfg, clock=clock or time.monotonic,
            eviction=eviction, policy=make_policy(eviction.policy), metrics=metrics,
        )
        self.index = SharedIndex(ctx, SharedIndexConfig.from_conf(shared_index))
        self.invalidator = Invalidator(ctx)
        self.restorer = Restorer(ctx, self.invalidator, self.index)
        self.demoter = Demoter(ctx)
        self.evictor = Evictor(ctx, self.demoter)
        self.ingestor = Ingestor(ctx, self.evictor, self.index)
        self.frames = ChunkFrames(ctx)
        self.fast_forward = FastForward(ctx, self.restorer, self.demoter, self.index)

    def try_fast_forward(
        self, root_hash: bytes, actions: Sequence[ActionKey], window: RestoreWindow
    ) -> FastForwardResult:
        return self.fast_forward.try_fast_forward(root_hash, actions, window)

    def find(self, root_hash: bytes, actions: Sequence[ActionKey]) -> FastForwardResult:
        """The longest cached prefix of ``actions``, restoring nothing (`FastForward.find`): a
        session that hands out stored frames restores KV only where it computes."""
        return self.fast_forward.find(root_hash, actions)

    def restore_chunk(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore ``node`` alone into ``window``: a live session's next chunk, on a cached path
        (see `FastForward.restore_chunk`). Never raises for a store's or the window's failure."""
        return self.fast_forward.restore_chunk(node, window)

    def materialize(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore the window path ending at ``node`` into ``window``; False when the path is not
        whole (nodes found without their values are invalidated). Raises on store errors."""
        return self.restorer.restore(node, window).ok

    def audit(self) -> int:
        """Invalidate every ready node whose values the store no longer holds (`Invalidator.audit`)."""
        return self.invalidator.audit()

    def reconcile(self) -> dict[str, int]:
        """Once, before sessions start: remove the values no node names, then `audit`
        (`Invalidator.reconcile`). Returns ``{"orphans_removed": n, "invalidated": m}``."""
        return self.invalidator.reconcile()

    def ingest(self, ns: Namespace, parent: TrieNode, action: ActionKey, node_key: bytes, depth: int,
               kv_payload: Sequence[Any], latent: Any, *, nbytes: int = 0, n_layers: Optional[int] = None,
               ) -> TrieNode:
        """Write one finished chunk (`Ingestor.ingest`; docs/api.md)."""
        return self.ingestor.ingest(ns, parent, action, node_key, depth, kv_payload, latent,
                                    nbytes=nbytes, n_layers=n_layers)

    def evict_blob(self, node: TrieNode) -> bool:
        """`Evictor.evict_blob` honouring every pin (docs/api.md)."""
        return self.evictor.evict_blob(node, honour_pins=True)
