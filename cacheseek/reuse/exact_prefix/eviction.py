"""`Evictor`: keeps a bounded store under its watermarks (`cacheseek.eviction` chooses the order).

After every ingest (`maybe_evict`), when the store's usage is above the high watermark, an
eviction pass frees victims chosen by the policy (leaf-first LRU by default) until usage is at or
below the low watermark. A pass first reclaims the latents of dead subtrees (no blob anywhere
below; only where the store offers ``free_skeleton``), then evicts KV blobs; evicted nodes keep
their latents. Never victims: sink (pinned) nodes of live namespaces (touched by one of the last
``eviction.live_sessions`` sessions: `NamespaceForest.is_live`), nodes being read (``ref_count``)
and writes in flight. The sinks of dead namespaces are ordinary LRU victims, so pins never fill
the store.

One eviction is the node's READY --detach--> FREEING --settle--> EMPTY (`TrieNode`): the store
frees the blob outside the forest lock; a free that fails puts it back. One pass runs at a time (the context's ``evict_lock``). A pass that evicted ends with
`NamespaceForest.prune`: nodes left holding no value and namespaces nobody uses leave the trie.
"""

from __future__ import annotations

import logging
from typing import Optional

from cacheseek.errors import HandleStateError, WriteNotCompleteError
from cacheseek.eviction import Candidate, store_usage
from cacheseek.reuse.exact_prefix.context import ManagerContext
from cacheseek.reuse.exact_prefix.frames import free_frames
from cacheseek.reuse.exact_prefix.demotion import Demoter
from cacheseek.reuse.exact_prefix.types import NodeState, TrieNode

log = logging.getLogger(__name__)

__all__ = ["Evictor", "evictable", "holds_blob", "subtree_has_blob"]


class Evictor:
    """Eviction passes and single-blob eviction (see the module docstring)."""

    def __init__(self, ctx: ManagerContext, demoter: Demoter) -> None:
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
        latents = ctx.offers.frees_latents

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
