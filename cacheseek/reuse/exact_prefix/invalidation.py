"""`Invalidator`: keeps the trie honest about what the store still holds.

A node whose values are gone (the store evicted them, a worker restarted with an old snapshot) or
corrupt is *invalidated*: its blob is dropped and whatever is left of its values is freed, so no
value is orphaned and a later cold run re-ingests the chunk (latent included). A node that a
restore still references is never freed under its reader: it is INVALID at once (`TrieNode`: no
lookup, eviction or re-ingest touches it) and its blob is freed by the last reader's release
(`free_invalidated`).

Which nodes are gone: the one a fetch met, plus every node the store's optional
``contains(keys)`` reports (`find_missing`). `audit` checks every ready node that way;
`reconcile` first removes the values no node names (a previous process's leftovers, where the
store offers ``keys()`` and ``delete_values(keys)``; on a store with shared chunk records, the
values no record names and no writer can still be writing: the store's ``orphans()``), unless the
forest's snapshot did not load whole (then the unnamed values may be committed chunks: kept).
Stored session encodes are no chunk's values and are kept (`encodes`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from cacheseek.errors import StoreError
from cacheseek.reuse.exact_prefix.encodes import is_encode_locator
from cacheseek.reuse.exact_prefix.frames import free_frames
from cacheseek.kv.locators import decoder_state_locator
from cacheseek.reuse.exact_prefix.keys import blob_keys, frames_locator, layer_keys
from cacheseek.reuse.exact_prefix.types import BlobHandle, NodeState, TrieNode

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["Invalidator", "owner_of"]


class Invalidator:
    """Finds the nodes whose values the store lost and drops their blobs (see the module
    docstring). Store calls run outside the forest lock."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx

    def find_missing(
        self, path: Sequence[TrieNode], win: Sequence[TrieNode], first: Optional[TrieNode]
    ) -> tuple[TrieNode, ...]:
        """The nodes of ``path`` whose latent or (``win`` nodes) KV values are gone: ``first``
        (the one a fetch met) plus every node the store's ``contains`` reports missing; by depth."""
        found: dict[int, TrieNode] = {} if first is None else {id(first): first}
        if self.ctx.store.knows_contents:
            owners: list[TrieNode] = []
            keys: list[str] = []
            for n in path:
                if n.skeleton is not None:
                    owners.append(n)
                    keys.append(n.skeleton.latent_locator)
            for n in win:
                blob = n.blob
                if blob is None:
                    continue
                for key in blob_keys(blob.locator, blob.n_layers, pairs=blob.pairs):
                    owners.append(n)
                    keys.append(key)
            try:
                present = self.ctx.store.contains(keys)
            except Exception as exc:  # noqa: BLE001 - cannot tell: only what the fetch saw
                log.warning("could not check which values are missing: %s", exc)
                present = [True] * len(keys)
            for n, ok in zip(owners, present):
                if not ok:
                    found[id(n)] = n
        return tuple(sorted(found.values(), key=lambda n: n.depth))

    def invalidate(self, nodes: Sequence[TrieNode]) -> int:
        """Drop the blobs of nodes whose values are (partly) gone or corrupt and free what is left
        of them; a referenced node is only marked (freed by its last reader). Nodes without a
        blob, being evicted or with a write in flight are skipped. Returns how many."""
        ctx = self.ctx
        count = 0
        for node in nodes:
            with ctx.forest.lock:
                if node.state not in (NodeState.READY, NodeState.FAILED):
                    continue
                if node.ref_count > 0:
                    node.invalidate(StoreError(f"{node.blob.locator}: invalidated (its values are gone)"))
                    count += 1
                    log.info("invalidated %r; freeing it when its last reader releases it", node)
                    continue
                handle = node.detach()
            self.free_detached(node, handle)
            count += 1
            log.info("invalidated %r: its values are no longer in the store", node)
        if count:
            ctx.metrics.add(invalidations=count)
        return count

    def free_invalidated(self, node: TrieNode) -> None:
        """Free the blob of a node invalidated while referenced, once nothing references it."""
        with self.ctx.forest.lock:
            if node.state is not NodeState.INVALID or node.ref_count > 0:
                return
            handle = node.detach()
        self.free_detached(node, handle)

    def free_detached(self, node: TrieNode, handle: BlobHandle) -> None:
        """Free the blob `TrieNode.detach` took from ``node``, then `TrieNode.settle` it; a failed
        free puts the handle back as a failed blob, freed again later."""
        kept = None
        try:
            self.ctx.store.free(handle)
            free_frames(self.ctx, node.node_key)
            self.ctx.encodes.chunk_left(node)
        except Exception as exc:  # noqa: BLE001 - keep it as a failed blob: freed later
            log.warning("invalidated %r but freeing its values failed: %s", node, exc)
            handle.fail(exc)
            kept = handle
        finally:
            with self.ctx.forest.lock:
                node.settle(kept)

    def audit(self) -> int:
        """Invalidate the ready nodes whose values ``contains`` says are gone; how many (0 when
        the store cannot say)."""
        ctx = self.ctx
        if not ctx.store.knows_contents:
            return 0
        with ctx.forest.lock:
            ready = [n for ns in ctx.forest.namespaces() for n in ns.iter_nodes() if n.has_kv]
        stale = [n for n in ready if self.find_missing([n], [n], None)]
        return self.invalidate(stale)

    def reconcile(self) -> dict[str, int]:
        """Remove the values no node names (see the module docstring), then `audit`. Not while
        sessions write: a value written but not yet named by its node would be taken for an
        orphan."""
        ctx = self.ctx
        removed = 0
        incomplete = ctx.forest.incomplete

        def remove(keys: Sequence[str], which: str) -> int:
            orphans = [k for k in keys if not is_encode_locator(k)]  # an encode is no chunk's: kept
            if orphans:
                ctx.store.delete_values(orphans)
                log.info("reconcile: removed %d values %s", len(orphans), which)
            return len(orphans)

        if ctx.store.lists_values and ctx.store.records.shared:
            # The records name what is committed; other processes may be writing: the store removes
            # only values without a record that are older than any write in flight.
            removed = remove(ctx.store.orphans(), "of chunks never committed (no record)")
        elif incomplete and ctx.store.lists_values:
            log.warning("reconcile removes nothing: the forest snapshot did not load whole (%s); the "
                        "values it named stay until a snapshot that names them, or none, is loaded", incomplete)
        elif ctx.store.lists_values:
            with ctx.forest.lock:
                named: set[str] = set()
                for ns in ctx.forest.namespaces():
                    for n in ns.iter_nodes():
                        if n.skeleton is not None:
                            named.add(n.skeleton.latent_locator)
                        if n.blob is not None:
                            named.update(blob_keys(n.blob.locator, n.blob.n_layers, pairs=n.blob.pairs))
                            named.add(frames_locator(n.node_key))
                            named.add(decoder_state_locator(n.node_key))
            removed = remove([k for k in ctx.store.keys() if k not in named], "no node names")
        return {"orphans_removed": removed, "invalidated": self.audit()}


def owner_of(key: str, path: Sequence[TrieNode], win: Sequence[TrieNode]) -> Optional[TrieNode]:
    """The node of ``path`` whose latent or (``win`` nodes) KV value is stored under ``key``."""
    for n in path:
        if n.skeleton is not None and n.skeleton.latent_locator == key:
            return n
    for n in win:
        blob = n.blob
        if blob is not None and any(key in layer_keys(blob.locator, i) for i in range(blob.n_layers)):
            return n
    return None
