"""`Demoter`: keeps the upper levels of a tiered store under their watermarks, and makes room in
a full level when a demotion into it is refused.

For a store offering ``tier_usages``, ``levels_of``, ``pending_levels_of`` and ``demote``
(`TieredStore`): after every ingest and every hit, each level but the last whose usage is above
the high watermark *demotes* victims down to the low watermark, chosen by the eviction policy
among the nodes held at that level, leaf-first within the level (no child held there): the store
keeps (or first writes) a copy below, then frees that level's. The last level is bounded by the
ordinary eviction (`Evictor`). Runs under the context's ``evict_lock``; the forest lock is held
only to choose candidates, every store call runs outside it.

Making room (`make_room`, handed to the store's ``demote``): a demotion whose write into the
level below is refused as full asks for room there; victims are chosen exactly as for a
demotion pass of that level (leaf-first within it, policy order) until its usage is at or
below ``min(low watermark, capacity - bytes)``, at least one::

    a middle level's victim  --> demoted further down (the same call: room is made below
                                 it in turn, recursively)
    the lowest level's victim --> evicted: ``evict_copy`` when another level keeps a copy (the
                                 node keeps its blob), else the `Evictor`'s ``evict_blob``
                                 (sole copy: only a leaf of the whole trie that no live pin
                                 holds; its dead latents are reclaimed with it)

Never victims: nodes being read (``ref_count``), nodes not READY (`TrieNode.state`), and
the *protected* path: the current request's (``protect``) and every node whose demotion is
waiting for the room (with its ancestors), so a chain keeps its prefix. Each victim that leaves a
level is counted (``evictions_for_demotion``, per level in the store's stats); no victim at all
is ``demotion_no_room`` and the demotion fails as before: nothing lost, the copy stays above.
"""

from __future__ import annotations

import logging
from typing import Optional, Protocol

from cacheseek.eviction import Candidate
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.types import BlobHandle, TrieNode

log = logging.getLogger(__name__)

__all__ = ["Demoter", "BlobEvictor"]


class BlobEvictor(Protocol):
    """What making room in the lowest level needs of the `Evictor` (which sets itself as the
    demoter's ``evictor``): its candidate rule, its single-blob eviction, its dead latents."""

    def candidate(self, node: Optional[TrieNode]) -> Optional[Candidate]: ...

    def evict_blob(self, node: TrieNode, *, honour_pins: bool) -> bool: ...

    def dead_around(self, node: TrieNode) -> list[TrieNode]: ...

    def free_dead_latent(self, node: TrieNode) -> bool: ...


class Demoter:
    """Demotion passes over a tiered store and room made for them; a no-op for any other store.
    ``evictor``: evicts a sole copy from the lowest level (None: such victims are skipped)."""

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx
        self.evictor: Optional[BlobEvictor] = None

    def demote_tiers(self, protect: Optional[TrieNode] = None) -> int:
        """One demotion pass per upper level above the high watermark; ``protect``: the current
        request's node, whose path no room-making evicts. Errors of single victims are logged
        and counted; never raises. Returns the blobs demoted."""
        ctx = self.ctx
        store, eviction = ctx.store, ctx.eviction
        if not eviction.enabled or not ctx.offers.tiered:
            return 0
        demoted = 0
        guard = frozenset(id(n) for n in protect.path()) if protect is not None else frozenset()
        try:
            with ctx.evict_lock:
                for tu in store.tier_usages()[:-1]:
                    u = tu.usage
                    if u is None or u.capacity_bytes is None or u.used_bytes <= eviction.high_watermark * u.capacity_bytes:
                        continue
                    demoted += self._demote_level(tu.level, int(eviction.low_watermark * u.capacity_bytes), guard)
        except Exception:  # noqa: BLE001 - a cache must never take a session down
            log.exception("tier demotion pass failed")
            ctx.metrics.add(demotion_errors=1)
        return demoted

    def _demote_level(self, level: int, target_bytes: int, guard: frozenset) -> int:
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
                ok = self.demote(cand.node, level, guard)
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

    def demote(self, node: TrieNode, level: int, guard: frozenset) -> bool:
        """The store's demotion of ``node``'s blob from ``level``; a full level below is made
        room in (`make_room`) with ``node``'s path protected besides ``guard``. Raises what the
        store raises."""
        keep = guard | {id(n) for n in node.path()}
        blob = node.blob
        if blob is None:
            return False
        return self.ctx.store.demote(blob, level, make_room=lambda dst, nbytes: self.make_room(dst, nbytes, keep))

    def make_room(self, level: int, nbytes: int, guard: frozenset = frozenset()) -> int:
        """Move victims out of ``level`` until its usage is at or below ``min(low watermark,
        capacity - nbytes)`` (at least one; see the module docstring); ``guard``: ids of nodes
        never chosen. Errors of single victims are logged and counted. Returns how many left."""
        ctx = self.ctx
        store = ctx.store
        if not ctx.eviction.enabled:
            return 0
        usages = store.tier_usages()
        u = usages[level].usage
        if u is None or u.capacity_bytes is None:
            return 0
        last = level == len(usages) - 1
        target = max(0, min(int(ctx.eviction.low_watermark * u.capacity_bytes), u.capacity_bytes - nbytes))

        def above() -> bool:
            now = store.tier_usages()[level].usage
            return now is not None and now.used_bytes > target

        queue = ctx.policy.order(self.room_candidates(level, guard, last))
        moved = 0
        while queue and (moved == 0 or above()):
            cand = queue.pop(0)
            try:
                ok = self._vacate(cand.node, level, last, guard)
            except Exception as exc:  # noqa: BLE001 - the victim stays; try the next
                log.warning("making room in tier %d: moving %r out failed (kept): %s", level, cand.node, exc)
                ctx.metrics.add(demotion_errors=1)
                continue
            if not ok:
                continue
            moved += 1
            ctx.metrics.add(evictions_for_demotion=1)
            parent = cand.node.parent
            if parent is not None and parent.depth >= 0:
                fresh = [c for c in self.room_candidates(level, guard, last, [parent]) if c.node is parent]
                queue = ctx.policy.order(queue + fresh)
        if not moved:
            ctx.metrics.add(demotion_no_room=1)
            log.info("no room can be made in tier %d for %d B: every candidate is protected", level, nbytes)
        return moved

    def room_candidates(self, level: int, guard: frozenset, last: bool,
                        roots: Optional[list[TrieNode]] = None) -> list[Candidate]:
        """`level_candidates` less the protected nodes; in the ``last`` level, a node whose copy
        there is its only one must also be an eviction candidate (`BlobEvictor.candidate`)."""
        store = self.ctx.store
        out = []
        for c in self.level_candidates(level, roots):
            if id(c.node) in guard:
                continue
            if last and not any(i != level for i in store.levels_of(c.node.blob)):
                if self.evictor is None or self.evictor.candidate(c.node) is None:
                    continue
            out.append(c)
        return out

    def _vacate(self, node: TrieNode, level: int, last: bool, guard: frozenset) -> bool:
        """Move ``node``'s blob out of ``level``: demoted further down, or evicted from the last
        level (see the module docstring). False when it stayed."""
        store = self.ctx.store
        blob = node.blob
        if blob is None:
            return False
        if not last:
            return self.demote(node, level, guard)
        if any(i != level for i in store.levels_of(blob)):
            return store.evict_copy(blob, level)
        evictor = self.evictor
        if evictor is None or not evictor.evict_blob(node, honour_pins=False):
            return False
        if self.ctx.offers.frees_latents:
            for dead in evictor.dead_around(node):
                evictor.free_dead_latent(dead)
        return True

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
                    if (here and not child_any and node.has_kv and node.ref_count == 0
                            and level in store.levels_of(node.blob)):
                        reachable = all(a.has_kv for a in node.path()[:-1])
                        out.append(Candidate(node, node.blob.nbytes, node.last_access, node.depth, reachable))
        return out
