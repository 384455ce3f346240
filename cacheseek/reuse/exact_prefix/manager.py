"""`WorldKVManager`: decides what to restore and what to keep; moves no bytes itself.

Read side: `try_fast_forward` looks up the longest ready prefix, and `materialize` restores the
window path ending at that node. Nothing is published (the window's ``set_resume_depth`` is the
single publication point) until every input has been fetched and copied: a missing latent, a
partial layer or a store error leaves the runtime and the trie as they were, and the session runs
cold. Path nodes are referenced while being read, so eviction cannot take them.

Two store paths, chosen by capability:

- generic `TierStore`: latents via ``get_skeleton``, then every window layer via ``get_layer``;
  all of it is fetched before the first ``seed_layer`` call;
- `PathReadStore` (and a window that offers ``restore_target``): the store restores the whole
  window path into the runtime's buffers itself (``read_path``).

Write side: `ingest` commits the node, stores the latent skeleton, writes the KV and lets the
store's completion callback flip the handle ready. Re-ingesting a ready node keeps its blob.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

from cacheseek.errors import CacheSeekError, HandleStateError, WriteNotCompleteError
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator
from cacheseek.reuse.exact_prefix.trie import Namespace, NamespaceForest
from cacheseek.reuse.exact_prefix.types import FastForwardResult, Skeleton, TrieNode

log = logging.getLogger(__name__)

__all__ = ["WorldKVManager", "RestoreWindow"]


class RestoreWindow(Protocol):
    """What `materialize` seeds. ``blobs`` is ``[(chunk_depth, (k, v)), ...]`` oldest first."""

    def seed_layer(self, layer: int, blobs: list[tuple[int, Any]], depth: int) -> None: ...

    def set_resume_depth(self, depth: int) -> None: ...


class WorldKVManager:
    """Trie bookkeeping over one store. Thread-safe through the forest's lock."""

    def __init__(
        self,
        forest: NamespaceForest,
        store: Any,
        cfg: WorldKVConfig,
        *,
        clock: Optional[Callable[[], float]] = None,
    ) -> None:
        self.forest = forest
        self.store = store
        self.cfg = cfg
        self.clock = clock or time.monotonic
        self.stats: dict[str, int] = {
            "lookups": 0, "hits": 0, "misses": 0, "below_break_even": 0,
            "restore_failures": 0, "ingests": 0, "reingest_kept": 0, "evictions": 0,
        }

    # -- read side ----------------------------------------------------------------------------

    def try_fast_forward(
        self, root_hash: bytes, actions: Sequence[bytes], window: RestoreWindow
    ) -> FastForwardResult:
        self.stats["lookups"] += 1
        match = self.forest.lookup(root_hash, actions)
        if match.namespace is None or match.matched_len == 0 or match.node is None:
            self.stats["misses"] += 1
            return FastForwardResult(0, None, match.namespace)
        if match.matched_len < self.cfg.break_even_k:
            self.stats["below_break_even"] += 1
            return FastForwardResult(0, None, match.namespace)
        try:
            ok = self.materialize(match.node, window)
        except CacheSeekError as exc:
            log.warning("restore of depth %d failed, running cold: %s", match.matched_len, exc)
            ok = False
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("restore of depth %d failed unexpectedly, running cold", match.matched_len)
            ok = False
        if not ok:
            self.stats["restore_failures"] += 1
            return FastForwardResult(0, None, match.namespace)
        self.stats["hits"] += 1
        return FastForwardResult(match.matched_len, match.node, match.namespace)

    def window_path(self, node: TrieNode) -> list[TrieNode]:
        path = node.path()
        depths = set(self.cfg.window_depths(len(path)))
        return [n for n in path if n.depth in depths]

    def materialize(self, node: TrieNode, window: RestoreWindow) -> bool:
        path = node.path()
        win = self.window_path(node)
        if not all(n.has_kv for n in win) or not all(n.skeleton is not None for n in path):
            return False
        with self.forest.lock:
            for n in path:
                n.ref_count += 1
        try:
            now = self.clock()
            if _is_path_store(self.store) and hasattr(window, "restore_target"):
                target = window.restore_target(len(path), [n.depth for n in win])
                if not self.store.read_path(path, win, target):
                    return False
            else:
                if not self._fetch_generic(path, win, window):
                    return False
            window.set_resume_depth(len(path))
            for n in path:
                n.last_access = now
            return True
        finally:
            with self.forest.lock:
                for n in path:
                    n.ref_count -= 1

    def _fetch_generic(self, path: list[TrieNode], win: list[TrieNode], window: RestoreWindow) -> bool:
        latents = []
        for n in path:
            latent = self.store.get_skeleton(n.skeleton.latent_locator)
            if latent is None:
                log.info("latent of depth %d missing: miss", n.depth)
                return False
            latents.append(latent)
        n_layers = {n.blob.n_layers for n in win}
        if len(n_layers) != 1:
            return False
        per_layer: list[list[tuple[int, Any]]] = []
        for layer in range(n_layers.pop()):
            blobs = []
            for n in win:
                kv = self.store.get_layer(n.blob, layer)
                if kv is None or kv[0] is None or kv[1] is None:
                    log.info("layer %d of depth %d missing: miss", layer, n.depth)
                    return False
                blobs.append((n.depth, kv))
            per_layer.append(blobs)
        if hasattr(window, "seed_latents"):
            window.seed_latents(latents)
        for layer, blobs in enumerate(per_layer):
            window.seed_layer(layer, blobs, len(path))
        return True

    # -- write side ---------------------------------------------------------------------------

    def ingest(
        self,
        ns: Namespace,
        parent: TrieNode,
        action: bytes,
        node_key: bytes,
        depth: int,
        kv_payload: Sequence[tuple[Any, Any]],
        latent: Any,
        *,
        nbytes: int = 0,
        n_layers: Optional[int] = None,
    ) -> TrieNode:
        node = self.forest.commit(ns, parent, action, node_key, depth)
        with self.forest.lock:
            if node.has_kv or (node.blob is not None and node.blob.in_flight):
                self.stats["reingest_kept"] += 1
                return node
            if depth < self.cfg.sink_chunks:
                node.pinned = True
        if n_layers is not None and n_layers != len(kv_payload):
            raise ValueError(f"n_layers={n_layers} but kv_payload has {len(kv_payload)} layers")
        lat_loc = latent_locator(node_key)
        self.store.put_skeleton(lat_loc, latent)
        node.skeleton = Skeleton(lat_loc)

        def on_ready(handle) -> None:
            with self.forest.lock:
                node.last_access = self.clock()

        handle = self.store.put_async(kv_locator(node_key), kv_payload, tier=self.cfg.commit_tier,
                                      on_ready=on_ready)
        with self.forest.lock:
            # A failed write leaves the handle unready with ``error`` set: never a hit, and a
            # later ingest of the same chunk replaces it.
            node.blob = handle
            if nbytes and not handle.nbytes:
                handle.nbytes = nbytes
        self.stats["ingests"] += 1
        return node

    # -- lifetime -----------------------------------------------------------------------------

    def evict_blob(self, node: TrieNode) -> bool:
        """Free a node's KV and drop its blob, keeping the skeleton. Refuses pinned, referenced,
        blob-less and in-flight nodes (False). If freeing fails the blob is kept and the error
        propagates."""
        with self.forest.lock:
            if node.pinned or node.ref_count > 0 or node.blob is None:
                return False
            if node.blob.in_flight:
                return False
            if node.ref_count < 0:
                raise HandleStateError(f"negative ref_count on {node!r}")
            handle = node.blob
            try:
                self.store.free(handle)
            except WriteNotCompleteError:
                return False
            node.blob = None
            self.stats["evictions"] += 1
            return True


def _is_path_store(store: Any) -> bool:
    return callable(getattr(store, "read_path", None)) and getattr(store, "accepts_device_views", False)
