"""`FastForward`: decides how many chunks of a new session are restored instead of computed.

It looks up the longest ready prefix of the session's actions (the local trie, then the store's
chunk records past its end: `SharedIndex`), refuses hits below break-even,
and restores the window path ending there (`Restorer`). For a live session it also restores one
chunk at a time (`restore_chunk`) while the session follows a cached path. When the restore finds values gone (the
stale nodes are invalidated by then) or the path changed under it, it retries the longest shorter
prefix that ends before the first broken node, down to break-even, instead of running cold. Any
other failure (a store error, a layout mismatch, a bug) runs the session cold and leaves the trie
as it was: a cache must never take a session down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

from cacheseek.errors import CacheSeekError
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.demotion import Demoter
from cacheseek.reuse.exact_prefix.restore import Outcome, Restorer, RestoreWindow
from cacheseek.reuse.exact_prefix.shared_index import SharedIndex
from cacheseek.reuse.exact_prefix.trie import Namespace, PrefixMatch
from cacheseek.reuse.exact_prefix.types import ActionKey, FastForwardResult, TrieNode

log = logging.getLogger(__name__)

__all__ = ["FastForward", "cold"]


class FastForward:
    """The read side's decision loop (see the module docstring). After a hit it runs a demotion
    pass: a promotion by a tiered store may have filled its top tier."""

    def __init__(self, ctx: ManagerContext, restorer: Restorer, demoter: Demoter,
                 index: Optional[SharedIndex] = None) -> None:
        self.ctx = ctx
        self.restorer = restorer
        self.demoter = demoter
        self.index = index if index is not None else SharedIndex.off(ctx)

    def try_fast_forward(
        self, root_hash: bytes, actions: Sequence[ActionKey], window: RestoreWindow
    ) -> FastForwardResult:
        ctx = self.ctx
        ctx.metrics.add(prefix_lookups=1)
        ctx.forest.begin_session(root_hash)
        requested = len(actions)
        limit = requested
        while True:
            match = self.index.extend(ctx.forest.lookup(root_hash, actions[:limit]), actions, limit)
            if not self._worth_restoring(match):
                return cold(match.namespace)
            outcome = self._restore(match.node, window, match.matched_len)
            if outcome is not None and outcome.ok:
                ctx.metrics.record_hit(match.matched_len, requested, outcome.tier)
                self.demoter.demote_tiers(protect=match.node)
                return FastForwardResult(match.matched_len, match.node, match.namespace)
            if outcome is None or not outcome.retryable:
                ctx.metrics.add(restore_failures=1)
                return cold(match.namespace)
            limit = outcome.retry_limit(match.matched_len)
            ctx.metrics.add(restore_retries=1)
            log.info("restore of depth %d found %s; retrying depth <= %d", match.matched_len,
                     f"{len(outcome.missing)} stale nodes" if outcome.missing else "the path changed", limit)

    def find(self, root_hash: bytes, actions: Sequence[ActionKey]) -> FastForwardResult:
        """The longest ready prefix of ``actions`` (the local trie, then the store's records),
        counted as a lookup and a hit or miss like `try_fast_forward`, but restoring nothing: a
        session that hands out its chunks' stored frames (`handout.HandOut`) restores the KV only
        where it computes, and a prefix found gone then is computed again."""
        ctx = self.ctx
        ctx.metrics.add(prefix_lookups=1)
        ctx.forest.begin_session(root_hash)
        match = self.index.extend(ctx.forest.lookup(root_hash, actions), actions, len(actions))
        if not self._worth_restoring(match):
            return cold(match.namespace)
        ctx.metrics.record_hit(match.matched_len, len(actions))
        return FastForwardResult(match.matched_len, match.node, match.namespace)

    def _worth_restoring(self, match: PrefixMatch) -> bool:
        """Whether a lookup's ``match`` is a hit: something matched, at least ``break_even_k``
        chunks deep; otherwise it counts as a miss or below break-even."""
        if match.namespace is None or match.matched_len == 0 or match.node is None:
            self.ctx.metrics.add(misses=1)
            return False
        if match.matched_len < self.ctx.cfg.break_even_k:
            self.ctx.metrics.add(below_break_even=1)
            return False
        return True

    def restore_chunk(self, node: TrieNode, window: RestoreWindow) -> bool:
        """Restore ``node`` alone, the next chunk of a live session on a cached path; whether the
        window published it (its ``published``). A miss (values found gone: invalidated, as for
        any restore) is ``live_misses``; a failure ``live_restore_failures``; either leaves the
        runtime as it was, and the chunk is computed. A failure after publication (releasing
        the references, the counters) does not unpublish: the chunk counts as restored."""
        ctx = self.ctx
        outcome = self._restore(node, window, node.depth + 1, chunk_only=True)
        if getattr(window, "published", outcome is not None and outcome.ok):
            ctx.metrics.record_live_hit(node.depth, outcome.tier if outcome is not None else None)
            self.demoter.demote_tiers(protect=node)
            return True
        ctx.metrics.add(**{"live_misses" if outcome is not None else "live_restore_failures": 1})
        return False

    def _restore(self, node: TrieNode, window: RestoreWindow, matched_len: int, *,
                 chunk_only: bool = False) -> Optional[Outcome]:
        """The restore's outcome, or None when it raised (logged)."""
        try:
            return self.restorer.restore(node, window, chunk_only=chunk_only)
        except CacheSeekError as exc:
            log.warning("restore of depth %d failed, running cold: %s", matched_len, exc)
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("restore of depth %d failed unexpectedly, running cold", matched_len)
        return None


def cold(namespace: Optional[Namespace]) -> FastForwardResult:
    """Run from chunk 0; ``node`` is the namespace's virtual root (the parent of chunk 0's
    ingest, as upstream returns it), None on a namespace miss."""
    return FastForwardResult(0, namespace.root if namespace is not None else None, namespace)
