"""`WorldKVManager`: decides what to restore, what to keep and what to evict; moves no bytes itself.

Read side (`try_fast_forward`, `find`, `restore_chunk`): the longest ready prefix of a session's
actions (the local trie, then the store's chunk records past its end: `SharedIndex`), refused
below break-even, restored by the `Restorer` (`restore`). When the restore finds values gone (the
stale nodes are invalidated by then) or the path changed under it, the longest shorter prefix
that ends before the first broken node is retried, down to break-even, instead of running cold.
Any other failure (a store error, a layout mismatch, a bug) runs the session cold and leaves the
trie as it was: a cache must never take a session down. A live session is restored one chunk at
a time (`restore_chunk`) while it follows a cached path.

Write side (`ingest`): the node is committed and claimed with a *pending* placeholder handle (so
a concurrent ingest of the same chunk keeps it and eviction skips it); the latent is stored,
then the KV is written asynchronously; the store's completion callback publishes the handle
(`BlobHandle.publish`, set last), right after the chunk's record is published to the store
(`SharedIndex.publish`: other processes find it from then on). A chunk another process has
committed meanwhile is adopted instead of written again. Re-ingesting a ready, in-flight or
being-evicted node keeps it. A write that reports `StoreFullError` makes room (an eviction pass)
and is retried once; a second refusal drops the write (counted) and raises. A failed write leaves
the handle unready with ``error`` set: never a hit, and a later ingest replaces it.

Capacity (`capacity`): after every ingest, and after a hit that a tiered store promoted into its
top level, the levels above their high watermark are demoted (`Demoter`) and a bounded store
evicts down to its low watermark (`Evictor`). The `Invalidator` drops the nodes whose values the
store lost; `frames` (`ChunkFrames`) keeps each chunk's handed-out frames beside its KV.

Thread-safe through the forest's lock, held only to choose and claim; every store call runs
outside it. Locks, outermost first: ``evict_lock`` (one eviction or demotion pass at a time), the
forest's ``lock``. Metrics: one `CacheMetrics` (pass a shared one to aggregate managers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.errors import CacheSeekError, ConfigError, StoreError, StoreFullError
from cacheseek.eviction import EvictionConfig, make_policy, store_usage
from cacheseek.kv.payload import layer_nbytes, payload_nbytes
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.capacity import Demoter, Evictor
from cacheseek.reuse.exact_prefix.config import SharedIndexConfig, WorldKVConfig
from cacheseek.reuse.exact_prefix.encodes import StoredEncodes
from cacheseek.reuse.exact_prefix.frames import ChunkFrames
from cacheseek.reuse.exact_prefix.invalidation import Invalidator
from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator
from cacheseek.reuse.exact_prefix.restore import Outcome, Restorer, RestoreWindow, as_window
from cacheseek.reuse.exact_prefix.shared_index import SharedIndex
from cacheseek.reuse.exact_prefix.trie import Namespace, NamespaceForest, PrefixMatch
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobHandle, FastForwardResult, Skeleton, TrieNode, kv_pairs
from cacheseek.stores.base import TierStore, as_store

log = logging.getLogger(__name__)

__all__ = ["WorldKVManager", "RestoreWindow", "cold"]


class WorldKVManager:
    """Trie bookkeeping over one store (see the module docstring).

    ``store``: a `TierStore`, or a caller's own object with its calls (`as_store`).
    ``eviction``: an `EvictionConfig` (or a mapping with its fields; default LRU, 0.9/0.7).
    ``metrics``: a `CacheMetrics` to report into (default: a new one). ``clock``: the time
    source of ``last_access`` and the usage timeline (default ``time.monotonic``).
    ``shared_index``: a `SharedIndexConfig` (or a mapping of its fields; default on, 8 keys a
    probe): lookups continue past the local trie in the store's chunk records.
    ``frames_in_flight``, ``decoder_states_in_flight``: the frames and the decoder states the
    store's writer may hold at once, written off the request path; one more is dropped
    (counted); 0 writes them in the caller's thread (`beside_chunk`)."""

    def __init__(self, forest: NamespaceForest, store: Any, cfg: WorldKVConfig, *,
                 clock: Optional[Callable[[], float]] = None, eviction: Any = None,
                 metrics: Optional[CacheMetrics] = None, shared_index: Any = None, frames_in_flight: int = 8,
                 decoder_states_in_flight: int = 1) -> None:
        self.beside_in_flight = {  # per `beside_chunk.BesideKind.kind`
            "frames": in_flight("manager.frames_in_flight", frames_in_flight),
            "decoder_state": in_flight("manager.decoder_states_in_flight", decoder_states_in_flight)}
        self.forest = forest
        self.store = store
        self.cfg = cfg
        self.clock = clock or time.monotonic
        self.eviction = eviction if isinstance(eviction, EvictionConfig) else EvictionConfig.from_conf(eviction)
        self.policy = make_policy(self.eviction.policy)
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.metrics.bind_store(self.store)
        self.evict_lock = threading.Lock()
        self.index = SharedIndex(self, SharedIndexConfig.from_conf(shared_index))
        self.invalidator = Invalidator(self)
        self.restorer = Restorer(self)
        self.demoter = Demoter(self)
        self.evictor = Evictor(self, self.demoter)
        self.frames = ChunkFrames(self)
        self.encodes = StoredEncodes(self)

    @property
    def store(self) -> TierStore:
        return self._store

    @store.setter
    def store(self, store: Any) -> None:
        self._store = as_store(store)

    # -- read side ------------------------------------------------------------------------------
    def try_fast_forward(self, root_hash: bytes, actions: Sequence[ActionKey],
                         window: RestoreWindow) -> FastForwardResult:
        self.metrics.add(prefix_lookups=1)
        self.forest.begin_session(root_hash)
        requested = limit = len(actions)
        while True:
            match = self.index.extend(self.forest.lookup(root_hash, actions[:limit]), actions, limit)
            if not self._worth_restoring(match):
                return cold(match.namespace)
            outcome = self._restore(match.node, window, match.matched_len)
            if outcome is not None and outcome.ok:
                self.metrics.record_hit(match.matched_len, requested, outcome.tier)
                self._after_hit(match.node)
                return FastForwardResult(match.matched_len, match.node, match.namespace)
            if outcome is None or not outcome.retryable:
                self.metrics.add(restore_failures=1)
                return cold(match.namespace)
            limit = outcome.retry_limit(match.matched_len)
            self.metrics.add(restore_retries=1)
            log.info("restore of depth %d found %s; retrying depth <= %d", match.matched_len,
                     f"{len(outcome.missing)} stale nodes" if outcome.missing else "the path changed", limit)

    def find(self, root_hash: bytes, actions: Sequence[ActionKey]) -> FastForwardResult:
        """The longest ready prefix of ``actions`` (the local trie, then the store's records),
        counted as a lookup and a hit or miss like `try_fast_forward`, but restoring nothing: a
        session that hands out its chunks' stored frames (`handout.HandOut`) restores the KV only
        where it computes, and a prefix found gone then is computed again."""
        self.metrics.add(prefix_lookups=1)
        self.forest.begin_session(root_hash)
        match = self.index.extend(self.forest.lookup(root_hash, actions), actions, len(actions))
        if not self._worth_restoring(match):
            return cold(match.namespace)
        self.metrics.record_hit(match.matched_len, len(actions))
        return FastForwardResult(match.matched_len, match.node, match.namespace)

    def restore_chunk(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore ``node`` alone, the next chunk of a live session on a cached path; whether the
        window published it (its ``published``). A miss (values found gone: invalidated, as for
        any restore) is ``live_misses``; a failure ``live_restore_failures``; either leaves the
        runtime as it was, and the chunk is computed. A failure after publication (releasing
        the references, the counters) does not unpublish: the chunk counts as restored. Never
        raises for a store's or the window's failure."""
        window = as_window(window)
        outcome = self._restore(node, window, node.depth + 1, chunk_only=True)
        if window.published if window.published is not None else outcome is not None and outcome.ok:
            self.metrics.record_live_hit(node.depth, outcome.tier if outcome is not None else None)
            self._after_hit(node)
            return True
        self.metrics.add(**{"live_misses" if outcome is not None else "live_restore_failures": 1})
        return False

    def materialize(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore the window path ending at ``node`` into ``window``; False when the path is not
        whole (nodes found without their values are invalidated). Raises on store errors."""
        return self.restorer.restore(node, window).ok

    def _worth_restoring(self, match: PrefixMatch) -> bool:
        """Whether a lookup's ``match`` is a hit: something matched, at least ``break_even_k``
        chunks deep; otherwise it counts as a miss or below break-even."""
        if match.namespace is None or match.matched_len == 0 or match.node is None:
            self.metrics.add(misses=1)
            return False
        if match.matched_len < self.cfg.break_even_k:
            self.metrics.add(below_break_even=1)
            return False
        return True

    def _restore(self, node: TrieNode, window: RestoreWindow, matched_len: int, *,
                 chunk_only: bool = False) -> Optional[Outcome]:
        """The restore's outcome, or None when it raised (logged)."""
        try:
            return self.restorer.restore(node, window, chunk_only=chunk_only)
        except CacheSeekError as exc:
            log.warning("restore of depth %d failed, running cold: %s", matched_len, exc)
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("restore of depth %d failed unexpectedly, running cold", matched_len)
        return None

    def _after_hit(self, node: TrieNode) -> None:
        """A tiered store that promoted the path it served into its top level may have filled it:
        a demotion pass (``node``'s path protected). Any other hit writes nothing."""
        if self.store.promoted_last_read():
            self.demoter.demote_tiers(protect=node)

    # -- write side -----------------------------------------------------------------------------
    def ingest(self, ns: Namespace, parent: TrieNode, action: ActionKey, node_key: bytes, depth: int,
               kv_payload: Sequence[Any], latent: Any, *, nbytes: int = 0, n_layers: Optional[int] = None) -> TrieNode:
        """Write one finished chunk (see the module docstring and docs/api.md)."""
        forest, store = self.forest, self.store
        found = self.index.child(ns, parent, action) if self.index.keys_as(parent, action, node_key) else None
        if found is not None:  # another process committed it meanwhile
            self.metrics.add(reingest_kept=1)
            forest.touch(ns)
            return found
        with forest.lock:  # one hold from commit to placeholder: a prune never takes the node between
            node = forest.commit(ns, parent, action, node_key, depth)
            forest.touch(ns)
            if not node.state.vacant:  # ready, being written, freed or invalidated: kept
                self.metrics.add(reingest_kept=1)
                return node
            if n_layers is not None and n_layers != len(kv_payload):
                raise ValueError(f"n_layers={n_layers} but kv_payload has {len(kv_payload)} layers")
            if depth < self.cfg.sink_chunks:
                node.pinned = True
            locator = kv_locator(node_key)
            placeholder = BlobHandle(self.cfg.commit_tier, locator, nbytes, len(kv_payload),
                                     pairs=kv_pairs(kv_payload))
            node.blob = placeholder  # PENDING: kept by concurrent ingests, skipped by eviction
        need = (nbytes or sum(layer_nbytes(layer) for layer in kv_payload)) + payload_nbytes(latent)
        t0 = time.perf_counter()

        def on_ready(handle: Optional[BlobHandle] = None) -> None:
            # The publication bit of a write (docs/api.md): set here, from the store's completion
            # callback. A store written for upstream CacheSeek returns no handle and calls
            # ``on_ready()``: the placeholder is its handle.
            if handle is None:
                handle = placeholder
            self.index.publish(ns, node, handle, payload_nbytes(latent))  # the shared commit point: last
            with forest.lock:
                handle.publish()
                node.last_access = self.clock()
            self.metrics.record_transfer("write", store.label, handle.nbytes or nbytes, time.perf_counter() - t0)

        try:
            lat_loc = latent_locator(node_key)
            self.with_room(lambda: store.put_skeleton(lat_loc, latent), need)
            with forest.lock:
                node.skeleton = Skeleton(lat_loc)
            handle = self.with_room(
                lambda: store.put_async(locator, kv_payload, tier=self.cfg.commit_tier, on_ready=on_ready), need)
            if handle is None:
                handle = placeholder
        except BaseException as exc:
            with forest.lock:
                if node.blob is placeholder:
                    node.blob = None
            if isinstance(exc, StoreError):
                self.metrics.add(dropped_writes=1)
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
        try:
            return write()
        except StoreFullError as exc:
            u = store_usage(self.store)
            if not self.eviction.enabled or u is None or u.capacity_bytes is None:
                raise
            log.info("store full (%s): evicting, then retrying once", exc)
            self.metrics.add(store_full_retries=1)
            target = min(int(self.eviction.low_watermark * u.capacity_bytes), u.capacity_bytes - need)
            self.evictor.evict(max(target, 0), at_least_one=True)
            return write()

    # -- keeping the trie honest, and bounded ----------------------------------------------------
    def audit(self) -> int:
        """Invalidate every ready node whose values the store no longer holds (`Invalidator.audit`)."""
        return self.invalidator.audit()

    def reconcile(self) -> dict[str, int]:
        """Once, before sessions start: remove the values no node names, then `audit`
        (`Invalidator.reconcile`). Returns ``{"orphans_removed": n, "invalidated": m}``."""
        return self.invalidator.reconcile()

    def evict_blob(self, node: TrieNode) -> bool:
        """`Evictor.evict_blob` honouring every pin (docs/api.md)."""
        return self.evictor.evict_blob(node, honour_pins=True)


def in_flight(field: str, value: Any) -> int:
    """``value`` checked as a bound of values written off the request path (an int >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, f"must be an integer >= 0, got {value!r}",
                          f"{field}=1 (one value in flight; 0 writes it on the request path)")
    return value


def cold(namespace: Optional[Namespace]) -> FastForwardResult:
    """Run from chunk 0; ``node`` is the namespace's virtual root (the parent of chunk 0's
    ingest, as upstream returns it), None on a namespace miss."""
    return FastForwardResult(0, namespace.root if namespace is not None else None, namespace)
