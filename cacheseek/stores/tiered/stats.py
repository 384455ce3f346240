"""What a tiered store reports: every level's usage and blobs (`TierUsage`, the manager's
per-level demotion passes read it) and the stats shown in the report and results.json
(`TieredStats`: the store's totals and one row per level)."""

from __future__ import annotations

from typing import Any, Optional

import attrs

from cacheseek.eviction.base import StoreUsage, store_usage
from cacheseek.metrics import store_stats
from cacheseek.kv.handles import Tier
from cacheseek.stores.tiered.residency import Residency

__all__ = ["TierUsage", "TieredStats", "tier_usages", "tiered_stats"]


@attrs.frozen(slots=True)
class TierUsage:
    """One level: its position, registry ``name``, `Tier`, usage (None: it cannot say) and the
    number of blobs it holds (ready copies)."""

    level: int
    name: str
    tier: Tier
    usage: Optional[StoreUsage]
    blobs: int


@attrs.frozen(slots=True)
class TieredStats:
    """``totals`` of the tiered store and one row per level (usage, blobs, hits, writes,
    promotions, demotions and their failures (``demotion_no_room``: the level below was full),
    ``evictions_for_demotion`` (victims moved out of the level to let a demotion in), and the
    level's own stats under ``store``).
    ``put_failures``, ``pending_writes`` and ``register_seconds`` sum the levels' for the report."""

    totals: dict
    tiers: list

    def as_dict(self) -> dict[str, Any]:
        def total(key: str) -> Any:
            return sum((r["store"] or {}).get(key) or 0 for r in self.tiers)

        return dict(self.totals, tiers=[dict(r) for r in self.tiers],
                    put_failures=sum(r.get("write_failures", 0) for r in self.tiers),
                    pending_writes=total("pending_writes"), register_seconds=total("register_seconds"))


def tier_usages(book: Residency, *, closed: bool) -> list[TierUsage]:
    """Every level's usage (None once the store is ``closed``) and ready blobs, fastest first."""
    counts = book.ready_counts()
    return [TierUsage(lv.index, lv.name, lv.tier, None if closed else store_usage(lv.store), counts[lv.index])
            for lv in book.levels]


def tiered_stats(book: Residency, usages: list[TierUsage]) -> TieredStats:
    """The store's totals and, per level, its usage, counters and own stats."""
    with book.lock:
        counters = dict(book.counters)
        per = [dict(lv.counters) for lv in book.levels]
    rows = []
    for u, c, lv in zip(usages, per, book.levels):
        rows.append(dict(level=u.level, name=u.name, tier=u.tier.value, blobs=u.blobs,
                         used_bytes=u.usage.used_bytes if u.usage else None,
                         capacity_bytes=u.usage.capacity_bytes if u.usage else None,
                         **c, store=store_stats(lv.store)))
    return TieredStats(counters, rows)
