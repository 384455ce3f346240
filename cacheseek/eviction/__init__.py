"""Capacity accounting and eviction policies (torch-free). Importing registers ``lru``."""

from cacheseek.errors import ConfigError
from cacheseek.eviction import lru  # noqa: F401  (registers the built-in policies)
from cacheseek.eviction.base import Candidate, EvictionConfig, EvictionPolicy, StoreUsage, store_usage
from cacheseek.eviction.lru import LruPolicy
from cacheseek.registry import EVICTION_POLICIES

__all__ = ["Candidate", "EVICTION_POLICIES", "EvictionConfig", "EvictionPolicy", "LruPolicy", "StoreUsage",
           "make_policy", "store_usage"]


def make_policy(name: str) -> EvictionPolicy:
    """A new policy instance by registry name; `ConfigError` listing the known names otherwise."""
    try:
        cls = EVICTION_POLICIES.get(name)
    except ConfigError as exc:
        raise ConfigError("manager.eviction.policy", exc.problem, exc.fix) from None
    return cls()
