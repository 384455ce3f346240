"""Capacity: a bounded store kept under its watermarks (`Evictor`), and each upper level of a
tiered store under its own (`Demoter`). `cacheseek.eviction` chooses the order.

Eviction (`Evictor`). After every ingest (`maybe_evict`), when the store's usage is above the high watermark, an
eviction pass frees victims chosen by the policy (leaf-first LRU by default) until usage is at or
below the low watermark. A pass first reclaims the latents of dead subtrees (no blob anywhere
below; only where the store offers ``free_skeleton``), then evicts KV blobs; evicted nodes keep
their latents. Never victims: sink (pinned) nodes of live namespaces (touched by one of the last
``eviction.live_sessions`` sessions: `NamespaceForest.is_live`), nodes being read (``ref_count``)
and writes in flight. The sinks of dead namespaces are ordinary LRU victims, so pins never fill
the store.

One eviction is the node's READY --detach--> FREEING --settle--> EMPTY (`TrieNode`): the store
frees the blob outside the forest lock; a free that fails puts it back. One pass runs at a time
(the manager's ``evict_lock``). A pass that evicted ends with `NamespaceForest.prune`: nodes left
holding no value and namespaces nobody uses leave the trie.

Demotion (`Demoter`, docs/design.md section 3) for a store with levels (``tier_usages``,
``levels_of``, ``pending_levels_of``, ``demote``: `TieredStore`; any other has no levels): after
every ingest and every hit promoted into the top level (``promoted_last_read``), each level but
the last above the high watermark demotes victims (policy order, leaf-first within the level)
down to the low watermark. Runs under the manager's ``evict_lock``; the forest lock is held only
to choose candidates, every store call runs outside it.

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
from typing import TYPE_CHECKING, Optional

from cacheseek.errors import HandleStateError, WriteNotCompleteError
from cacheseek.eviction import Candidate, store_usage
from cacheseek.reuse.exact_prefix.frames import free_frames
from cacheseek.reuse.exact_prefix.types import BlobHandle, NodeState, TrieNode

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["Evictor", "Demoter", "evictable", "holds_blob", "subtree_has_blob"]


class Evictor:
    """Eviction passes and single-blob eviction (see the module docstring)."""

    def __init__(self, ctx: "WorldKVManager", demoter: "Demoter") -> None:
        self.ctx = ctx
        self.demoter = demoter
        demoter.evictor = self  # room made in a tiered store's lowest level evicts through here

    def maybe_evict(self, protect: Optional[TrieNode] = None) -> int:
        """After a write: demote a tiered store's levels (``protect``: the node just written,
        whose path no room-making evicts), then evict down to the low watermark when above the
        high one. Returns the number of blobs evicted."""
        ctx = self.ctx
        self.demoter.demote_tiers(protect)
        u = store_usage(ctx.store)
        if u is None:
            return 0
        ctx.metrics.observe_usage(ctx.clock(), u.used_bytes, u.capacity_bytes, "write")
        if not ctx.eviction.enabled or u.capacity_bytes is None:
            return 0
        if u.used_bytes <= ctx.eviction.high_watermark * u.capacity_bytes:
            return 0
        return self.evict(int(ctx.eviction.low_watermark * u.capacity_bytes))

    def evict(self, target_bytes: int, *, at_least_one: bool = False) -> int:
        """One eviction pass: reclaim dead latents, then evict leaf blobs in the policy's order
        until the store's usage is at or below ``target_bytes`` (or nothing is evictable). A
        parent that becomes a leaf joins the queue; a victim's latent (and its dead ancestors')
        is reclaimed right after it, while usage is still above the target. ``at_least_one``:
        evict one blob even when already below the target (a full store refused a write).
        Errors of single victims are logged and counted, not raised. Returns blobs evicted."""
        ctx = self.ctx
        evicted = 0
        latents = ctx.store.frees_latents

        def above() -> bool:
            u = store_usage(ctx.store)
            return u is not None and u.used_bytes > target_bytes

        with ctx.evict_lock:
            ctx.metrics.add(eviction_passes=1)
            force = at_least_one
            if force or above():
                dead, candidates = self.collect()
                for node in dead if latents else ():
                    if not force and not above():
                        break
                    self.free_dead_latent(node)
                queue = ctx.policy.order(candidates)
                while queue and (force or above()):
                    cand = queue.pop(0)
                    try:
                        done = self.evict_blob(cand.node, honour_pins=False)
                    except Exception as exc:  # noqa: BLE001 - the blob is kept; try the next
                        log.warning("eviction of %r failed (kept): %s", cand.node, exc)
                        ctx.metrics.add(eviction_errors=1)
                        continue
                    if not done:
                        continue
                    evicted += 1
                    force = False
                    for node in self.dead_around(cand.node) if latents else ():
                        if not above():
                            break
                        self.free_dead_latent(node)
                    parent = self.candidate(cand.node.parent)
                    if parent is not None:
                        queue = ctx.policy.order(queue + [parent])
            if evicted:
                ctx.forest.prune(ctx.eviction.live_sessions)  # the nodes left holding nothing
        u = store_usage(ctx.store)
        if u is not None:
            ctx.metrics.observe_usage(ctx.clock(), u.used_bytes, u.capacity_bytes, "evict")
        return evicted

    def collect(self) -> tuple[list[TrieNode], list[Candidate]]:
        """Under the forest lock: dead latents, children before parents (no live blob in the
        node's subtree, not referenced) and eviction candidates (see `candidate`)."""
        ctx = self.ctx
        dead: list[TrieNode] = []
        candidates: list[Candidate] = []
        with ctx.forest.lock:
            for ns in ctx.forest.namespaces():
                live = ctx.forest.is_live(ns, ctx.eviction.live_sessions)
                # iterative post-order: (node, reachable, children visited?)
                stack: list[tuple[TrieNode, bool, bool]] = [(c, True, False) for c in ns.root.children.values()]
                live_below: dict[int, bool] = {}
                while stack:
                    node, reachable, visited = stack.pop()
                    children = list(node.children.values())
                    if not visited:
                        stack.append((node, reachable, True))
                        stack.extend((c, reachable and node.has_kv, False) for c in children)
                        continue
                    child_live = any(live_below[id(c)] for c in children)
                    here = holds_blob(node)
                    live_below[id(node)] = here or child_live
                    if not here and not child_live and node.skeleton is not None and node.ref_count == 0:
                        dead.append(node)
                    if evictable(node, pin_holds=live and node.pinned):
                        candidates.append(Candidate(node, node.blob.nbytes, node.last_access, node.depth,
                                                    reachable))
        return dead, candidates

    def candidate(self, node: Optional[TrieNode]) -> Optional[Candidate]:
        """``node`` as an eviction candidate, or None: a ready blob, not pinned by a live
        namespace, unreferenced, not being evicted, and no child holding a ready or in-flight blob
        (a leaf)."""
        if node is None or node.depth < 0:
            return None
        with self.ctx.forest.lock:
            if not evictable(node, pin_holds=self.pin_holds(node)):
                return None
            reachable = all(a.has_kv for a in node.path()[:-1])
            return Candidate(node, node.blob.nbytes, node.last_access, node.depth, reachable)

    def dead_around(self, node: TrieNode) -> list[TrieNode]:
        """After ``node`` lost its blob: the dead nodes of its subtree (children first), then
        its ancestors that are dead now."""
        with self.ctx.forest.lock:
            if subtree_has_blob(node):
                return []
            stack, order = [node], []
            while stack:
                n = stack.pop()
                order.append(n)
                stack.extend(n.children.values())
            out = [n for n in reversed(order) if n.skeleton is not None]
            up = node.parent
            while up is not None and up.depth >= 0 and not subtree_has_blob(up):
                if up.skeleton is not None:
                    out.append(up)
                up = up.parent
            return out

    def free_dead_latent(self, node: TrieNode) -> bool:
        """Free the latent of a node with no live blob in its subtree (claimed like an
        eviction; a failed handle on it is dropped too)."""
        ctx = self.ctx
        with ctx.forest.lock:
            if node.skeleton is None or node.ref_count or subtree_has_blob(node):
                return False
            latent = node.skeleton
            node.skeleton = None
            node.detach()  # None or a failed handle: the store holds nothing of it
        try:
            ctx.store.free_skeleton(latent.latent_locator)
        except Exception as exc:  # noqa: BLE001 - keep the latent; counted
            log.warning("freeing the latent of %r failed (kept): %s", node, exc)
            ctx.metrics.add(eviction_errors=1)
            with ctx.forest.lock:
                if node.skeleton is None:
                    node.skeleton = latent
            return False
        finally:
            with ctx.forest.lock:
                node.settle()
        ctx.metrics.add(skeletons_freed=1)
        return True

    def pin_holds(self, node: TrieNode) -> bool:
        """Under the forest lock: ``node`` is pinned and its namespace is live."""
        if not node.pinned:
            return False
        top = node
        while top.parent is not None:
            top = top.parent
        forest = self.ctx.forest
        ns = forest.resolve(top.node_key)
        return ns is None or ns.root is not top or forest.is_live(ns, self.ctx.eviction.live_sessions)

    def evict_blob(self, node: TrieNode, *, honour_pins: bool) -> bool:
        """Free a node's KV and drop its blob, keeping the latent. Refuses referenced,
        blob-less, being-evicted and in-flight nodes, and pinned ones: always with
        ``honour_pins``, else only while the namespace is live (the eviction pass). The blob is
        detached under the forest lock and freed outside it; if freeing fails the blob is put
        back and the error propagates (a write still completing: False)."""
        ctx = self.ctx
        with ctx.forest.lock:
            if node.ref_count < 0:
                raise HandleStateError(f"negative ref_count on {node!r}")
            pinned = node.pinned if honour_pins else self.pin_holds(node)
            if pinned or node.ref_count > 0 or node.state not in (NodeState.READY, NodeState.FAILED):
                return False
            handle = node.detach()
        restored = False
        try:
            ctx.store.free(handle)
        except WriteNotCompleteError:
            restored = True
            return False
        except BaseException:
            restored = True
            raise
        finally:
            with ctx.forest.lock:
                node.settle(handle if restored else None)
        free_frames(ctx, node.node_key)  # the chunk's frames leave with its KV
        ctx.encodes.chunk_left(node)  # and its namespace's encodes with its last chunk
        ctx.metrics.add(evictions=1, evicted_bytes=handle.nbytes)
        return True


def holds_blob(node: TrieNode) -> bool:
    """A ready or in-flight blob, or one being freed or invalidated (a failed one holds nothing)."""
    return not node.state.vacant


def evictable(node: TrieNode, *, pin_holds: bool) -> bool:
    """A ready blob that no pin or reader holds, and no child holding a blob (a leaf)."""
    return (node.state is NodeState.READY and not pin_holds and node.ref_count == 0
            and not any(holds_blob(c) for c in node.children.values()))


def subtree_has_blob(node: TrieNode) -> bool:
    """``node`` or a node below it holds a blob (`holds_blob`)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if holds_blob(n):
            return True
        stack.extend(n.children.values())
    return False


class Demoter:
    """Demotion passes over a tiered store and room made for them; a no-op for any other store.
    ``evictor``: evicts a sole copy from the lowest level (None: such victims are skipped)."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx
        self.evictor: Optional[Evictor] = None

    def demote_tiers(self, protect: Optional[TrieNode] = None) -> int:
        """One demotion pass per upper level above the high watermark; ``protect``: the current
        request's node, whose path no room-making evicts. Errors of single victims are logged
        and counted; never raises. Returns the blobs demoted."""
        ctx = self.ctx
        store, eviction = ctx.store, ctx.eviction
        if not eviction.enabled:
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

        def used() -> int:
            u = ctx.store.tier_usages()[level].usage
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
            queue = self._requeue_parent(queue, cand.node, lambda roots: self.level_candidates(level, roots))
        return done

    def _requeue_parent(self, queue: list[Candidate], node: TrieNode, candidates) -> list[Candidate]:
        """``queue`` in policy order with ``node``'s parent added when it became a candidate
        (``candidates(roots)``) now that ``node`` left the level."""
        parent = node.parent
        if parent is None or parent.depth < 0:
            return queue
        return self.ctx.policy.order(queue + [c for c in candidates([parent]) if c.node is parent])

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
            queue = self._requeue_parent(queue, cand.node, lambda roots: self.room_candidates(level, guard, last, roots))
        if not moved:
            ctx.metrics.add(demotion_no_room=1)
            log.info("no room can be made in tier %d for %d B: every candidate is protected", level, nbytes)
        return moved

    def room_candidates(self, level: int, guard: frozenset, last: bool,
                        roots: Optional[list[TrieNode]] = None) -> list[Candidate]:
        """`level_candidates` less the protected nodes; in the ``last`` level, a node whose copy
        there is its only one must also be an eviction candidate (`Evictor.candidate`)."""
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
        if store.frees_latents:
            for dead in evictor.dead_around(node):
                evictor.free_dead_latent(dead)
        return True

    def level_candidates(self, level: int, roots: Optional[list[TrieNode]] = None) -> list[Candidate]:
        """Under the forest lock, the subtrees of ``roots`` (default: every namespace): nodes with
        a ready copy at ``level``, not being read or evicted, and nothing below them at that
        level (ready or in flight): leaf-first within the level, so a chain keeps its prefix
        (a copy is read from a level only together with its whole window)."""
        ctx, store = self.ctx, self.ctx.store

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
