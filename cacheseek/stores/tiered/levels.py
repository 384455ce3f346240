"""The levels of a tiered store: what each one is, how it is built from its Hydra node, what the
hierarchy's storage format is, and how the levels are closed.

A *level* is one whole store built from its own registry entry and config node (``store.hbm``,
``store.fluxon_plan``, ...), fastest first. A *path* level (a `PathReadStore` that takes device
views: ``hbm``, ``fluxon_plan``) restores the ring straight from its values; a *generic* level
(``memory``, ``localdisk``, ``per_tensor``, ``fluxon``) holds owned CPU values read layer by layer.
Every level shares one transfer runtime, so Plan-style levels copy between one another in one batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs
from omegaconf import DictConfig, OmegaConf

from cacheseek.codecs.base import codec_fingerprint
from cacheseek.errors import ConfigError
from cacheseek.kv.handles import Tier
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.registry import STORES, instantiate

__all__ = ["Level", "LevelCalls", "tier_of", "is_path_store", "build_stores", "make_levels", "storage_format", "codec_id",
           "shared_transfer", "close_levels", "level_keywords"]

log = logging.getLogger(__name__)


def tier_of(name: str, store: Any) -> Tier:
    """The `Tier` a level stands for (on its blob handles and in the report): the ``tier`` its
    registered class declares, else the store's own, else CPU."""
    return getattr(STORES.get(name) if name in STORES else store, "tier", Tier.CPU)


@attrs.frozen
class LevelCalls:
    """The optional calls of one level's store, each None where it lacks it: resolved once when
    the levels are made, not looked up on every call."""

    contains: Optional[Callable[[Sequence[str]], list[bool]]] = None
    free_skeleton: Optional[Callable[[str], None]] = None
    copy_values_from: Optional[Callable[..., Any]] = None
    session_starting: Optional[Callable[[], Any]] = None
    wait_ready: Optional[Callable[[Optional[float]], bool]] = None
    flush: Optional[Callable[[], None]] = None
    close: Optional[Callable[[], None]] = None

    @classmethod
    def of(cls, store: Any) -> "LevelCalls":
        found = {f.name: getattr(store, f.name, None) for f in attrs.fields(cls)}
        return cls(**{name: fn if callable(fn) else None for name, fn in found.items()})


@attrs.define(eq=False)
class Level:
    """One level: its position (0 = fastest), registry ``name``, `Tier`, store, whether it is a
    path level, its optional calls, and its counters (hits, writes, promotions, demotions,
    failures; see stats)."""

    index: int
    name: str
    tier: Tier
    store: Any
    path: bool  # restores into the ring itself (read_path) and takes device views on write
    calls: LevelCalls = attrs.field(factory=LevelCalls)
    counters: dict = attrs.field(factory=dict)
    store_records: ChunkRecords = NO_RECORDS  # the level store's chunk records (the last level's are shared)


def is_path_store(store: Any) -> bool:
    return callable(getattr(store, "read_path", None)) and bool(getattr(store, "accepts_device_views", False))


def build_stores(names: list[str], nodes: dict[str, Any], transfer: Any) -> list[tuple[str, Any]]:
    """``(name, store)`` for every listed tier, each built from its config node with the shared
    ``transfer``. A repeated or unknown name, or a tier without a node, is a `ConfigError`; the
    stores built before a failure are closed (last first) before it is raised."""
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
                                  "use conf/store/tiered.yaml, which has one per registered store")
            built.append((name, instantiate(node, transfer=transfer)))
    except BaseException:
        for _, store in reversed(built):
            close = getattr(store, "close", None)
            if close is not None:
                close()
        raise
    return built


def make_levels(built: Sequence[tuple[str, Any]]) -> list[Level]:
    """The levels of built ``(name, store)`` pairs, fastest first; none is a `ConfigError`."""
    if not built:
        raise ConfigError("store.tiers", "is empty", "list at least one store, e.g. [hbm,fluxon_plan]")
    return [Level(i, name, tier_of(name, store), store, is_path_store(store), LevelCalls.of(store),
                  store_records=getattr(store, "records", None) or NO_RECORDS)
            for i, (name, store) in enumerate(built)]


def storage_format(levels: Sequence[Level]) -> str:
    """The namespace's store_format field: levels that all encode values one way share it with a
    plain store of that kind (an HBM tier over a shared Fluxon Plan service reads and writes what
    the other workers do); a mixed hierarchy gets a namespace of its own."""
    formats = [getattr(lv.store, "storage_format", None) or type(lv.store).__qualname__ for lv in levels]
    if len(set(formats)) == 1:
        return formats[0]
    return "cacheseek.tiered.v1[" + ",".join(f"{lv.name}={f}" for lv, f in zip(levels, formats)) + "]"


def codec_id(levels: Sequence[Level]) -> str:
    """The namespace's codec field: the levels' codec when they share one, else one naming each
    level's (`cacheseek.codecs.base.codec_fingerprint`; Plan and HBM levels store raw bytes)."""
    ids = [codec_fingerprint(lv.store) for lv in levels]
    if len(set(ids)) == 1:
        return ids[0]
    return "tiered[" + ",".join(f"{lv.name}={c}" for lv, c in zip(levels, ids)) + "]"


def shared_transfer(transfer: Optional[Any], levels: Sequence[Level]) -> Any:
    """``transfer`` when given, else the first level's (None when no level has one)."""
    if transfer is not None:
        return transfer
    for lv in levels:
        t = getattr(lv.store, "transfer", None)
        if t is not None:
            return t
    return None


def close_levels(levels: Sequence[Level]) -> None:
    """Close every level, last first; a failure is logged and the others are still closed."""
    for lv in reversed(levels):
        if lv.calls.close is None:
            continue
        try:
            lv.calls.close()
        except Exception as exc:  # noqa: BLE001 - close the others
            log.warning("tiered store: closing %s failed: %s", lv.name, exc)


def level_keywords() -> list[tuple[str, Any, Any]]:
    """The tiered store's config beyond its parameters (`Registry.register`'s ``keywords``): a node
    per registered store under its name (``store.hbm``), and the Hydra defaults that fill each
    from that store's ``conf/store/<name>.yaml`` (``optional``: a store without one on the search
    path keeps None), so a new store is a tier without a line in tiered.yaml."""
    names = [name for name in STORES.names() if name != "tiered"]
    defaults = ["_self_"] + [{f"optional /store@{name}": name} for name in names]
    return [(name, Any, None) for name in names] + [("defaults", list, defaults)]
