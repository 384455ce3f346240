"""`WorldKVManager`: decides what to restore, what to keep and what to evict; moves no bytes itself.

Read side: `try_fast_forward` looks up the longest ready prefix, and restores the window path
ending at that node. Nothing is published (the window's ``set_resume_depth`` is the single
publication point) until every input has been fetched and copied. Path nodes are referenced
(``ref_count``) while being read, so eviction cannot take them; the lookup, the wholeness check
and the references are taken under one hold of the forest lock.

Consistency with the store: when a restore finds values missing (the store evicted them, a
worker restarted with an old snapshot), the nodes whose values are gone are *invalidated*: their
blob is dropped and whatever is left of its values is freed (so a later cold run re-ingests them,
skeleton included). The restore then retries the longest shorter prefix that is still whole,
down to break-even, instead of running cold. Which nodes are gone: the first missing value a
generic fetch meets, plus every node the store's optional ``contains(keys)`` reports; for a
`PathReadStore` whose ``read_path`` returned False, ``contains`` alone (without it the session
runs cold, as before). A corrupt value (checksum mismatch, truncated file) is a missing value:
the generic tiers read it as None, and a store that raises `CorruptValueError` instead has the
node owning that key invalidated the same way. Any other store error or a layout mismatch is not
a missing value: the session runs cold and the trie is left as it was. A node that another
restore still references is never freed under it: its invalidation is deferred to the last
release (`TrieNode.invalidated`), and it stops being a hit at once.

Two store paths, chosen by capability:

- generic `TierStore`: latents via ``get_skeleton``, then every window layer via ``get_layer``;
  all of it is fetched before the first ``seed_layer`` call;
- `PathReadStore` (and a window that offers ``restore_target``): the store restores the whole
  window path into the runtime's buffers itself (``read_path``).

Write side: `ingest` commits the node, claims it with a pending placeholder handle (so a
concurrent ingest of the same chunk keeps it, and eviction skips it), stores the latent skeleton,
writes the KV and lets the store's completion callback flip the handle ready. Re-ingesting a
ready, in-flight or being-evicted node keeps it. A write that reports `StoreFullError` makes room
(an eviction pass) and is retried once; a second refusal drops the write (counted).

Capacity (`cacheseek.eviction`): after every ingest, when the store's usage is above the high
watermark, an eviction pass frees victims chosen by the policy (leaf-first LRU by default) until
usage is at or below the low watermark. A pass first reclaims the latents of dead subtrees (no
blob anywhere below; only where the store offers ``free_skeleton``), then evicts KV blobs. Sink
(pinned) nodes of live namespaces (touched by one of the last ``eviction.live_sessions``
sessions: `NamespaceForest.is_live`), nodes being read and writes in flight are never victims;
the sinks of dead namespaces are ordinary LRU victims, so pins never fill the store; evicted nodes keep their
skeletons. The forest lock is held only to choose and claim; every store call runs outside it.

Tiers (a store offering ``tier_usages``, ``levels_of`` and ``demote``: `TieredStore`): after every
ingest and every hit, each level but the last whose usage is above the high watermark *demotes*
victims down to the low watermark, chosen by the same policy among the nodes held at that level,
leaf-first within the level (no child held there): the store keeps (or first writes) a copy
below, then frees that level's. The last level is bounded by the ordinary eviction above.

Metrics: one `CacheMetrics` (``self.metrics``; pass a shared one to aggregate several managers).
The legacy ``stats`` dict is kept for callers that read it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import (
    CacheSeekError,
    CorruptValueError,
    HandleStateError,
    StoreError,
    StoreFullError,
    WriteNotCompleteError,
)
from cacheseek.eviction import Candidate, EvictionConfig, make_policy, store_usage
from cacheseek.kv.payload import layer_nbytes, payload_nbytes
from cacheseek.metrics import CacheMetrics
from cacheseek.reuse.exact_prefix.config import WorldKVConfig
from cacheseek.reuse.exact_prefix.keys import blob_keys, kv_locator, latent_locator, layer_keys
from cacheseek.reuse.exact_prefix.trie import Namespace, NamespaceForest
from cacheseek.reuse.exact_prefix.types import (
    ActionKey,
    BlobHandle,
    BlobState,
    FastForwardResult,
    Skeleton,
    TrieNode,
    kv_pairs,
)

log = logging.getLogger(__name__)

__all__ = ["WorldKVManager", "RestoreWindow"]


class RestoreWindow(Protocol):
    """What `materialize` seeds. ``blobs`` is ``[(chunk_depth, layer_payload), ...]`` oldest first
    (``(k, v)`` from the binding, any object a generic tier stored). ``depth`` in both calls is the
    trie depth of the deepest restored node, ``node.depth`` = K-1 for K restored chunks (as
    upstream CacheSeek passes it); the runtime resumes at chunk ``depth + 1``."""

    def seed_layer(self, layer: int, blobs: list[tuple[int, Any]], depth: int) -> None: ...

    def set_resume_depth(self, depth: int) -> None: ...


@attrs.frozen(slots=True)
class _Outcome:
    """One restore attempt: ``ok``; else ``missing`` (nodes whose values are gone; empty when the
    store cannot say) or ``not_whole`` (the trie changed under us: a path node lost its blob)."""

    ok: bool
    missing: tuple[TrieNode, ...] = ()
    not_whole: bool = False


_OK = _Outcome(True)
_NOT_WHOLE = _Outcome(False, not_whole=True)


class WorldKVManager:
    """Trie bookkeeping over one store. Thread-safe through the forest's lock.

    ``eviction``: an `EvictionConfig` (or a mapping with its fields; default LRU, 0.9/0.7).
    ``metrics``: a `CacheMetrics` to report into (default: a new one). ``clock``: the time
    source of ``last_access`` and the usage timeline (default ``time.monotonic``)."""

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
        self.forest = forest
        self.store = store
        self.cfg = cfg
        self.clock = clock or time.monotonic
        if not isinstance(eviction, EvictionConfig):
            eviction = EvictionConfig.from_conf(eviction)
        self.eviction = eviction
        self.policy = make_policy(eviction.policy)
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.metrics.bind_store(store)
        self.stats: dict[str, int] = {
            "lookups": 0, "hits": 0, "misses": 0, "below_break_even": 0,
            "restore_failures": 0, "ingests": 0, "reingest_kept": 0, "evictions": 0,
            "invalidations": 0, "restore_retries": 0, "dropped_writes": 0,
        }
        self._stats_lock = threading.Lock()
        self._evict_lock = threading.Lock()

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    # -- read side ----------------------------------------------------------------------------

    def try_fast_forward(
        self, root_hash: bytes, actions: Sequence[ActionKey], window: RestoreWindow
    ) -> FastForwardResult:
        self._count("lookups")
        self.metrics.add(lookups=1)
        self.forest.begin_session(root_hash)
        requested = len(actions)
        limit = requested
        while True:
            match = self.forest.lookup(root_hash, actions[:limit])
            if match.namespace is None or match.matched_len == 0 or match.node is None:
                self._count("misses")
                self.metrics.add(misses=1)
                return _cold(match.namespace)
            if match.matched_len < self.cfg.break_even_k:
                self._count("below_break_even")
                self.metrics.add(below_break_even=1)
                return _cold(match.namespace)
            try:
                outcome = self._materialize(match.node, window)
            except CacheSeekError as exc:
                log.warning("restore of depth %d failed, running cold: %s", match.matched_len, exc)
                outcome = None
            except Exception:  # noqa: BLE001 - a cache must never take a session down
                log.exception("restore of depth %d failed unexpectedly, running cold", match.matched_len)
                outcome = None
            if outcome is not None and outcome.ok:
                self._count("hits")
                self.metrics.record_hit(match.matched_len, requested)
                self._demote_tiers()  # a promotion may have filled the top tier
                return FastForwardResult(match.matched_len, match.node, match.namespace)
            if outcome is None or not (outcome.missing or outcome.not_whole):
                self._count("restore_failures")
                self.metrics.add(restore_failures=1)
                return _cold(match.namespace)
            # Values gone (invalidated by _materialize) or the path lost a blob meanwhile: retry
            # the longest prefix shorter than the first broken node.
            broken = [n.depth for n in outcome.missing] or [match.matched_len - 1]
            limit = min(min(broken), match.matched_len - 1)
            self._count("restore_retries")
            self.metrics.add(restore_retries=1)
            log.info("restore of depth %d found %s; retrying depth <= %d", match.matched_len,
                     f"{len(outcome.missing)} stale nodes" if outcome.missing else "the path changed", limit)

    def window_path(self, node: TrieNode) -> list[TrieNode]:
        path = node.path()
        depths = set(self.cfg.window_depths(len(path)))
        return [n for n in path if n.depth in depths]

    def materialize(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore the window path ending at ``node`` into ``window``; False when the path is not
        whole (nodes found without their values are invalidated). Raises on store errors."""
        return self._materialize(node, window).ok

    def _materialize(self, node: TrieNode, window: RestoreWindow) -> _Outcome:
        path = node.path()
        win = self.window_path(node)
        with self.forest.lock:
            if not all(n.has_kv for n in win) or not all(n.skeleton is not None for n in path):
                return _NOT_WHOLE
            for n in path:
                n.ref_count += 1
        missing: tuple[TrieNode, ...] = ()
        try:
            t0 = time.perf_counter()
            try:
                if _is_path_store(self.store) and hasattr(window, "restore_target"):
                    target = window.restore_target(len(path), [n.depth for n in win])
                    if not self.store.read_path(path, win, target):
                        missing = self._find_missing(path, win, None)
                        return _Outcome(False, missing)
                    nbytes = int(getattr(window, "bytes_restored", 0) or 0)
                else:
                    fetched = self._fetch_generic(path, win, window)
                    if isinstance(fetched, _Outcome):
                        missing = fetched.missing
                        return fetched
                    nbytes = int(getattr(window, "bytes_restored", 0) or 0) or fetched
            except CorruptValueError as exc:
                # A store that raises on a corrupt value instead of reading it as missing: the same miss.
                log.warning("restore of depth %d met %s", len(path), exc)
                missing = self._find_missing(path, win, _owner_of(exc.key, path, win))
                return _Outcome(False, missing)
            window.set_resume_depth(node.depth)
            now = self.clock()
            with self.forest.lock:
                for n in path:
                    n.last_access = now
            self.metrics.add(restores=1, restore_bytes=nbytes,
                             restore_seconds=time.perf_counter() - t0)
            return _OK
        finally:
            self._release(path, missing)

    def _release(self, path: Sequence[TrieNode], missing: Sequence[TrieNode]) -> None:
        """Drop a restore's references; invalidate what it found gone, then free the blobs whose
        invalidation waited for their last reader (this one)."""
        settle: list[TrieNode] = []
        with self.forest.lock:
            for n in path:
                if n.ref_count <= 0:
                    raise HandleStateError(f"ref_count of {n!r} would go below zero")
            for n in path:
                n.ref_count -= 1
                if n.ref_count == 0 and n.invalidated:
                    settle.append(n)
        if missing:
            self._invalidate(missing)
        for n in settle:
            self._free_invalidated(n)

    def _fetch_generic(
        self, path: list[TrieNode], win: list[TrieNode], window: RestoreWindow
    ) -> "int | _Outcome":
        """Fetch every latent and window layer, then seed; bytes fetched, or a miss `_Outcome`."""
        latents = []
        nbytes = 0
        for n in path:
            latent = self.store.get_skeleton(n.skeleton.latent_locator)
            if latent is None:
                log.info("latent of depth %d missing", n.depth)
                return _Outcome(False, self._find_missing(path, win, n))
            latents.append(latent)
            nbytes += payload_nbytes(latent)
        n_layers = {n.blob.n_layers for n in win}
        if len(n_layers) != 1:
            return _Outcome(False)
        per_layer: list[list[tuple[int, Any]]] = []
        for layer in range(n_layers.pop()):
            blobs = []
            for n in win:
                kv = self.store.get_layer(n.blob, layer)
                if kv is None or (n.blob.pairs and (kv[0] is None or kv[1] is None)):
                    log.info("layer %d of depth %d missing", layer, n.depth)
                    return _Outcome(False, self._find_missing(path, win, n))
                blobs.append((n.depth, kv))
                nbytes += layer_nbytes(kv)
            per_layer.append(blobs)
        if hasattr(window, "seed_latents"):
            window.seed_latents(latents)
        for layer, blobs in enumerate(per_layer):
            window.seed_layer(layer, blobs, path[-1].depth)
        return nbytes

    def _find_missing(
        self, path: list[TrieNode], win: list[TrieNode], first: Optional[TrieNode]
    ) -> tuple[TrieNode, ...]:
        """The nodes of ``path`` whose latent or (window nodes) KV values are gone: ``first`` (the
        one a fetch met) plus every node the store's ``contains`` reports missing."""
        found: dict[int, TrieNode] = {} if first is None else {id(first): first}
        contains = getattr(self.store, "contains", None)
        if callable(contains):
            owners: list[TrieNode] = []
            keys: list[str] = []
            for n in path:
                if n.skeleton is not None:
                    owners.append(n)
                    keys.append(n.skeleton.latent_locator)
            for n in win:
                blob = n.blob
                if blob is None:
                    continue
                for key in blob_keys(blob.locator, blob.n_layers, pairs=blob.pairs):
                    owners.append(n)
                    keys.append(key)
            try:
                present = contains(keys)
            except Exception as exc:  # noqa: BLE001 - cannot tell: only what the fetch saw
                log.warning("could not check which values are missing: %s", exc)
                present = [True] * len(keys)
            for n, ok in zip(owners, present):
                if not ok:
                    found[id(n)] = n
        return tuple(sorted(found.values(), key=lambda n: n.depth))

    def _invalidate(self, nodes: Sequence[TrieNode]) -> int:
        """Drop the blobs of nodes whose values are (partly) gone or corrupt and free what is left
        of them, so no value is orphaned and a later ingest rewrites the chunk. Returns how many.

        A node another restore still references (``ref_count > 0``) is not freed under its
        reader: its blob stops being a hit at once (marked failed; ``invalidated`` and
        ``evicting`` set, so no lookup, eviction or re-ingest touches it) and is freed by the
        last reader's release (`_release`)."""
        count = 0
        for node in nodes:
            with self.forest.lock:
                handle = node.blob
                if handle is None or node.evicting or handle.in_flight:
                    continue
                if node.ref_count > 0:
                    node.invalidated = True
                    node.evicting = True
                    handle.ready = False
                    handle.error = StoreError(f"{handle.locator}: invalidated (its values are gone)")
                    count += 1
                    log.info("invalidated %r; freeing it when its last reader releases it", node)
                    continue
                node.blob = None
                node.evicting = True
            self._free_detached(node, handle)
            count += 1
            log.info("invalidated %r: its values are no longer in the store", node)
        if count:
            self._count("invalidations", count)
            self.metrics.add(invalidations=count)
        return count

    def _free_invalidated(self, node: TrieNode) -> None:
        """Free the blob of a node invalidated while referenced, once nothing references it."""
        with self.forest.lock:
            if not node.invalidated or node.ref_count > 0:
                return
            node.invalidated = False
            handle = node.blob
            node.blob = None
        if handle is None:
            with self.forest.lock:
                node.evicting = False
            return
        self._free_detached(node, handle)

    def _free_detached(self, node: TrieNode, handle: BlobHandle) -> None:
        """Free a blob detached from ``node`` (``node.evicting`` set by the caller; cleared here).
        A failed free keeps the handle on the node as a failed blob, freed again later."""
        try:
            self.store.free(handle)
        except Exception as exc:  # noqa: BLE001 - keep it as a failed blob: freed later
            log.warning("invalidated %r but freeing its values failed: %s", node, exc)
            handle.ready = False
            handle.error = exc
            with self.forest.lock:
                if node.blob is None:
                    node.blob = handle
        finally:
            with self.forest.lock:
                node.evicting = False

    def audit(self) -> int:
        """Check every ready node's latent and KV values against the store (its ``contains``)
        and invalidate the nodes whose values are gone, e.g. after a worker restart. Returns the
        number invalidated; 0 when the store cannot say (no ``contains``)."""
        if not callable(getattr(self.store, "contains", None)):
            return 0
        with self.forest.lock:
            ready = [n for ns in self.forest.namespaces() for n in ns.iter_nodes() if n.has_kv]
        stale = [n for n in ready if self._find_missing([n], [n], None)]
        return self._invalidate(stale)

    def reconcile(self) -> dict[str, int]:
        """Make the store and this forest agree, once, before sessions start (after loading a
        snapshot, or on a fresh forest over a persistent store): remove every value no node names
        (where the store can list and remove values: ``keys()`` and ``delete_values(keys)``), so
        a reopened store does not count a previous process's unreachable files; then `audit`.
        Returns ``{"orphans_removed": n, "invalidated": m}``. Not for use while sessions write:
        a value written but not yet named by its node would be taken for an orphan."""
        keys_of = getattr(self.store, "keys", None)
        delete = getattr(self.store, "delete_values", None)
        removed = 0
        if callable(keys_of) and callable(delete):
            with self.forest.lock:
                named: set[str] = set()
                for ns in self.forest.namespaces():
                    for n in ns.iter_nodes():
                        if n.skeleton is not None:
                            named.add(n.skeleton.latent_locator)
                        if n.blob is not None:
                            named.update(blob_keys(n.blob.locator, n.blob.n_layers, pairs=n.blob.pairs))
            orphans = [k for k in keys_of() if k not in named]
            if orphans:
                delete(orphans)
                removed = len(orphans)
                log.info("reconcile: removed %d values no node names", removed)
        return {"orphans_removed": removed, "invalidated": self.audit()}

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
        node = self.forest.commit(ns, parent, action, node_key, depth)
        self.forest.touch(ns)
        with self.forest.lock:
            if node.has_kv or (node.blob is not None and node.blob.in_flight) or node.evicting:
                self._count("reingest_kept")
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
            # callback, whether or not the store already set it. A store written for upstream
            # CacheSeek returns no handle and calls ``on_ready()``: the placeholder is its handle.
            if handle is None:
                handle = placeholder
            with self.forest.lock:
                if handle.error is None:
                    handle.ready = True
                node.last_access = self.clock()
            self.metrics.add(writes=1, write_bytes=handle.nbytes or nbytes,
                             write_seconds=time.perf_counter() - t0)

        try:
            lat_loc = latent_locator(node_key)
            self._with_room(lambda: self.store.put_skeleton(lat_loc, latent), need)
            with self.forest.lock:
                node.skeleton = Skeleton(lat_loc)
            handle = self._with_room(
                lambda: self.store.put_async(locator, kv_payload, tier=self.cfg.commit_tier,
                                             on_ready=on_ready),
                need,
            )
            if handle is None:
                handle = placeholder
        except BaseException as exc:
            with self.forest.lock:
                if node.blob is placeholder:
                    node.blob = None
            if isinstance(exc, StoreError):
                self._count("dropped_writes")
                self.metrics.add(dropped_writes=1)
            raise
        with self.forest.lock:
            # A failed write leaves the handle unready with ``error`` set: never a hit, and a
            # later ingest of the same chunk replaces it.
            if node.blob is placeholder:
                node.blob = handle
            if nbytes and not handle.nbytes:
                handle.nbytes = nbytes
        self._count("ingests")
        self.maybe_evict()
        return node

    def _with_room(self, write: Callable[[], Any], need: int) -> Any:
        """Run ``write``; on `StoreFullError` make room (an eviction pass) and retry once."""
        try:
            return write()
        except StoreFullError as exc:
            u = store_usage(self.store)
            if not self.eviction.enabled or u is None or u.capacity_bytes is None:
                raise
            log.info("store full (%s): evicting, then retrying once", exc)
            self.metrics.add(store_full_retries=1)
            target = min(int(self.eviction.low_watermark * u.capacity_bytes), u.capacity_bytes - need)
            self.evict(max(target, 0), at_least_one=True)
            return write()

    # -- capacity -----------------------------------------------------------------------------

    def maybe_evict(self) -> int:
        """After a write: when the store's usage is above the high watermark, evict down to the
        low watermark. Returns the number of blobs evicted (0 when the store is unbounded)."""
        self._demote_tiers()
        u = store_usage(self.store)
        if u is None:
            return 0
        self.metrics.observe_usage(self.clock(), u.used_bytes, u.capacity_bytes, "write")
        if not self.eviction.enabled or u.capacity_bytes is None:
            return 0
        if u.used_bytes <= self.eviction.high_watermark * u.capacity_bytes:
            return 0
        return self.evict(int(self.eviction.low_watermark * u.capacity_bytes))

    def evict(self, target_bytes: int, *, at_least_one: bool = False) -> int:
        """One eviction pass: reclaim dead latents, then evict leaf blobs in the policy's order
        until the store's usage is at or below ``target_bytes`` (or nothing is evictable). A
        parent that becomes a leaf joins the queue; a victim's latent (and its dead ancestors')
        is reclaimed right after it, while usage is still above the target. ``at_least_one``:
        evict one blob even when already below the target (a full store refused a write).
        Errors of single victims are logged and counted, not raised. Returns blobs evicted."""
        evicted = 0
        latents = callable(getattr(self.store, "free_skeleton", None))

        def above() -> bool:
            u = store_usage(self.store)
            return u is not None and u.used_bytes > target_bytes

        with self._evict_lock:
            self.metrics.add(eviction_passes=1)
            force = at_least_one
            if force or above():
                dead, candidates = self._collect()
                for node in dead if latents else ():
                    if not force and not above():
                        break
                    self._free_dead_skeleton(node)
                queue = self.policy.order(candidates)
                while queue and (force or above()):
                    cand = queue.pop(0)
                    try:
                        done = self._evict_blob(cand.node, honour_pins=False)
                    except Exception as exc:  # noqa: BLE001 - the blob is kept; try the next
                        log.warning("eviction of %r failed (kept): %s", cand.node, exc)
                        self.metrics.add(eviction_errors=1)
                        continue
                    if not done:
                        continue
                    evicted += 1
                    force = False
                    for node in self._dead_around(cand.node) if latents else ():
                        if not above():
                            break
                        self._free_dead_skeleton(node)
                    parent = self._candidate(cand.node.parent)
                    if parent is not None:
                        queue = self.policy.order(queue + [parent])
        u = store_usage(self.store)
        if u is not None:
            self.metrics.observe_usage(self.clock(), u.used_bytes, u.capacity_bytes, "evict")
        return evicted

    def _demote_tiers(self) -> int:
        """One demotion pass per upper level of a tiered store above the high watermark (see the
        module docstring). Errors of single victims are logged and counted; never raises.
        Returns the blobs demoted."""
        store = self.store
        usages_fn = getattr(store, "tier_usages", None)
        if not self.eviction.enabled or not callable(usages_fn) or not callable(getattr(store, "demote", None)):
            return 0
        demoted = 0
        try:
            with self._evict_lock:
                for tu in usages_fn()[:-1]:
                    u = tu.usage
                    if u is None or u.capacity_bytes is None or u.used_bytes <= self.eviction.high_watermark * u.capacity_bytes:
                        continue
                    demoted += self._demote_level(tu.level, int(self.eviction.low_watermark * u.capacity_bytes))
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("tier demotion pass failed")
            self.metrics.add(demotion_errors=1)
        return demoted

    def _demote_level(self, level: int, target_bytes: int) -> int:
        store = self.store

        def used() -> int:
            u = store.tier_usages()[level].usage
            return u.used_bytes if u is not None else 0

        self.metrics.add(demotion_passes=1)
        queue = self.policy.order(self._level_candidates(level))
        done = 0
        while queue and used() > target_bytes:
            cand = queue.pop(0)
            blob = cand.node.blob
            if blob is None:
                continue
            try:
                ok = store.demote(blob, level)
            except Exception as exc:  # noqa: BLE001 - the copy is kept; try the next
                log.warning("demotion of %r from tier %d failed (kept): %s", cand.node, level, exc)
                self.metrics.add(demotion_errors=1)
                continue
            if not ok:
                continue
            done += 1
            self.metrics.add(demotions=1, demoted_bytes=blob.nbytes)
            parent = cand.node.parent
            if parent is not None and parent.depth >= 0:
                fresh = [c for c in self._level_candidates(level, [parent]) if c.node is parent]
                queue = self.policy.order(queue + fresh)
        return done

    def _level_candidates(self, level: int, roots: Optional[list[TrieNode]] = None) -> list[Candidate]:
        """Under the forest lock, the subtrees of ``roots`` (default: every namespace): nodes with
        a ready copy at ``level``, not being read or evicted, and nothing below them at that
        level (ready or in flight): leaf-first within the level, so a chain keeps its prefix
        (a copy is read from a level only together with its whole window)."""
        store = self.store

        def at_level(blob: Optional[BlobHandle]) -> bool:
            return blob is not None and (level in store.levels_of(blob) or level in store.pending_levels_of(blob))

        out: list[Candidate] = []
        with self.forest.lock:
            if roots is None:
                roots = [c for ns in self.forest.namespaces() for c in ns.root.children.values()]
            for start in roots:
                below: dict[int, bool] = {}
                stack: list[tuple[TrieNode, bool]] = [(start, False)]
                while stack:
                    node, visited = stack.pop()
                    children = list(node.children.values())
                    if not visited:
                        stack.append((node, True))
                        stack.extend((c, False) for c in children)
                        continue
                    child_any = any(below[id(c)] for c in children)
                    here = at_level(node.blob)
                    below[id(node)] = here or child_any
                    if (here and not child_any and node.has_kv and node.ref_count == 0 and not node.evicting
                            and level in store.levels_of(node.blob)):
                        reachable = all(a.has_kv for a in node.path()[:-1])
                        out.append(Candidate(node, node.blob.nbytes, node.last_access, node.depth, reachable))
        return out

    def _collect(self) -> tuple[list[TrieNode], list[Candidate]]:
        """Under the forest lock: dead skeletons, children before parents (no live blob in the
        node's subtree, not referenced) and eviction candidates (see `_candidate`)."""
        dead: list[TrieNode] = []
        candidates: list[Candidate] = []
        with self.forest.lock:
            for ns in self.forest.namespaces():
                live = self.forest.is_live(ns, self.eviction.live_sessions)
                # iterative post-order: (node, reachable, children visited?)
                stack: list[tuple[TrieNode, bool, bool]] = [(c, True, False) for c in ns.root.children.values()]
                live_below: dict[int, bool] = {}
                while stack:
                    node, reachable, visited = stack.pop()
                    children = list(node.children.values())
                    if not visited:
                        stack.append((node, reachable, True))
                        stack.extend((c, reachable and node.has_kv, False) for c in children)
                        continue
                    child_live = any(live_below[id(c)] for c in children)
                    here = _holds_blob(node)
                    live_below[id(node)] = here or child_live
                    if not here and not child_live and node.skeleton is not None and node.ref_count == 0:
                        dead.append(node)
                    if _evictable(node, pin_holds=live and node.pinned):
                        candidates.append(Candidate(node, node.blob.nbytes, node.last_access, node.depth,
                                                    reachable))
        return dead, candidates

    def _candidate(self, node: Optional[TrieNode]) -> Optional[Candidate]:
        """``node`` as an eviction candidate, or None: a ready blob, not pinned by a live
        namespace, unreferenced, not being evicted, and no child holding a ready or in-flight blob
        (a leaf)."""
        if node is None or node.depth < 0:
            return None
        with self.forest.lock:
            if not _evictable(node, pin_holds=self._pin_holds(node)):
                return None
            reachable = all(a.has_kv for a in node.path()[:-1])
            return Candidate(node, node.blob.nbytes, node.last_access, node.depth, reachable)

    def _dead_around(self, node: TrieNode) -> list[TrieNode]:
        """After ``node`` lost its blob: the dead nodes of its subtree (children first), then
        its ancestors that are dead now."""
        with self.forest.lock:
            if _subtree_has_blob(node):
                return []
            out: list[TrieNode] = []
            stack, order = [node], []
            while stack:
                n = stack.pop()
                order.append(n)
                stack.extend(n.children.values())
            out = [n for n in reversed(order) if n.skeleton is not None]
            up = node.parent
            while up is not None and up.depth >= 0 and not _subtree_has_blob(up):
                if up.skeleton is not None:
                    out.append(up)
                up = up.parent
            return out

    def _free_dead_skeleton(self, node: TrieNode) -> bool:
        """Free the latent of a node with no live blob in its subtree (claimed like an
        eviction; a failed handle on it is dropped too)."""
        with self.forest.lock:
            if node.skeleton is None or node.evicting or node.ref_count or _subtree_has_blob(node):
                return False
            skeleton = node.skeleton
            node.skeleton = None
            node.blob = None  # None or a failed handle: the store holds nothing of it
            node.evicting = True
        try:
            self.store.free_skeleton(skeleton.latent_locator)
        except Exception as exc:  # noqa: BLE001 - keep the skeleton; counted
            log.warning("freeing the latent of %r failed (kept): %s", node, exc)
            self.metrics.add(eviction_errors=1)
            with self.forest.lock:
                if node.skeleton is None:
                    node.skeleton = skeleton
            return False
        finally:
            with self.forest.lock:
                node.evicting = False
        self.metrics.add(skeletons_freed=1)
        return True

    # -- lifetime -----------------------------------------------------------------------------

    def _pin_holds(self, node: TrieNode) -> bool:
        """Under the forest lock: ``node`` is pinned and its namespace is live."""
        if not node.pinned:
            return False
        top = node
        while top.parent is not None:
            top = top.parent
        ns = self.forest.resolve(top.node_key)
        return ns is None or ns.root is not top or self.forest.is_live(ns, self.eviction.live_sessions)

    def evict_blob(self, node: TrieNode) -> bool:
        """Free a node's KV and drop its blob, keeping the skeleton. Refuses pinned, referenced,
        blob-less, being-evicted and in-flight nodes (False). The blob is detached under the
        forest lock and freed outside it; if freeing fails the blob is put back and the error
        propagates."""
        return self._evict_blob(node, honour_pins=True)

    def _evict_blob(self, node: TrieNode, *, honour_pins: bool) -> bool:
        """`evict_blob`; with ``honour_pins`` False a pin holds only while its namespace is live
        (the eviction pass)."""
        with self.forest.lock:
            if node.ref_count < 0:
                raise HandleStateError(f"negative ref_count on {node!r}")
            pinned = node.pinned if honour_pins else self._pin_holds(node)
            if pinned or node.ref_count > 0 or node.blob is None or node.evicting:
                return False
            handle = node.blob
            if handle.in_flight:
                return False
            node.blob = None
            node.evicting = True
        restored = False
        try:
            self.store.free(handle)
        except WriteNotCompleteError:
            restored = True
            return False
        except BaseException:
            restored = True
            raise
        finally:
            with self.forest.lock:
                if restored and node.blob is None:
                    node.blob = handle
                node.evicting = False
        self._count("evictions")
        self.metrics.add(evictions=1, evicted_bytes=handle.nbytes)
        return True


def _cold(namespace: Optional[Namespace]) -> FastForwardResult:
    """Run from chunk 0; ``node`` is the namespace's virtual root (the parent of chunk 0's
    ingest, as upstream returns it), None on a namespace miss."""
    return FastForwardResult(0, namespace.root if namespace is not None else None, namespace)


def _is_path_store(store: Any) -> bool:
    return callable(getattr(store, "read_path", None)) and getattr(store, "accepts_device_views", False)


def _holds_blob(node: TrieNode) -> bool:
    """A ready or in-flight blob, or one being evicted (a failed handle holds nothing)."""
    return node.evicting or (node.blob is not None and node.blob.state is not BlobState.FAILED)


def _evictable(node: TrieNode, *, pin_holds: bool) -> bool:
    blob = node.blob
    return (
        blob is not None and blob.ready and not pin_holds and node.ref_count == 0 and not node.evicting
        and not any(c.evicting or (c.blob is not None and (c.blob.ready or c.blob.in_flight))
                    for c in node.children.values())
    )


def _subtree_has_blob(node: TrieNode) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if _holds_blob(n):
            return True
        stack.extend(n.children.values())
    return False


def _owner_of(key: str, path: Sequence[TrieNode], win: Sequence[TrieNode]) -> Optional[TrieNode]:
    """The node of ``path`` whose latent or (window nodes) KV value is stored under ``key``."""
    for n in path:
        if n.skeleton is not None and n.skeleton.latent_locator == key:
            return n
    for n in win:
        blob = n.blob
        if blob is not None and any(key in layer_keys(blob.locator, i) for i in range(blob.n_layers)):
            return n
    return None


