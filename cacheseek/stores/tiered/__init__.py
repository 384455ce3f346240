"""`TieredStore` (store ``tiered``): a hierarchy of stores, fastest first, with write-through,
promotion on a hit and demotion on eviction (``+store=tiered store.tiers=[hbm,fluxon_plan]``).

Each *level* is a whole store built from its own registry entry and config node; every level
shares one transfer runtime. What each level holds is recorded per blob and per latent; the trie
sees it on the blob handle (`TieredHandle`: ``tier`` is the nearest level's `Tier`, ``tiers``
every level's). This package is one module per role; this one is the facade that implements the
store interface and hands each call to its role:

- `levels`: what a level is, building the levels from their Hydra nodes, the storage format
  (the levels' own when they all share one, else one naming every level), closing them;
- `residency`: the record of what each level holds, the handle lifecycle per level;
- `write`: write-through of a chunk (first level with room, then every level below) and of a
  latent (every level with room);
- `read`: a restore from the nearest level holding the whole window, single values, ``contains``;
- `promotion`: a hit from a lower level copied into level 0 (from the ring or the level below);
- `demotion`: an upper level's copy dropped once a level below holds one (written first when
  none does: nothing is lost; a full level below is first made room in by the manager, then the
  write is retried once); `moves` copies a blob or a latent between two levels for both;
- `removal`: ``free`` and ``free_skeleton`` across every level;
- `generic_level`: values in and out of a generic level (owned CPU snapshots, byte-wise reads);
- `stats`: `TierUsage` per level and `TieredStats` for the report.

Eviction is decided by the manager (`cacheseek.eviction`): per upper level above the high
watermark, leaf-first LRU among the nodes held there, each victim demoted; when a demotion finds
the level below full, the manager makes room there with the same rule (victims demoted further
down, or evicted from the lowest level: ``evict_copy``, or ``free`` for a sole copy), counted per
level as ``evictions_for_demotion``. ``usage()`` is the
last level's (the store of record, which the manager's ordinary eviction bounds); `tier_usages`
gives every level's. ``free`` removes a blob from every level; ``free_skeleton`` a latent.
``ready`` is True while any level can serve (a level without a warm-up always can), and
``session_starting`` holds every level warming in the background (`cacheseek.stores.startup`).
Blobs known only from a forest snapshot (plain `BlobHandle`) are located on first use by asking
each level's ``contains``. Checksums are the levels' own (a disk level checks what it reads).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs

from cacheseek.errors import StoreClosedError
from cacheseek.eviction.base import StoreUsage, store_usage
from cacheseek.kv.handles import BlobHandle, ChunkNode, Tier
from cacheseek.registry import STORES
from cacheseek.stores.base import PathReadStore, RestoreTarget
from cacheseek.stores.startup import StartToken, combine
from cacheseek.stores.tiered import demotion, read, removal, write
from cacheseek.stores.tiered.levels import (
    build_stores,
    close_levels,
    codec_id,
    level_keywords,
    make_levels,
    shared_transfer,
    storage_format,
)
from cacheseek.stores.tiered.records import TieredRecords
from cacheseek.stores.tiered.residency import Residency, TieredHandle
from cacheseek.stores.tiered.stats import TieredStats, TierUsage, tier_usages, tiered_stats

__all__ = ["TieredStore", "TieredHandle", "TierUsage", "TieredStats"]

log = logging.getLogger(__name__)


@STORES.register("tiered", objects=("transfer", "stores"), keywords=level_keywords)
class TieredStore(PathReadStore):
    """Levels fastest first (see the package docstring). ``tiers``: registry names, each with its
    config node passed by that name (``hbm={...}``); or ``stores``: built levels (the caller
    keeps owning them; tests). ``transfer``: the runtime every level shares. Its config has one
    node per registered store, whatever the registry names; only the listed ones are built."""

    knows_contents = True
    frees_latents = True

    @classmethod
    def size_fields(cls, config: dict) -> list:
        """The size fields of every listed level, under its name (``fluxon_plan.segment_bytes``):
        each is fitted and checked against one chunk as it would be alone."""
        fields = []
        for name in config.get("tiers") or []:
            level = config.get(name) or {}
            for f in STORES.get(name).size_fields(level) if name in STORES else []:
                fields.append(attrs.evolve(f, path=f"{name}.{f.path}"))
        return fields

    def __init__(
        self,
        tiers: Sequence[str] = ("hbm", "fluxon_plan"),
        write_through: bool = True,
        promote: bool = True,
        *,
        transfer: Any = None,
        stores: Optional[Sequence[tuple[str, Any]]] = None,
        **levels: Any,
    ) -> None:
        self.write_through = bool(write_through)
        self.promote = bool(promote)
        self._transfer = transfer
        self._closed = False
        self._owns = stores is None
        built = list(stores) if stores is not None else build_stores(list(tiers), levels, transfer)
        self._levels = make_levels(built)
        self._book = Residency(self._levels)
        self.records = TieredRecords(self._levels[-1].store.records, self._shared_copy)
        self._book.on_shared_copy = self.records.copy_ready
        self._format = storage_format(self._levels)
        self.codec_id = codec_id(self._levels)
        log.info("tiered store: %s (write-through %s, promote %s)",
                 " > ".join(lv.name for lv in self._levels), self.write_through, self.promote)

    # -- levels ---------------------------------------------------------------------------------
    @property
    def levels(self) -> list[Any]:
        """The level stores, fastest first."""
        return [lv.store for lv in self._levels]

    @property
    def storage_format(self) -> str:
        return self._format

    @property
    def transfer(self) -> Any:
        return shared_transfer(self._transfer, self._levels)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("tiered store used after close()")

    # -- warm-up --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Some level can serve (a level without a notion of readiness always can): False only
        while every level is still warming up in the background."""
        return any(lv.store.ready for lv in self._levels)

    def session_starting(self) -> StartToken:
        """A session is starting: every level warming in the background yields to it until the
        token is released (`cacheseek.stores.startup`)."""
        taken: list[StartToken] = []
        try:
            for lv in self._levels:
                taken.append(lv.store.session_starting())
        except BaseException:
            combine(taken).release()  # what was taken before the failure
            raise
        return combine(taken)

    def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        """Block until every level warming in the background is ready (at most ``timeout_s`` in
        all); whether every level is."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        ok = True
        for lv in self._levels:
            ok = lv.store.wait_ready(None if end is None else max(end - time.monotonic(), 0.0)) and ok
        return ok

    # -- residency ------------------------------------------------------------------------------
    def _shared_copy(self, locator: str) -> Optional[BlobHandle]:
        """The last level's ready handle of the blob at ``locator`` (None: not there, or not ready)."""
        with self._book.lock:
            rec = self._book.blobs.get(locator)
            h = rec.at.get(len(self._levels) - 1) if rec is not None else None
            return h if h is not None and h.ready else None

    def levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels holding a ready copy of ``handle``'s blob, nearest first."""
        return self._book.levels_of(handle)

    def pending_levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels whose write of ``handle``'s blob is still in flight."""
        return self._book.pending_levels_of(handle)

    # -- writes ---------------------------------------------------------------------------------
    def put_async(
        self,
        locator: str,
        payload: Sequence[Any],
        *,
        tier: Tier = Tier.HBM_STAGING,
        on_ready: Optional[Callable[[BlobHandle], None]] = None,
        stream: Any = None,
    ) -> BlobHandle:
        """Write one chunk to the first level with room and, with ``write_through``, to every
        level below it (see `write`). Returns the PENDING or READY outer handle (its ``tier``
        is level 0's, whatever ``tier`` says). Raises `StoreFullError` when no level has room, a
        `StoreError` when every level refused."""
        self._check_open()
        self._book.reap()
        return write.put_chunk(self._book, locator, payload, write_through=self.write_through,
                               on_ready=on_ready, stream=stream)

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        """Write a latent to every level that has room (latents are small and every level's
        restore reads the whole path's). Raises when no level took it."""
        self._check_open()
        write.put_latent(self._book, locator, latent, stream=stream)

    # -- reads ----------------------------------------------------------------------------------
    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        """See `PathReadStore.read_path`: the nearest level holding the whole path restores it,
        then (``promote``) the path is copied into level 0. False when no level can."""
        self._check_open()
        self._book.reap()
        return read.read_path(self._book, path, window, target, promote=self.promote)

    def served_tier(self) -> Optional[str]:
        """The level (its registry name) that served this thread's last `read_path`, for the
        metrics' per-tier hits and restore histograms; None when it served none."""
        return self._book.served.name

    def promoted_last_read(self) -> bool:
        """Whether this thread's last `read_path` was served below level 0 with ``promote`` on:
        the path was copied into level 0, which may be above its watermark now."""
        served = self._book.served.name
        return self.promote and served is not None and served != self._levels[0].name

    def get_skeleton(self, locator: str, *args: Any, **kwargs: Any) -> Any:
        """The latent from the nearest level holding it (None when none does)."""
        self._check_open()
        return read.get_latent(self._book, locator, *args, **kwargs)

    def get_layer(self, handle: BlobHandle, layer: int, **kwargs: Any) -> Any:
        """One layer from the nearest level holding the blob (None when none does)."""
        self._check_open()
        return read.get_layer(self._book, handle, layer, **kwargs)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which keys some level holds (a lost value in one level is served by another)."""
        self._check_open()
        return read.contains(self._book, keys)

    # -- demotion -------------------------------------------------------------------------------
    def demote(self, handle: BlobHandle, level: int, *, make_room: Optional[demotion.MakeRoom] = None) -> bool:
        """Drop ``level``'s copy of a blob, keeping (or first writing) a ready copy in a level
        below. A level below that is full is made room in by ``make_room(level, nbytes)`` (the
        manager's: returns how many blobs it moved out) and the write retried once. False when
        ``level`` does not hold it, a write is in flight, it is the last level's only copy (that
        is eviction, not demotion) or no level below could take it (then nothing changed:
        nothing is lost). Raises when freeing the copy fails (kept)."""
        self._check_open()
        self._book.reap()
        return demotion.demote(self._book, handle, level, make_room)

    def evict_copy(self, handle: BlobHandle, level: int) -> bool:
        """Free ``level``'s copy of a blob while another level keeps a ready one (the manager
        making room in the lowest level). False when there is no such pair of copies or a write
        is in flight; raises when the free fails (the copy is kept)."""
        self._check_open()
        self._book.reap()
        return demotion.evict_copy(self._book, handle, level)

    # -- capacity -------------------------------------------------------------------------------
    def tier_usages(self) -> list[TierUsage]:
        """Every level's usage and the blobs it holds, fastest first."""
        self._book.reap()
        return tier_usages(self._book, closed=self._closed)

    def usage(self) -> Optional[StoreUsage]:
        """The last level's usage: the store of record, bounded by the manager's eviction."""
        if self._closed:
            return None
        return store_usage(self._levels[-1].store)

    # -- lifetime -------------------------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        """Remove the blob from every level (idempotent). `WriteNotCompleteError` while a write
        is in flight; a level whose free fails keeps its copy (still recorded) and the first error
        is raised after every level was tried."""
        self._check_open()
        self._book.reap()
        removal.free_blob(self._book, handle)

    def free_skeleton(self, locator: str) -> None:
        """Remove a latent from every level (idempotent); the first failure is raised after all."""
        self._check_open()
        removal.free_latent(self._book, locator)

    def flush(self) -> None:
        """Wait for the values written beside chunks, then every level's pending writes, then
        settle them."""
        self.flush_beside()
        for lv in self._levels:
            lv.store.flush()
        self._book.reap()

    def close(self) -> None:
        """Flush and close every level this store built (last level first). Idempotent."""
        if self._closed:
            return
        self.close_beside()  # never close a level under a value being written (raises: nothing closed)
        try:
            self.flush()
        finally:
            self._closed = True
            if self._owns:
                close_levels(self._levels)

    # -- stats ----------------------------------------------------------------------------------
    @property
    def stats(self) -> TieredStats:
        return tiered_stats(self._book, self.tier_usages())

    def __repr__(self) -> str:
        return f"TieredStore({' > '.join(lv.name for lv in self._levels)})"
