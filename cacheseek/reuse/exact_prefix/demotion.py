"""`Demoter`: keeps the upper levels of a tiered store under their watermarks.

For a store offering ``tier_usages``, ``levels_of``, ``pending_levels_of`` and ``demote``
(`TieredStore`): after every ingest and every hit, each level but the last whose usage is above
the high watermark *demotes* victims down to the low watermark, chosen by the eviction policy
among the nodes held at that level, leaf-first within the level (no child held there): the store
keeps (or first writes) a copy below, then frees that level's. The last level is bounded by the
ordinary eviction (`Evictor`). Runs under the context's ``evict_lock``; the forest lock is held
only to choose candidates, every store call runs outside it.
"""

from __future__ import annotations

import logging
from typing import Optional

from cacheseek.eviction import Candidate
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.types import BlobHandle, TrieNode

log = logging.getLogger(__name__)

__all__ = ["Demoter"]


class Demoter:
    """Demotion passes over a tiered store; a no-op for any other store."""

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    def demote_tiers(self) -> int:
        """One demotion pass per upper level above the high watermark. Errors of single victims
        are logged and counted; never raises. Returns the blobs demoted."""
        ctx = self.ctx
        store, eviction = ctx.store, ctx.eviction
        usages_fn = getattr(store, "tier_usages", None)
        if not eviction.enabled or not callable(usages_fn) or not callable(getattr(store, "demote", None)):
            return 0
        demoted = 0
        try:
            with ctx.evict_lock:
                for tu in usages_fn()[:-1]:
                    u = tu.usage
                    if u is None or u.capacity_bytes is None or u.used_bytes <= eviction.high_watermark * u.capacity_bytes:
                        continue
                    demoted += self._demote_level(tu.level, int(eviction.low_watermark * u.capacity_bytes))
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("tier demotion pass failed")
            ctx.metrics.add(demotion_errors=1)
        return demoted

    def _demote_level(self, level: int, target_bytes: int) -> int:
        ctx = self.ctx
        store = ctx.store

        def used() -> int:
            u = store.tier_usages()[level].usage
            return u.used_bytes if u is not None else 0

        ctx.metrics.add(demotion_passes=1)
        queue = ctx.policy.order(self.level_candidates(level))
        done = 0
        while queue and used() > target_bytes:
            cand = queue.pop(0)
            blob = cand.node.blob
            if blob is None:
                continue
            try:
                ok = store.demote(blob, level)
            except Exception as exc:  # noqa: BLE001 - the copy is kept; try the next
                log.warning("demotion of %r from tier %d failed (kept): %s", cand.node, level, exc)
                ctx.metrics.add(demotion_errors=1)
                continue
            if not ok:
                continue
            done += 1
            ctx.metrics.add(demotions=1, demoted_bytes=blob.nbytes)
            parent = cand.node.parent
            if parent is not None and parent.depth >= 0:
                fresh = [c for c in self.level_candidates(level, [parent]) if c.node is parent]
                queue = ctx.policy.order(queue + fresh)
        return done

    def level_candidates(self, level: int, roots: Optional[list[TrieNode]] = None) -> list[Candidate]:
        """Under the forest lock, the subtrees of ``roots`` (default: every namespace): nodes with
        a ready copy at ``level``, not being read or evicted, and nothing below them at that
        level (ready or in flight): leaf-first within the level, so a chain keeps its prefix
        (a copy is read from a level only together with its whole window)."""
        ctx = self.ctx
        store = ctx.store

        def at_level(blob: Optional[BlobHandle]) -> bool:
            return blob is not None and (level in store.levels_of(blob) or level in store.pending_levels_of(blob))

        out: list[Candidate] = []
        with ctx.forest.lock:
            if roots is None:
                roots = [c for ns in ctx.forest.namespaces() for c in ns.root.children.values()]
            for start in roots:
                below: dict[int, bool] = {}
                stack: list[tuple[TrieNode, bool]] = [(start, False)]
                while stack:
                    node, visited = stack.pop()
                    children = list(node.children.values())
                    if not visited:
                        stack.append((node, True))
                        stack.extend((c, False) for c in children)
                        continue
                    child_any = any(below[id(c)] for c in children)
                    here = at_level(node.blob)
                    below[id(node)] = here or child_any
                    if (here and not child_any and node.has_kv and node.ref_count == 0 and not node.evicting
                            and level in store.levels_of(node.blob)):
                        reachable = all(a.has_kv for a in node.path()[:-1])
                        out.append(Candidate(node, node.blob.nbytes, node.last_access, node.depth, reachable))
        return out
