"""`Ingestor`: the write side: one finished chunk into the trie and the store.

Lifetime of one write: the node is committed and claimed with a *pending* placeholder handle (so
a concurrent ingest of the same chunk keeps it and eviction skips it); the latent is
stored, then the KV is written asynchronously; the store's completion callback flips the handle
ready (the publication bit, set last), right after the chunk's record is published to the store
(`SharedIndex.publish`: other processes find it from then on). A chunk another process has
committed meanwhile is adopted instead of written again. Re-ingesting a ready, in-flight or
being-evicted node keeps it. A write that reports `StoreFullError` makes room (an eviction pass) and is retried once; a
second refusal drops the write (counted) and raises. A failed write leaves the handle unready with
``error`` set: never a hit, and a later ingest of the same chunk replaces it. After every ingest
the capacity pass runs (`Evictor.maybe_evict`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.errors import StoreError, StoreFullError
from cacheseek.eviction import store_usage
from cacheseek.kv.payload import layer_nbytes, payload_nbytes
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.eviction import Evictor
from cacheseek.reuse.exact_prefix.shared_index import SharedIndex
from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator
from cacheseek.reuse.exact_prefix.trie import Namespace
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobHandle, Skeleton, TrieNode, kv_pairs

log = logging.getLogger(__name__)

__all__ = ["Ingestor"]


class Ingestor:
    """Writes chunks (see the module docstring); the evictor makes room and bounds the store."""

    def __init__(self, ctx: ManagerContext, evictor: Evictor, index: Optional[SharedIndex] = None) -> None:
        self.ctx = ctx
        self.evictor = evictor
        self.index = index if index is not None else SharedIndex.off(ctx)

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
        ctx = self.ctx
        forest = ctx.forest
        found = self.index.child(ns, parent, action) if self.index.keys_as(parent, action, node_key) else None
        if found is not None:  # another process committed it meanwhile
            ctx.metrics.add(reingest_kept=1)
            forest.touch(ns)
            return found
        with forest.lock:  # one hold from commit to placeholder: a prune never takes the node between
            node = forest.commit(ns, parent, action, node_key, depth)
            forest.touch(ns)
            if not node.state.vacant:  # ready, being written, freed or invalidated: kept
                ctx.metrics.add(reingest_kept=1)
                return node
            if n_layers is not None and n_layers != len(kv_payload):
                raise ValueError(f"n_layers={n_layers} but kv_payload has {len(kv_payload)} layers")
            if depth < ctx.cfg.sink_chunks:
                node.pinned = True
            locator = kv_locator(node_key)
            placeholder = BlobHandle(ctx.cfg.commit_tier, locator, nbytes, len(kv_payload),
                                     pairs=kv_pairs(kv_payload))
            node.blob = placeholder  # PENDING: kept by concurrent ingests, skipped by eviction
        need = (nbytes or sum(layer_nbytes(layer) for layer in kv_payload)) + payload_nbytes(latent)
        t0 = time.perf_counter()

        def on_ready(handle: Optional[BlobHandle] = None) -> None:
            # The publication bit of a write (docs/api.md): set here, from the store's completion
            # callback, whether or not the store already set it. A store written for upstream
            # CacheSeek returns no handle and calls ``on_ready()``: the placeholder is its handle.
            if handle is None:
                handle = placeholder
            self.index.publish(ns, node, handle, payload_nbytes(latent))  # the shared commit point: last
            with forest.lock:
                if handle.error is None:
                    handle.ready = True
                node.last_access = ctx.clock()
            ctx.metrics.record_transfer("write", ctx.offers.label, handle.nbytes or nbytes,
                                        time.perf_counter() - t0)

        try:
            lat_loc = latent_locator(node_key)
            self.with_room(lambda: ctx.store.put_skeleton(lat_loc, latent), need)
            with forest.lock:
                node.skeleton = Skeleton(lat_loc)
            handle = self.with_room(
                lambda: ctx.store.put_async(locator, kv_payload, tier=ctx.cfg.commit_tier,
                                            on_ready=on_ready),
                need,
            )
            if handle is None:
                handle = placeholder
        except BaseException as exc:
            with forest.lock:
                if node.blob is placeholder:
                    node.blob = None
            if isinstance(exc, StoreError):
                ctx.metrics.add(dropped_writes=1)
            raise
        with forest.lock:
            if node.blob is placeholder:
                node.blob = handle
            if nbytes and not handle.nbytes:
                handle.nbytes = nbytes
        self.evictor.maybe_evict(protect=node)
        return node

    def with_room(self, write: Callable[[], Any], need: int) -> Any:
        """Run ``write``; on `StoreFullError` make room for ``need`` bytes (an eviction pass down
        to the low watermark, evicting at least one blob) and retry once."""
        ctx = self.ctx
        try:
            return write()
        except StoreFullError as exc:
            u = store_usage(ctx.store)
            if not ctx.eviction.enabled or u is None or u.capacity_bytes is None:
                raise
            log.info("store full (%s): evicting, then retrying once", exc)
            ctx.metrics.add(store_full_retries=1)
            target = min(int(ctx.eviction.low_watermark * u.capacity_bytes), u.capacity_bytes - need)
            self.evictor.evict(max(target, 0), at_least_one=True)
            return write()
