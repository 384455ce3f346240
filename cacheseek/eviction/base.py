"""Capacity and eviction: what a store reports, what a policy decides, how the manager asks.

The seam is split by role (one side decides, the other moves bytes): a store *accounts* its bytes and moves none of
the decisions; a policy *orders* candidates and touches no store; the manager (`WorldKVManager`)
collects the candidates from the trie, asks the policy, and frees the victims' values.

Store capabilities, each optional (`cacheseek.stores.base.TierStore`: a default, or a class flag):

- ``usage() -> StoreUsage | PlanUsage | None``: bytes in use and the capacity (None = unbounded).
  Generic tiers count the bytes of their live values (KV and latents, writes in flight included);
  the Plan tier reports its client's segment usage. Without it the store is unbounded.
- ``contains(keys) -> list[bool]`` (``knows_contents``): which values exist, without reading them. Lets a failed
  restore name the nodes whose values are gone (`WorldKVManager` invalidates exactly those).
- ``free_skeleton(locator)`` (``frees_latents``): removes a latent (idempotent). Lets the manager reclaim the latents
  of dead subtrees (no blob anywhere below); without it latents are kept.
- ``get_layers(requests) -> list``: the layers of a whole restore in one call (`KeyValueTier`:
  up to ``read_parallelism`` values read at once); by default ``get_layer`` of each in turn.

A victim is a READY leaf, not pinned by a live namespace, that no restore reads; its eviction
is the node's READY --> FREEING --> EMPTY (`cacheseek.reuse.exact_prefix.types.TrieNode`).

Pins: a sink chunk (depth < ``sink_chunks``) is pinned, and a pin holds only while its namespace
is *live*: touched (looked up or written) by one of the last ``live_sessions`` sessions of the
forest (`NamespaceForest.is_live`). The sinks of namespaces nobody uses any more are ordinary
LRU victims, so pins cannot fill a store: at most ``live_sessions`` namespaces' sinks are held.

A *leaf* is a node none of whose children holds a blob (ready or in flight), so evicting it
never breaks the prefix of another cached node: lookups descend only through ready nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import ConfigError

__all__ = ["StoreUsage", "EvictionConfig", "Candidate", "EvictionPolicy", "store_usage"]


@attrs.frozen(slots=True)
class StoreUsage:
    """Bytes a store holds: ``used_bytes`` of ``capacity_bytes`` (None = unbounded), the highest
    ``peak_bytes`` it ever reached (None when the store does not track it), ``n_values``."""

    used_bytes: int
    capacity_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None
    n_values: Optional[int] = None

    @property
    def bounded(self) -> bool:
        return self.capacity_bytes is not None


def store_usage(store: Any) -> Optional[StoreUsage]:
    """The store's ``usage()`` as a `StoreUsage`, or None when it cannot say (None, a failure, a
    closed store). Takes a usage of any type with ``used_bytes`` and ``capacity_bytes`` (a Plan
    client's `PlanUsage`)."""
    try:
        u = store.usage()
    except Exception:  # noqa: BLE001 - a closed store or a client that cannot say: unbounded
        return None
    if u is None or isinstance(u, StoreUsage):
        return u
    return StoreUsage(used_bytes=int(u.used_bytes),
                      capacity_bytes=None if u.capacity_bytes is None else int(u.capacity_bytes),
                      peak_bytes=getattr(u, "peak_bytes", None), n_values=getattr(u, "n_values", None))


def _fraction(name: str):
    def check(_inst: Any, _attr: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            default = attrs.fields_dict(EvictionConfig)[name].default
            raise ConfigError(f"manager.eviction.{name}", f"must be a fraction of the capacity in (0, 1], "
                              f"got {value!r}", f"manager.eviction.{name}={default} (the default)")

    return check


@attrs.frozen(slots=True)
class EvictionConfig:
    """``manager.eviction``: the policy (an `EVICTION_POLICIES` name) and the watermarks, as
    fractions of the store's capacity. Above ``high_watermark`` after a write, victims are
    evicted until usage is at or below ``low_watermark``. ``enabled`` False turns automatic
    eviction off (a full store then drops writes). ``live_sessions``: the pins (sink chunks) of a
    namespace hold while it was touched by one of the last ``live_sessions`` sessions; keep it
    below the store's capacity in namespaces' sinks (capacity / (sink chunks x chunk bytes))."""

    policy: str = "lru"
    high_watermark: float = attrs.field(default=0.9, validator=_fraction("high_watermark"))
    low_watermark: float = attrs.field(default=0.7, validator=_fraction("low_watermark"))
    enabled: bool = True
    live_sessions: int = attrs.field(default=4)

    @live_sessions.validator
    def _check_live(self, _attr: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("manager.eviction.live_sessions", f"must be an integer >= 1, got {value!r}",
                              "manager.eviction.live_sessions=4 (the default)")

    def __attrs_post_init__(self) -> None:
        if self.low_watermark > self.high_watermark:
            raise ConfigError("manager.eviction.low_watermark",
                              f"{self.low_watermark} is above high_watermark {self.high_watermark}",
                              "keep low_watermark <= high_watermark")

    @classmethod
    def from_conf(cls, node: Any) -> "EvictionConfig":
        """From the ``manager.eviction`` config section (a mapping or an object), or defaults."""
        if node is None:
            return cls()
        get = node.get if hasattr(node, "get") else lambda k, d=None: getattr(node, k, d)
        d = cls()
        return cls(policy=str(get("policy", d.policy)), high_watermark=get("high_watermark", d.high_watermark),
                   low_watermark=get("low_watermark", d.low_watermark), enabled=bool(get("enabled", d.enabled)),
                   live_sessions=get("live_sessions", d.live_sessions))


@attrs.frozen(slots=True)
class Candidate:
    """A node whose blob may be evicted now, as the policy sees it.

    ``reachable``: every ancestor has KV, so a lookup can reach this node. An unreachable blob
    (an ancestor lost its KV) cannot be hit until that ancestor is written again."""

    node: Any = attrs.field(eq=False)
    nbytes: int
    last_access: float
    depth: int
    reachable: bool


class EvictionPolicy(Protocol):
    """Orders eviction candidates, first victim first. Pure: reads the candidates, nothing else.

    The manager evicts in that order until usage is at or below the low watermark, collecting
    fresh candidates when it runs out (evicting a leaf can make its parent a leaf)."""

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]: ...
