"""`TieredStore` (store ``tiered``): a hierarchy of stores, fastest first, with write-through,
promotion on a hit and demotion on eviction (``+store=tiered store.tiers=[hbm,fluxon_plan]``).

Each *level* is a whole store built from its own registry entry and config node; every level
shares one transfer runtime. What each level holds is recorded per blob and per latent; the trie
sees it on the blob handle (`TieredHandle`: ``tier`` is the nearest level's `Tier`, ``tiers``
every level's). This package is one module per role; this one is the facade that implements the
store interface and hands each call to its role:

- `levels`: what a level is, building the levels from their Hydra nodes, the storage format
  (the levels' own when they all share one, else one naming every level), closing them;
- `residency`: the record of what each level holds, the handle lifecycle per level; ``free`` and
  ``free_skeleton`` across every level;
- `write`: write-through of a chunk (first level with room, then every level below) and of a
  latent (every level with room);
- `read`: a restore from the nearest level holding the whole window, single values, ``contains``;
- `moves`: a blob or a latent copied between two levels; promotion, a hit from a lower level
  copied into level 0 (from the ring or the level below);
- `demotion`: an upper level's copy dropped once a level below holds one (written first when
  none does: nothing is lost; a full level below is first made room in by the manager, then the
  write is retried once);
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
from cacheseek.stores.tiered import demotion, read, write
from cacheseek.stores.tiered.levels import (build_stores, close_levels, codec_id, level_keywords, make_levels,
                                            shared_transfer, storage_format)
from cacheseek.stores.tiered.records import TieredRecords
from cacheseek.stores.tiered.residency import Residency, TieredHandle, free_blob, free_latent
from cacheseek.stores.tiered.stats import TieredStats, TierUsage, tier_usages, tiered_stats

__all__ = ["TieredStore", "TieredHandle", "TierUsage", "TieredStats"]

log = logging.getLogger(__name__)


@STORES.register("tiered", objects=("transfer", "stores"), keywords=level_keywords)
class TieredStore(PathReadStore):
    """Levels fastest first. ``tiers``: registry names, each with its
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

    def _reaped(self) -> Residency:
        """The residency book, once the store is checked open and the writes that ended are reaped."""
        self._check_open()
        self._book.reap()
        return self._book

    # -- warm-up --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Some level can serve (a level without a warm-up always can)."""
        return any(lv.store.ready for lv in self._levels)

    def session_starting(self) -> StartToken:
        """Every level's token (the levels warming in the background yield to the session)."""
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
    def put_async(self, locator: str, payload: Sequence[Any], *, tier: Tier = Tier.HBM_STAGING,
                  on_ready: Optional[Callable[[BlobHandle], None]] = None, stream: Any = None) -> BlobHandle:
        """`write.put_chunk`; the outer handle's ``tier`` is level 0's, whatever ``tier`` says."""
        return write.put_chunk(self._reaped(), locator, payload, write_through=self.write_through,
                               on_ready=on_ready, stream=stream)

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        self._check_open()
        write.put_latent(self._book, locator, latent, stream=stream)

    # -- reads ----------------------------------------------------------------------------------
    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        return read.read_path(self._reaped(), path, window, target, promote=self.promote)

    def served_tier(self) -> Optional[str]:
        """The level (its registry name) that served this thread's last `read_path`."""
        return self._book.served.name

    def promoted_last_read(self) -> bool:
        served = self._book.served.name
        return self.promote and served is not None and served != self._levels[0].name

    def get_skeleton(self, locator: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        return read.get_latent(self._book, locator, *args, **kwargs)

    def get_layer(self, handle: BlobHandle, layer: int, **kwargs: Any) -> Any:
        self._check_open()
        return read.get_layer(self._book, handle, layer, **kwargs)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return read.contains(self._book, keys)

    # -- demotion -------------------------------------------------------------------------------
    def demote(self, handle: BlobHandle, level: int, *, make_room: Optional[demotion.MakeRoom] = None) -> bool:
        """`demotion.demote`."""
        return demotion.demote(self._reaped(), handle, level, make_room)

    def evict_copy(self, handle: BlobHandle, level: int) -> bool:
        """`demotion.evict_copy`."""
        return demotion.evict_copy(self._reaped(), handle, level)

    # -- capacity -------------------------------------------------------------------------------
    def tier_usages(self) -> list[TierUsage]:
        self._book.reap()
        return tier_usages(self._book, closed=self._closed)

    def usage(self) -> Optional[StoreUsage]:
        """The last level's usage: the store of record, bounded by the manager's eviction."""
        if self._closed:
            return None
        return store_usage(self._levels[-1].store)

    # -- lifetime -------------------------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        free_blob(self._reaped(), handle)

    def free_skeleton(self, locator: str) -> None:
        self._check_open()
        free_latent(self._book, locator)

    def flush(self) -> None:
        self.flush_beside()
        for lv in self._levels:
            lv.store.flush()
        self._book.reap()

    def close(self) -> None:
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
