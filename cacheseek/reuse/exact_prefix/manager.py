"""`WorldKVManager`: decides what to restore, what to keep and what to evict; moves no bytes itself.

A thin facade over one role per module, all sharing one `ManagerContext` (forest, store, config,
clock, eviction settings and policy, metrics, locks):

- `lookup.FastForward` (``try_fast_forward``): the longest ready prefix, break-even, and the retry
  of the longest whole shorter prefix when a restore finds values gone;
- `restore.Restorer` (``materialize``, ``window_path``): references the path under the forest
  lock, fetches everything, then publishes (``set_resume_depth``: the single publication point);
- `invalidation.Invalidator` (``audit``, ``reconcile``): drops the nodes whose values the store
  lost; a node still being read is freed by its last reader;
- `ingest.Ingestor` (``ingest``): the write side; the store's completion callback publishes;
- `eviction.Evictor` (``maybe_evict``, ``evict``, ``evict_blob``) and `demotion.Demoter`: keep a
  bounded store, and each level of a tiered store, under the watermarks.

Thread-safe through the forest's lock, held only to choose and claim; every store call runs
outside it (lock order in `context`). Metrics: one `CacheMetrics` (``self.metrics``; pass a
shared one to aggregate several managers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.eviction import Candidate, EvictionConfig, make_policy
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.demotion import Demoter
from cacheseek.reuse.exact_prefix.eviction import Evictor
from cacheseek.reuse.exact_prefix.ingest import Ingestor
from cacheseek.reuse.exact_prefix.invalidation import Invalidator
from cacheseek.reuse.exact_prefix.lookup import FastForward
from cacheseek.reuse.exact_prefix.restore import Restorer, RestoreWindow
from cacheseek.reuse.exact_prefix.trie import Namespace, NamespaceForest
from cacheseek.reuse.exact_prefix.types import ActionKey, FastForwardResult, TrieNode

__all__ = ["WorldKVManager", "RestoreWindow"]


class _Shared:
    """A facade attribute kept in the shared context, so that setting it (``manager.store =
    ...``) reaches every role."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj._ctx, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._ctx, self.name, value)


class WorldKVManager:
    """Trie bookkeeping over one store (see the module docstring).

    ``eviction``: an `EvictionConfig` (or a mapping with its fields; default LRU, 0.9/0.7).
    ``metrics``: a `CacheMetrics` to report into (default: a new one). ``clock``: the time
    source of ``last_access`` and the usage timeline (default ``time.monotonic``)."""

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
    ) -> None:
        if not isinstance(eviction, EvictionConfig):
            eviction = EvictionConfig.from_conf(eviction)
        metrics = metrics if metrics is not None else CacheMetrics()
        metrics.bind_store(store)
        self._ctx = ctx = ManagerContext(
            forest=forest, store=store, cfg=cfg, clock=clock or time.monotonic,
            eviction=eviction, policy=make_policy(eviction.policy), metrics=metrics,
        )
        self._invalidator = Invalidator(ctx)
        self._restorer = Restorer(ctx, self._invalidator)
        self._demoter = Demoter(ctx)
        self._evictor = Evictor(ctx, self._demoter)
        self._ingestor = Ingestor(ctx, self._evictor)
        self._fast_forward = FastForward(ctx, self._restorer, self._demoter)

    # -- read side ----------------------------------------------------------------------------

    def try_fast_forward(
        self, root_hash: bytes, actions: Sequence[ActionKey], window: RestoreWindow
    ) -> FastForwardResult:
        return self._fast_forward.try_fast_forward(root_hash, actions, window)

    def restore_chunk(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore ``node`` alone into ``window``: a live session's next chunk, on a cached path
        (see `FastForward.restore_chunk`). Never raises for a store's or the window's failure."""
        return self._fast_forward.restore_chunk(node, window)

    def window_path(self, node: TrieNode) -> list[TrieNode]:
        return self._restorer.window_path(node)

    def materialize(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore the window path ending at ``node`` into ``window``; False when the path is not
        whole (nodes found without their values are invalidated). Raises on store errors."""
        return self._restorer.restore(node, window).ok

    # -- consistency with the store -----------------------------------------------------------

    def audit(self) -> int:
        """Check every ready node's latent and KV values against the store (its ``contains``)
        and invalidate the nodes whose values are gone, e.g. after a worker restart. Returns the
        number invalidated; 0 when the store cannot say (no ``contains``)."""
        return self._invalidator.audit()

    def reconcile(self) -> dict[str, int]:
        """Make the store and this forest agree, once, before sessions start (after loading a
        snapshot, or on a fresh forest over a persistent store): remove every value no node names
        (where the store can list and remove values: ``keys()`` and ``delete_values(keys)``), so
        a reopened store does not count a previous process's unreachable files; then `audit`.
        Returns ``{"orphans_removed": n, "invalidated": m}``. Not for use while sessions write:
        a value written but not yet named by its node would be taken for an orphan."""
        return self._invalidator.reconcile()

    # -- write side ---------------------------------------------------------------------------

    def ingest(
        self,
        ns: Namespace,
        parent: TrieNode,
        action: ActionKey,
        node_key: bytes,
        depth: int,
        kv_payload: Sequence[Any],
        latent: Any,
        *,
        nbytes: int = 0,
        n_layers: Optional[int] = None,
    ) -> TrieNode:
        return self._ingestor.ingest(ns, parent, action, node_key, depth, kv_payload, latent,
                                     nbytes=nbytes, n_layers=n_layers)

    # -- capacity -----------------------------------------------------------------------------

    def maybe_evict(self) -> int:
        """After a write: when the store's usage is above the high watermark, evict down to the
        low watermark. Returns the number of blobs evicted (0 when the store is unbounded)."""
        return self._evictor.maybe_evict()

    def evict(self, target_bytes: int, *, at_least_one: bool = False) -> int:
        """One eviction pass down to ``target_bytes`` (see `Evictor.evict`); ``at_least_one``:
        evict one blob even when already below the target. Returns blobs evicted."""
        return self._evictor.evict(target_bytes, at_least_one=at_least_one)

    def evict_blob(self, node: TrieNode) -> bool:
        """Free a node's KV and drop its blob, keeping the skeleton. Refuses pinned, referenced,
        blob-less, being-evicted and in-flight nodes (False). The blob is detached under the
        forest lock and freed outside it; if freeing fails the blob is put back and the error
        propagates."""
        return self._evictor.evict_blob(node, honour_pins=True)

    # -- internals that tests inspect -----------------------------------------------------------

    def _invalidate(self, nodes: Sequence[TrieNode]) -> int:
        return self._invalidator.invalidate(nodes)

    def _collect(self) -> tuple[list[TrieNode], list[Candidate]]:
        return self._evictor.collect()

    def _candidate(self, node: Optional[TrieNode]) -> Optional[Candidate]:
        return self._evictor.candidate(node)
