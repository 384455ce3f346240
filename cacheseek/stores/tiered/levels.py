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
from collections.abc import Sequence
from typing import Any, Optional

import attrs
from omegaconf import DictConfig, OmegaConf

from cacheseek.codecs.base import codec_fingerprint
from cacheseek.errors import ConfigError
from cacheseek.kv.handles import Tier
from cacheseek.registry import STORES, instantiate
from cacheseek.stores.base import TierStore, as_store

__all__ = ["Level", "build_stores", "make_levels", "storage_format", "codec_id", "shared_transfer", "close_levels",
           "level_keywords"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Level:
    """One level: its position (0 = fastest), registry ``name``, `Tier`, store (a `TierStore`),
    whether it is a path level (it restores into the ring itself and takes device views on
    write), and its counters (hits, writes, promotions, demotions, failures; see stats)."""

    index: int
    name: str
    store: TierStore
    counters: dict = attrs.field(factory=dict)

    @property
    def tier(self) -> Tier:
        """The `Tier` it stands for (on its blob handles and in the report): the one its
        registered class declares, else its store's."""
        cls = STORES.get(self.name) if self.name in STORES else None
        return cls.tier if isinstance(cls, type) and issubclass(cls, TierStore) else self.store.tier

    @property
    def path(self) -> bool:
        return self.store.reads_paths


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
            built.append((name, as_store(instantiate(node, transfer=transfer))))
    except BaseException:
        for _, store in reversed(built):
            store.close()
        raise
    return built


def make_levels(built: Sequence[tuple[str, Any]]) -> list[Level]:
    """The levels of built ``(name, store)`` pairs, fastest first; none is a `ConfigError`."""
    if not built:
        raise ConfigError("store.tiers", "is empty", "list at least one store, e.g. [hbm,fluxon_plan]")
    return [Level(i, name, as_store(store)) for i, (name, store) in enumerate(built)]


def storage_format(levels: Sequence[Level]) -> str:
    """The namespace's store_format field: levels that all encode values one way share it with a
    plain store of that kind (an HBM tier over a shared Fluxon Plan service reads and writes what
    the other workers do); a mixed hierarchy gets a namespace of its own."""
    formats = [lv.store.storage_format for lv in levels]
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
    return next((lv.store.transfer for lv in levels if lv.store.transfer is not None), None)


def close_levels(levels: Sequence[Level]) -> None:
    """Close every level, last first; a failure is logged and the others are still closed."""
    for lv in reversed(levels):
        try:
            lv.store.close()
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
