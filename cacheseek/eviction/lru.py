"""The ``lru`` eviction policy: leaf-first, least recently used first."""

from __future__ import annotations

from collections.abc import Sequence

from cacheseek.eviction.base import Candidate
from cacheseek.registry import EVICTION_POLICIES

__all__ = ["LruPolicy"]


@EVICTION_POLICIES.register("lru")
class LruPolicy:
    """Unreachable blobs first (no lookup can hit them until an ancestor is written again), then
    the least recently used (``last_access``: written or restored), deeper first on a tie."""

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.reachable, c.last_access, -c.depth))
