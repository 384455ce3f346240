"""`TieredStore` (store ``tiered``): a hierarchy of stores, fastest first, with write-through,
promotion on a hit and demotion on eviction (``+store=tiered store.tiers=[hbm,fluxon_plan]``).

Each *level* is a whole store built from its own registry entry and config node
(``store.hbm``, ``store.fluxon_plan``, ``store.localdisk``, ...); every level shares one transfer
runtime, so the Plan-style levels (``hbm``, ``fluxon_plan``) copy between one another in one
batch (`PlanTierStore.copy_values_from`). Levels are *path* levels (a `PathReadStore`: the ring
is restored straight from their values) or *generic* levels (a `TierStore` of owned CPU values:
``memory``, ``localdisk``, ``per_tensor``, ``fluxon``; their values are copied into the ring run
by run). What each level holds is recorded here, per blob and per latent; the trie sees it on the
blob handle (`TieredHandle`: ``tier`` is the nearest level's `Tier`, ``tiers`` every level's).

Write of one chunk (``put_async``)::

    the first level that has room takes the chunk (a level that refuses with `StoreFullError` is
    skipped; the manager's next demotion pass makes room there), then, with ``write_through``,
    every level below it, each through its own put_async (the Plan tier overlaps its copies with
    compute as always; a generic level gets one owned CPU snapshot, shared by all of them)
    the outer handle turns ready (on_ready called once) when the first level's copy is ready;
    it fails only when every level's write failed; a level whose write failed holds nothing

Read of depth K (``read_path``): the nearest level that holds every latent of the path and the
KV of every window node restores it (a level that turns out to miss a value is skipped; the next
one is tried). On a hit from a lower level, with ``promote``, the path is copied into level 0:
chunks lying whole in the restored ring go straight from the ring (D2D, no second read of the
lower level), the others by `copy_values_from` (Plan-style levels) or through their layers;
latents from the restore's latent targets. A promotion that fails or finds no room is counted and
changes nothing else (the restore has succeeded).

Eviction is decided by the manager (`cacheseek.eviction`): per upper level whose usage is above
the high watermark, leaf-first LRU among the nodes held at that level, each victim *demoted*
(`demote`): when no level below holds a ready copy, one is written first (if every write fails
the copy stays: nothing is lost); then the level's copy is freed. ``usage()`` is the last level's
(the store of record, which the manager's ordinary eviction bounds); `tier_usages` gives every
level's. ``free`` removes a blob from every level; ``free_skeleton`` a latent.

Blobs known only from a forest snapshot (plain `BlobHandle`) are located on first use by asking
each level's ``contains``. Checksums are the levels' own (a disk level checks what it reads).
``storage_format`` (a namespace field): the levels' own when they all share one (``hbm`` over
``fluxon_plan``: raw Plan bytes, the namespace of a plain Plan tier), else one naming every level.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import attrs
from omegaconf import DictConfig, OmegaConf

from cacheseek.errors import (
    CacheSeekError,
    ConfigError,
    LayoutMismatchError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    WriteNotCompleteError,
)
from cacheseek.eviction.base import StoreUsage, store_usage
from cacheseek.kv.handles import BlobHandle, BlobState, ChunkNode, Tier, kv_pairs
from cacheseek.kv.locators import blob_keys
from cacheseek.kv.payload import layer_nbytes
from cacheseek.registry import STORES, instantiate
from cacheseek.stores.base import RestoreTarget

__all__ = ["TieredStore", "TieredSchema", "TieredHandle", "TierUsage", "TIER_OF"]

log = logging.getLogger(__name__)

# The `Tier` each known backend stands for (persisted on the blob handle; others count as CPU).
TIER_OF = {
    "hbm": Tier.HBM_STAGING,
    "fluxon_plan": Tier.FLUXON_DRAM,
    "fluxon": Tier.FLUXON_DRAM,
    "memory": Tier.CPU,
    "per_tensor": Tier.CPU,
    "localdisk": Tier.DISK,
}


@dataclasses.dataclass
class TieredSchema:
    _target_: str = "cacheseek.stores.tiered.TieredStore"
    _recursive_: bool = False  # the levels are built by the store, only the listed ones
    tiers: list = dataclasses.field(default_factory=lambda: ["hbm", "fluxon_plan"])
    write_through: bool = True
    promote: bool = True
    hbm: Any = None
    fluxon_plan: Any = None
    localdisk: Any = None
    memory: Any = None
    per_tensor: Any = None
    fluxon: Any = None


@dataclass(eq=False)
class TieredHandle(BlobHandle):
    """A blob of a `TieredStore`: ``tier`` is the `Tier` of the nearest level holding a ready
    copy, ``tiers`` those of every level holding one, nearest first (kept by the store)."""

    tiers: tuple = field(default=())


@attrs.frozen(slots=True)
class TierUsage:
    """One level: its position, registry ``name``, `Tier`, usage (None: it cannot say) and the
    number of blobs it holds (ready copies)."""

    level: int
    name: str
    tier: Tier
    usage: Optional[StoreUsage]
    blobs: int


@attrs.define(eq=False)
class _Level:
    index: int
    name: str
    tier: Tier
    store: Any
    path: bool  # restores into the ring itself (read_path) and takes device views on write
    counters: dict = attrs.field(factory=dict)


@attrs.define(eq=False)
class _Copies:
    """What the levels hold of one blob: level -> that level's handle (pending, ready or failed)."""

    outer: BlobHandle
    at: dict = attrs.field(factory=dict)
    on_ready: Optional[Callable[[BlobHandle], None]] = None
    notified: bool = False


def _is_path_store(store: Any) -> bool:
    return callable(getattr(store, "read_path", None)) and bool(getattr(store, "accepts_device_views", False))


@STORES.register("tiered", TieredSchema)
class TieredStore:
    """Levels fastest first (see the module docstring). ``tiers``: registry names, each with its
    config node passed by that name (``hbm={...}``); or ``stores``: built levels (the caller
    keeps owning them; tests). ``transfer``: the runtime every level shares."""

    accepts_device_views = True

    @classmethod
    def size_fields(cls, config: dict) -> list:
        """The size fields of every listed level, under its name (``fluxon_plan.segment_bytes``):
        each is fitted and checked against one chunk as it would be alone."""
        fields = []
        for name in config.get("tiers") or []:
            level = config.get(name) or {}
            sized = getattr(STORES.get(name), "size_fields", None) if name in STORES else None
            for f in sized(level) if sized is not None else []:
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
        self._lock = threading.RLock()
        self._closed = False
        self._blobs: dict[str, _Copies] = {}
        self._latents: dict[str, set] = {}  # latent -> levels holding it
        self._probed: dict[str, set] = {}  # latent -> levels asked (latents this store did not write)
        self._pending: dict[int, _Copies] = {}  # records with a write in flight, by id
        self._counters: dict[str, Any] = {}
        self._levels: list[_Level] = []
        self._owns = stores is None
        if stores is not None:
            built = list(stores)
        else:
            built = self._build(list(tiers), levels, transfer)
        try:
            if not built:
                raise ConfigError("store.tiers", "is empty", "list at least one store, e.g. [hbm,fluxon_plan]")
            for i, (name, store) in enumerate(built):
                self._levels.append(_Level(i, name, TIER_OF.get(name, Tier.CPU), store, _is_path_store(store)))
        except BaseException:
            self._close_levels()
            raise
        # The namespace's store_format field: levels that all encode values one way share it with
        # a plain store of that kind (an HBM tier over a shared Fluxon Plan service reads and
        # writes what the other workers do); a mixed hierarchy gets a namespace of its own.
        formats = [getattr(lv.store, "storage_format", None) or type(lv.store).__qualname__ for lv in self._levels]
        self.storage_format = (formats[0] if len(set(formats)) == 1 else
                               "cacheseek.tiered.v1[" + ",".join(f"{lv.name}={f}" for lv, f in zip(self._levels, formats)) + "]")
        log.info("tiered store: %s (write-through %s, promote %s)",
                 " > ".join(lv.name for lv in self._levels), self.write_through, self.promote)

    @staticmethod
    def _build(names: list[str], nodes: dict[str, Any], transfer: Any) -> list[tuple[str, Any]]:
        if len(set(names)) != len(names):
            raise ConfigError("store.tiers", f"lists a store twice: {names}", "name each store once")
        built: list[tuple[str, Any]] = []
        try:
            for name in names:
                if name == "tiered" or name not in STORES:
                    known = ", ".join(n for n in STORES.names() if n != "tiered")
                    raise ConfigError("store.tiers", f"unknown tier {name!r}", f"use some of: {known}")
                node = nodes.get(name)
                if isinstance(node, DictConfig):
                    node = OmegaConf.to_container(node, resolve=True)
                if node is None:
                    raise ConfigError(f"store.{name}", f"tier {name!r} has no config node",
                                      "use conf/store/tiered.yaml, which has one per backend")
                built.append((name, instantiate(node, transfer=transfer)))
        except BaseException:
            for _, store in reversed(built):
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            raise
        return built

    # -- levels ---------------------------------------------------------------------------------
    @property
    def levels(self) -> list[Any]:
        """The level stores, fastest first."""
        return [lv.store for lv in self._levels]

    @property
    def tier_names(self) -> list[str]:
        return [lv.name for lv in self._levels]

    @property
    def transfer(self) -> Any:
        if self._transfer is not None:
            return self._transfer
        for lv in self._levels:
            t = getattr(lv.store, "transfer", None)
            if t is not None:
                return t
        return None

    def _count(self, level: Optional[int] = None, **deltas: Any) -> None:
        with self._lock:
            target = self._counters if level is None else self._levels[level].counters
            for k, v in deltas.items():
                target[k] = target.get(k, 0) + v

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("tiered store used after close()")

    # -- residency ------------------------------------------------------------------------------
    def _copies(self, handle: BlobHandle) -> _Copies:
        """The record of ``handle``'s blob; a blob known only from a snapshot is located now."""
        with self._lock:
            rec = self._blobs.get(handle.locator)
            if rec is not None:
                return rec
        keys = blob_keys(handle.locator, handle.n_layers, pairs=handle.pairs)
        rec = _Copies(handle)
        for lv in self._levels:
            contains = getattr(lv.store, "contains", None)
            try:
                whole = callable(contains) and all(contains(keys))
            except Exception as exc:  # noqa: BLE001 - cannot tell: not held there
                log.warning("tiered store: %s cannot say whether it holds %s: %s", lv.name, handle.locator, exc)
                whole = False
            if whole:
                rec.at[lv.index] = BlobHandle(lv.tier, handle.locator, handle.nbytes, handle.n_layers,
                                              ready=True, pairs=handle.pairs)
        with self._lock:
            rec = self._blobs.setdefault(handle.locator, rec)
            self._refresh(rec)
        return rec

    def _refresh(self, rec: _Copies) -> None:
        """Under the lock: the outer handle's ``tier``/``tiers`` from the ready copies."""
        ready = sorted(i for i, h in rec.at.items() if h.ready)
        tiers = tuple(self._levels[i].tier for i in ready)
        if ready:
            rec.outer.tier = tiers[0]
        if isinstance(rec.outer, TieredHandle):
            rec.outer.tiers = tiers

    def levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels holding a ready copy of ``handle``'s blob, nearest first."""
        rec = self._copies(handle)
        with self._lock:
            return tuple(sorted(i for i, h in rec.at.items() if h.ready))

    def pending_levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels whose write of ``handle``'s blob is still in flight."""
        rec = self._copies(handle)
        with self._lock:
            return tuple(sorted(i for i, h in rec.at.items() if h.in_flight))

    def latent_levels(self, locator: str) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._latents.get(locator, ())))

    def _reap(self) -> None:
        """Settle writes that finished since the last look: a failed level's copy is dropped
        from the record (it stored nothing); an outer handle whose every copy failed fails."""
        with self._lock:
            pending, self._pending = self._pending, {}
            for rec in pending.values():
                for i, h in list(rec.at.items()):
                    if h.state is BlobState.FAILED:
                        del rec.at[i]
                        self._levels[i].counters["write_failures"] = self._levels[i].counters.get("write_failures", 0) + 1
                        log.warning("tiered store: write of %s to %s failed: %s", rec.outer.locator,
                                    self._levels[i].name, h.error)
                        if rec.outer.error is None and not rec.outer.ready and not rec.at:
                            rec.outer.error = h.error
                if any(h.in_flight for h in rec.at.values()):
                    self._pending[id(rec)] = rec
                if not rec.at and self._blobs.get(rec.outer.locator) is rec:
                    del self._blobs[rec.outer.locator]
                self._refresh(rec)

    def _on_level_ready(self, rec: _Copies, level: int, handle: Optional[BlobHandle]) -> None:
        notify = None
        with self._lock:
            h = handle if handle is not None else rec.at.get(level)
            if h is not None:
                h.ready = True
                rec.at[level] = h
            self._count(level, writes=1, write_bytes=rec.outer.nbytes)
            self._refresh(rec)
            if not rec.notified and rec.outer.error is None:
                rec.notified = True
                rec.outer.ready = True
                notify = rec.on_ready
        if notify is not None:
            notify(rec.outer)

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
        level below it (see the module docstring). Returns the PENDING or READY outer handle.
        Raises `StoreFullError` when no level has room, a `StoreError` when every level refused."""
        self._check_open()
        self._reap()
        layers = list(payload)
        nbytes = sum(layer_nbytes(layer) for layer in layers)
        outer = TieredHandle(self._levels[0].tier, locator, nbytes, len(layers), pairs=kv_pairs(layers))
        rec = _Copies(outer, on_ready=on_ready)
        with self._lock:
            self._blobs[locator] = rec
        cpu: list = []  # one owned CPU snapshot for every generic level
        errors: list[BaseException] = []
        for lv in self._levels:
            if rec.at and not self.write_through:
                break
            try:
                data = layers if lv.path else _cpu_snapshot(layers, cpu)
                kwargs = {"stream": stream} if lv.path and stream is not None else {}
                h = lv.store.put_async(locator, data, tier=lv.tier,
                                       on_ready=lambda h, lv=lv: self._on_level_ready(rec, lv.index, h), **kwargs)
            except StoreFullError as exc:
                self._count(lv.index, full_skips=1)
                errors.append(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the next level may still take it
                self._count(lv.index, write_failures=1)
                log.warning("tiered store: write of %s to %s failed: %s", locator, lv.name, exc)
                errors.append(exc)
                continue
            with self._lock:
                if h is None:
                    h = BlobHandle(lv.tier, locator, nbytes, len(layers), pairs=outer.pairs)
                rec.at.setdefault(lv.index, h)
                if h.in_flight:
                    self._pending[id(rec)] = rec
                self._refresh(rec)
        with self._lock:
            if not rec.at:
                del self._blobs[locator]
                outer.error = errors[-1] if errors else StoreError(f"{locator}: no tier took it")
        if outer.error is None:
            for level in range(min(rec.at)):  # levels that refused the KV need not keep its latent
                self._drop_latent(level, _latent_of(locator))
        if outer.error is not None:
            if all(isinstance(e, StoreFullError) for e in errors):
                raise StoreFullError(f"no tier has room for {locator} ({nbytes} B): "
                                     + "; ".join(str(e) for e in errors))
            raise StoreError(f"every tier refused {locator}: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors))
        self._count(puts=1)
        return outer

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        """Write a latent to every level that has room (latents are small and every level's
        restore reads the whole path's). Raises when no level took it."""
        self._check_open()
        took: set = set()
        errors: list[BaseException] = []
        cpu: list = []
        for lv in self._levels:
            try:
                if lv.path:
                    if stream is not None:
                        lv.store.put_skeleton(locator, latent, stream=stream)
                    else:
                        lv.store.put_skeleton(locator, latent)
                else:
                    lv.store.put_skeleton(locator, _cpu_snapshot([latent], cpu)[0])
                took.add(lv.index)
            except Exception as exc:  # noqa: BLE001 - other levels may take it
                if not isinstance(exc, StoreFullError):
                    log.warning("tiered store: latent %s not written to %s: %s", locator, lv.name, exc)
                errors.append(exc)
        if not took:
            if errors and all(isinstance(e, StoreFullError) for e in errors):
                raise StoreFullError(f"no tier has room for latent {locator}")
            raise StoreError(f"every tier refused latent {locator}: {errors[-1] if errors else '?'}")
        with self._lock:
            self._latents.setdefault(locator, set()).update(took)
            self._probed[locator] = set(range(len(self._levels)))  # every level was tried

    # -- reads ----------------------------------------------------------------------------------
    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        """See `PathReadStore.read_path`: the nearest level holding the whole path restores it,
        then (``promote``) the path is copied into level 0. False when no level can."""
        self._check_open()
        self._reap()
        path, window = list(path), list(window)
        if any(n.blob is None or n.skeleton is None for n in window) or any(n.skeleton is None for n in path):
            return False
        recs = [self._copies(n.blob) for n in window]
        error: Optional[BaseException] = None
        for lv in self._levels:
            if not self._holds_path(lv.index, path, recs):
                continue
            t0 = time.perf_counter()
            try:
                ok = (lv.store.read_path(path, window, target) if lv.path
                      else _read_generic(lv.store, path, window, target))
            except LayoutMismatchError:
                raise
            except CacheSeekError as exc:  # a level's failure: the next one may serve
                log.warning("tiered store: restore from %s failed: %s", lv.name, exc)
                self._count(lv.index, read_errors=1)
                error = exc
                continue
            if not ok:
                self._count(lv.index, read_misses=1)
                self._forget_missing(lv.index, path, window)
                continue
            self._count(lv.index, hits=1, hit_seconds=time.perf_counter() - t0)
            if lv.index > 0 and self.promote:
                self._promote(lv.index, path, window, recs, target)
            return True
        if error is not None:
            raise error
        return False

    def _holds_path(self, level: int, path: list[ChunkNode], recs: list[_Copies]) -> bool:
        with self._lock:
            if not all(level in self._latents.get(n.skeleton.latent_locator, ()) for n in path):
                if not self._probe_latents(level, path):
                    return False
            return all(rec.at.get(level) is not None and rec.at[level].ready for rec in recs)

    def _probe_latents(self, level: int, path: list[ChunkNode]) -> bool:
        """Latents not recorded at ``level`` (a forest snapshot): ask the level, record them."""
        keys = [n.skeleton.latent_locator for n in path if level not in self._latents.get(n.skeleton.latent_locator, ())]
        contains = getattr(self._levels[level].store, "contains", None)
        if not callable(contains) or any(level in self._probed.get(k, ()) for k in keys):
            return False  # asked before, or written here: recorded where it is
        try:
            present = contains(keys)
        except Exception:  # noqa: BLE001
            return False
        for k, ok in zip(keys, present):
            self._probed.setdefault(k, set()).add(level)
            if ok:
                self._latents.setdefault(k, set()).add(level)
        return all(present)

    def _forget_missing(self, level: int, path: list[ChunkNode], window: list[ChunkNode]) -> None:
        """A level missed a value it was recorded to hold (lost behind our back): drop the
        records of that level that its ``contains`` no longer confirms."""
        contains = getattr(self._levels[level].store, "contains", None)
        if not callable(contains):
            return
        try:
            for n in window:
                if not all(contains(blob_keys(n.blob.locator, n.blob.n_layers, pairs=n.blob.pairs))):
                    rec = self._copies(n.blob)
                    with self._lock:
                        rec.at.pop(level, None)
                        self._refresh(rec)
            for n in path:
                loc = n.skeleton.latent_locator
                if not all(contains([loc])):
                    with self._lock:
                        self._latents.get(loc, set()).discard(level)
        except Exception as exc:  # noqa: BLE001 - records stay; the next read tries again
            log.warning("tiered store: could not check %s after a miss: %s", self._levels[level].name, exc)

    def get_skeleton(self, locator: str, *args: Any, **kwargs: Any) -> Any:
        """The latent from the nearest level holding it (None when none does)."""
        self._check_open()
        for level in self.latent_levels(locator) or range(len(self._levels)):
            value = self._levels[level].store.get_skeleton(locator, *args, **kwargs)
            if value is not None:
                return value
        return None

    def get_layer(self, handle: BlobHandle, layer: int, **kwargs: Any) -> Any:
        """One layer from the nearest level holding the blob (None when none does)."""
        self._check_open()
        for level in self.levels_of(handle):
            value = self._levels[level].store.get_layer(self._copies(handle).at[level], layer, **kwargs)
            if value is not None:
                return value
        return None

    # -- promotion and demotion -----------------------------------------------------------------
    def _promote(self, src: int, path: list[ChunkNode], window: list[ChunkNode], recs: list[_Copies],
                 target: RestoreTarget) -> None:
        """Copy the restored path into level 0 (see the module docstring); never raises."""
        top = self._levels[0]
        whole = {r.chunk_depth: r.dst_token for r in target.runs
                 if r.src_token == 0 and r.n_tokens == target.chunk_tokens}
        for node, lat in zip(path, target.latents):
            loc = node.skeleton.latent_locator
            if 0 in self.latent_levels(loc):
                continue
            try:
                top.store.put_skeleton(loc, lat if top.path else lat.to("cpu", copy=True))
                with self._lock:
                    self._latents.setdefault(loc, set()).add(0)
            except Exception as exc:  # noqa: BLE001 - counted; the restore stands
                self._promotion_failed(exc, loc)
                return
        for node, rec in zip(window, recs):
            with self._lock:
                if 0 in rec.at:
                    continue
            try:
                if node.depth in whole and top.path:
                    start, n = whole[node.depth], target.chunk_tokens
                    payload = [(k[:, start : start + n], v[:, start : start + n]) for k, v in target.kv]
                    h = top.store.put_async(rec.outer.locator, payload, tier=top.tier)
                    how = "ring"
                else:
                    h = self._copy_blob(src, 0, rec)
                    how = "tier"
            except Exception as exc:  # noqa: BLE001 - counted; the restore stands
                self._promotion_failed(exc, rec.outer.locator)
                return
            if h is None:
                continue
            with self._lock:
                rec.at[0] = h
                if h.in_flight:
                    self._pending[id(rec)] = rec
                self._refresh(rec)
            self._count(0, promotions=1, promoted_bytes=rec.outer.nbytes, **{f"promotions_from_{how}": 1})

    def _promotion_failed(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, StoreFullError):
            self._count(0, promotion_full=1)
            log.info("tiered store: no room in %s to promote %s", self._levels[0].name, what)
        else:
            self._count(0, promotion_failures=1)
            log.warning("tiered store: promotion of %s failed: %s", what, exc)

    def _copy_blob(self, src: int, dst: int, rec: _Copies) -> Optional[BlobHandle]:
        """Write level ``src``'s copy of a blob into level ``dst``; the new (ready) handle, or None
        when ``src`` no longer holds it. Raises on failure, having written nothing."""
        a, b = self._levels[src], self._levels[dst]
        h = rec.at.get(src)
        if h is None or not h.ready:
            return None
        outer = rec.outer
        keys = blob_keys(outer.locator, outer.n_layers, pairs=outer.pairs)
        copy = getattr(b.store, "copy_values_from", None)
        if a.path and b.path and callable(copy):
            size = outer.nbytes // len(keys)
            if copy(a.store, keys, [size] * len(keys)) is None:
                return None
            return BlobHandle(b.tier, outer.locator, outer.nbytes, outer.n_layers, ready=True, pairs=outer.pairs)
        layers = []
        for layer in range(outer.n_layers):
            value = a.store.get_layer(h, layer)
            if value is None:
                return None
            layers.append(value)
        layers = [_as_tensors(v, outer.nbytes // max(1, len(keys))) for v in layers]
        if b.path:
            device = _device_of(b.store)
            layers = [tuple(t.to(device) for t in layer) if isinstance(layer, tuple) else layer.to(device)
                      for layer in layers]
        out = b.store.put_async(outer.locator, layers, tier=b.tier)
        if out is None or not out.ready:
            b.store.flush()
        if out is not None and not out.ready:
            raise StoreError(f"copy of {outer.locator} into {b.name} failed: {out.error}")
        return out

    def _copy_latent(self, src: int, dst: int, loc: Optional[str]) -> None:
        """Give level ``dst`` the latent ``loc`` from level ``src`` when it lacks it (a chunk
        demoted into a level that was full when the latent was written); failures are logged."""
        if loc is None or dst in self.latent_levels(loc) or src not in self.latent_levels(loc):
            return
        a, b = self._levels[src], self._levels[dst]
        try:
            copy = getattr(b.store, "copy_values_from", None)
            if a.path and b.path and callable(copy):
                done = copy(a.store, [loc]) is not None
            else:
                value = a.store.get_skeleton(loc)
                done = value is not None
                if done:
                    value = _as_tensors(value, 0)
                    b.store.put_skeleton(loc, value.to(_device_of(b.store)) if b.path else value.to("cpu", copy=True))
        except Exception as exc:  # noqa: BLE001 - the KV is demoted; the latent may follow later
            log.warning("tiered store: latent %s not copied into %s: %s", loc, b.name, exc)
            return
        if done:
            with self._lock:
                self._latents.setdefault(loc, set()).add(dst)

    def demote(self, handle: BlobHandle, level: int) -> bool:
        """Drop ``level``'s copy of a blob, keeping (or first writing) a ready copy in a level
        below. False when ``level`` does not hold it, a write is in flight, it is the last
        level's only copy (that is eviction, not demotion) or no level below could take it
        (then nothing changed: nothing is lost). Raises when freeing the copy fails (kept)."""
        self._check_open()
        self._reap()
        rec = self._copies(handle)
        with self._lock:
            h = rec.at.get(level)
            if h is None or not h.ready or any(x.in_flight for x in rec.at.values()):
                return False
            below = [i for i, x in rec.at.items() if i > level and x.ready]
        if not below:
            for dst in range(level + 1, len(self._levels)):
                try:
                    out = self._copy_blob(level, dst, rec)
                except Exception as exc:  # noqa: BLE001 - try the next level down
                    self._count(level, demotion_failures=1)
                    log.warning("tiered store: demoting %s from %s into %s failed: %s", handle.locator,
                                self._levels[level].name, self._levels[dst].name, exc)
                    continue
                if out is not None:
                    with self._lock:
                        rec.at[dst] = out
                        self._refresh(rec)
                    self._count(dst, demoted_in=1)
                    self._copy_latent(level, dst, _latent_of(handle.locator))
                    below = [dst]
                    break
            if not below:
                return False
        self._levels[level].store.free(h)
        with self._lock:
            rec.at.pop(level, None)
            self._refresh(rec)
        self._count(level, demotions=1, demoted_bytes=handle.nbytes)
        self._drop_latent(level, _latent_of(handle.locator))
        return True

    def _drop_latent(self, level: int, loc: Optional[str]) -> None:
        """Free ``level``'s copy of a latent whose chunk's KV it no longer holds, once a level
        below holds the latent too (a restore from ``level`` reads the whole path's latents; a
        promotion puts back the ones it lacks). Failures are logged: the latent stays."""
        if loc is None or level not in self.latent_levels(loc):
            return
        if not any(i > level for i in self.latent_levels(loc)):
            for dst in range(level + 1, len(self._levels)):
                self._copy_latent(level, dst, loc)
                if dst in self.latent_levels(loc):
                    break
            else:
                return
        fn = getattr(self._levels[level].store, "free_skeleton", None)
        if not callable(fn):
            return
        try:
            fn(loc)
        except Exception as exc:  # noqa: BLE001 - kept; freed with the chunk later
            log.warning("tiered store: latent %s not freed from %s: %s", loc, self._levels[level].name, exc)
            return
        with self._lock:
            self._latents.get(loc, set()).discard(level)

    # -- capacity -------------------------------------------------------------------------------
    def tier_usages(self) -> list[TierUsage]:
        """Every level's usage and the blobs it holds, fastest first."""
        self._reap()
        with self._lock:
            counts = [0] * len(self._levels)
            for rec in self._blobs.values():
                for i, h in rec.at.items():
                    counts[i] += bool(h.ready)
        return [TierUsage(lv.index, lv.name, lv.tier, None if self._closed else store_usage(lv.store), counts[lv.index])
                for lv in self._levels]

    def usage(self) -> Optional[StoreUsage]:
        """The last level's usage: the store of record, bounded by the manager's eviction."""
        if self._closed:
            return None
        return store_usage(self._levels[-1].store)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which keys some level holds (a lost value in one level is served by another)."""
        self._check_open()
        keys = list(keys)
        out = [False] * len(keys)
        for lv in self._levels:
            contains = getattr(lv.store, "contains", None)
            if not callable(contains):
                continue
            rest = [i for i, ok in enumerate(out) if not ok]
            if not rest:
                break
            for i, ok in zip(rest, contains([keys[i] for i in rest])):
                out[i] = out[i] or bool(ok)
        return out

    # -- lifetime -------------------------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        """Remove the blob from every level (idempotent). `WriteNotCompleteError` while a write
        is in flight; a level whose free fails keeps its copy (still recorded) and the first error
        is raised after every level was tried."""
        self._check_open()
        self._reap()
        rec = self._copies(handle)
        with self._lock:
            if handle.in_flight or any(h.in_flight for h in rec.at.values()):
                raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
            copies = dict(rec.at)
        errors: list[BaseException] = []
        for level, h in sorted(copies.items()):
            try:
                self._levels[level].store.free(h)
            except Exception as exc:  # noqa: BLE001 - raised below, the copy stays recorded
                errors.append(exc)
                continue
            with self._lock:
                rec.at.pop(level, None)
        with self._lock:
            self._refresh(rec)
            if not rec.at and self._blobs.get(handle.locator) is rec:
                del self._blobs[handle.locator]
        if errors:
            raise errors[0]

    def free_skeleton(self, locator: str) -> None:
        """Remove a latent from every level (idempotent); the first failure is raised after all."""
        self._check_open()
        errors: list[BaseException] = []
        for lv in self._levels:
            fn = getattr(lv.store, "free_skeleton", None)
            if not callable(fn):
                continue
            try:
                fn(locator)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                continue
            with self._lock:
                self._latents.get(locator, set()).discard(lv.index)
        with self._lock:
            if not self._latents.get(locator, True):
                del self._latents[locator]
                self._probed.pop(locator, None)
        if errors:
            raise errors[0]

    def flush(self) -> None:
        """Wait for every level's pending writes, then settle them."""
        for lv in self._levels:
            fn = getattr(lv.store, "flush", None)
            if fn is not None:
                fn()
        self._reap()

    def close(self) -> None:
        """Flush and close every level this store built (last level first). Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._close_levels()

    def _close_levels(self) -> None:
        if not self._owns:
            return
        for lv in reversed(self._levels):
            close = getattr(lv.store, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - close the others
                log.warning("tiered store: closing %s failed: %s", lv.name, exc)

    # -- stats ----------------------------------------------------------------------------------
    @property
    def stats(self) -> "TieredStats":
        usages = self.tier_usages()
        with self._lock:
            counters = dict(self._counters)
            per = [dict(lv.counters) for lv in self._levels]
        rows = []
        for u, c, lv in zip(usages, per, self._levels):
            rows.append(dict(level=u.level, name=u.name, tier=u.tier.value, blobs=u.blobs,
                             used_bytes=u.usage.used_bytes if u.usage else None,
                             capacity_bytes=u.usage.capacity_bytes if u.usage else None,
                             **c, store=_stats_dict(lv.store)))
        return TieredStats(counters, rows)

    def __repr__(self) -> str:
        return f"TieredStore({' > '.join(lv.name for lv in self._levels)})"


@attrs.frozen(slots=True)
class TieredStats:
    """``totals`` of the tiered store and one row per level (usage, blobs, hits, writes,
    promotions, demotions and their failures, and the level's own stats under ``store``).
    ``put_failures``, ``pending_writes`` and ``register_seconds`` sum the levels' for the report."""

    totals: dict
    tiers: list

    def as_dict(self) -> dict[str, Any]:
        def total(key: str) -> Any:
            return sum((r["store"] or {}).get(key) or 0 for r in self.tiers)

        return dict(self.totals, tiers=[dict(r) for r in self.tiers],
                    put_failures=sum(r.get("write_failures", 0) for r in self.tiers),
                    pending_writes=total("pending_writes"), register_seconds=total("register_seconds"))


def _stats_dict(store: Any) -> dict:
    try:
        stats = getattr(store, "stats", None)
    except Exception:  # noqa: BLE001
        return {}
    if stats is None:
        return {}
    as_dict = getattr(stats, "as_dict", None)
    return as_dict() if callable(as_dict) else dict(stats) if isinstance(stats, dict) else {}


def _latent_of(kv_locator: str) -> Optional[str]:
    """The latent key of the chunk whose KV locator is ``{hex}:kv``."""
    return kv_locator[: -len(":kv")] + ":lat" if kv_locator.endswith(":kv") else None


def _cpu_snapshot(layers: list, cache: list) -> list:
    """Owned CPU copies of ``layers`` (tensors; other objects as they are), made once: a
    generic level keeps what it is given, and the runtime overwrites its ring right after."""
    if not cache:
        def own(x: Any) -> Any:
            return x.to("cpu", copy=True) if hasattr(x, "to") and hasattr(x, "data_ptr") else x

        cache.append([tuple(own(t) for t in layer) if isinstance(layer, tuple) else own(layer) for layer in layers])
    return cache[0]


def _as_tensors(value: Any, nbytes: int) -> Any:
    """A layer read from a level as tensors: raw bytes (a Plan-style level read without a
    template) become flat uint8 tensors; tensors stay as they are."""
    import torch

    def one(x: Any) -> Any:
        if isinstance(x, (bytes, bytearray, memoryview)):
            return torch.frombuffer(bytearray(x), dtype=torch.uint8)
        return x

    return tuple(one(x) for x in value) if isinstance(value, tuple) else one(value)


def _device_of(store: Any) -> Any:
    device = getattr(store, "device", None)
    if device is not None:
        return device
    transfer = getattr(store, "transfer", None)
    return "cuda" if getattr(transfer, "device_kind", "cpu") == "cuda" else "cpu"


def _bytes_view(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _read_generic(store: Any, path: list[ChunkNode], window: list[ChunkNode], target: RestoreTarget) -> bool:
    """Restore from a generic level: every latent and window layer fetched first (any missing:
    False, nothing written), then copied into the targets byte for byte, run by run."""
    latents = []
    for n, dst in zip(path, target.latents):
        lat = store.get_skeleton(n.skeleton.latent_locator)
        if lat is None:
            return False
        if _nbytes(lat) != _nbytes(dst):
            raise LayoutMismatchError(f"latent {n.skeleton.latent_locator} holds {_nbytes(lat)} B, its target "
                                      f"takes {_nbytes(dst)} B")
        latents.append(lat)
    value_nbytes = target.chunk_value_nbytes
    layers: dict[int, list] = {}
    for n in window:
        per = []
        for layer in range(target.n_layers):
            kv = store.get_layer(n.blob, layer)
            if kv is None or kv[0] is None or kv[1] is None:
                return False
            kv = _as_tensors(kv, value_nbytes)
            for t in kv:
                if _nbytes(t) != value_nbytes:
                    raise LayoutMismatchError(f"{n.blob.locator} layer {layer}: {_nbytes(t)} B, the ring "
                                              f"takes {value_nbytes} B a chunk")
            per.append(kv)
        layers[n.depth] = per
    for lat, dst in zip(latents, target.latents):
        _bytes_view(dst).copy_(_bytes_view(lat).to(dst.device))
    tb = target.token_bytes
    for layer, (k_ring, v_ring) in enumerate(target.kv):
        rings = (k_ring.view(-1).view(_u8()), v_ring.view(-1).view(_u8()))
        for run in target.runs:
            src = layers[run.chunk_depth][layer]
            for ring, value in zip(rings, src):
                ring[run.dst_token * tb : (run.dst_token + run.n_tokens) * tb].copy_(
                    _bytes_view(value)[run.src_token * tb : (run.src_token + run.n_tokens) * tb].to(ring.device))
    return True


def _u8() -> Any:
    import torch

    return torch.uint8


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())
