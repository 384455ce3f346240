"""Trie value types: actions, trie nodes and the one state a node's KV is in.

A trie node is one generated chunk. Its latent (the chunk's denoised latent, ``skeleton`` in
upstream's names, stored under ``{hex}:lat``) is cheap and kept; its *blob* (the chunk's KV for every layer, ~3.57 GiB at 480p)
is expensive and evictable (`cacheseek.kv.handles`: the handle and its publication bit).

Node lifecycle (``TrieNode.state``, a `NodeState`; every transition is a `TrieNode` method,
called under the forest lock; a store call never runs under it)::

    EMPTY --ingest--> WRITING --store's completion--> READY          (a hit)
                      WRITING --write failed-------> FAILED         (never a hit; re-ingestable)
    READY | FAILED | EMPTY --detach--> FREEING --settle--> EMPTY    (evicted, a latent freed)
                                       FREEING --settle(kept)--> READY | FAILED  (free failed)
    READY (read by a restore) --invalidate--> INVALID --detach (last reader)--> FREEING

``ref_count`` counts the restores reading a node (a restore holds its whole path); a read node
is never detached. Eviction, invalidation, ingest and the snapshot read ``state`` only:
FREEING and INVALID nodes are nobody's victims and are not re-written until they settle.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from cacheseek.kv.handles import BlobHandle, BlobState, Skeleton, Tier, kv_pairs

__all__ = ["ActionKey", "Tier", "BlobState", "BlobHandle", "Skeleton", "NodeState", "TrieNode",
           "FastForwardResult", "kv_pairs", "check_action"]

ActionKey = Union[int, str, bytes]
"""One chunk's action: a discrete code (int), a name (str) or a digest (bytes, from the binding).
Actions are compared exactly; 1 and "1" and b"1" are three different actions."""


def check_action(action: Any) -> ActionKey:
    """``action`` as stored in the trie: an int (any integral type), str or bytes; TypeError naming
    the type otherwise (a bool, a float or a tuple is not an action)."""
    if isinstance(action, (str, bytes)):
        return action
    if isinstance(action, numbers.Integral) and not isinstance(action, bool):
        return int(action)  # numpy integers too
    raise TypeError(f"action must be an int, str or bytes, got {type(action).__name__} {action!r} "
                    "(fix: pass a discrete code, a name, or a digest such as action_bytes(control))")


class NodeState(str, enum.Enum):
    """Where a node's KV is in its lifecycle (see the module docstring)."""

    EMPTY = "empty"
    WRITING = "writing"
    READY = "ready"
    FAILED = "failed"
    FREEING = "freeing"
    INVALID = "invalid"

    @property
    def vacant(self) -> bool:
        """No blob worth keeping and no claim on the node: a write may start, a snapshot may
        fill it, and it holds nothing a parent's eviction must wait for."""
        return self in (NodeState.EMPTY, NodeState.FAILED)


_OF_BLOB = {BlobState.PENDING: NodeState.WRITING, BlobState.READY: NodeState.READY,
            BlobState.FAILED: NodeState.FAILED}


@dataclass(eq=False)
class TrieNode:
    """One chunk in a namespace trie. ``depth`` is the chunk index (the virtual root has -1)."""

    node_key: bytes
    action: ActionKey
    depth: int
    parent: Optional["TrieNode"]
    children: dict[ActionKey, "TrieNode"] = field(default_factory=dict)
    skeleton: Optional[Skeleton] = None
    blob: Optional[BlobHandle] = None
    ref_count: int = 0
    last_access: float = 0.0
    pinned: bool = False
    pruned: bool = False  # dropped from its parent by `NamespaceForest.prune`
    _claim: Optional[NodeState] = field(default=None, init=False, repr=False)  # FREEING or INVALID

    @property
    def state(self) -> NodeState:
        if self._claim is not None:
            return self._claim
        return NodeState.EMPTY if self.blob is None else _OF_BLOB[self.blob.state]

    @property
    def has_kv(self) -> bool:
        return self.state is NodeState.READY

    def detach(self) -> Optional[BlobHandle]:
        """--> FREEING: the blob (None when there is none) leaves the node, to be freed outside
        the forest lock by the caller, who then calls `settle`."""
        handle, self.blob, self._claim = self.blob, None, NodeState.FREEING
        return handle

    def settle(self, kept: Optional[BlobHandle] = None) -> None:
        """FREEING --> EMPTY; a free that failed hands back ``kept``, put back on the node."""
        if kept is not None and self.blob is None:
            self.blob = kept
        self._claim = None

    def invalidate(self, error: BaseException) -> None:
        """A read node whose values are gone --> INVALID: no hit from now (its handle failed with
        ``error``); its last reader's release detaches it."""
        self.blob.fail(error)
        self._claim = NodeState.INVALID

    def path(self) -> list["TrieNode"]:
        """Nodes from depth 0 to this node, the virtual root excluded."""
        out: list[TrieNode] = []
        node: Optional[TrieNode] = self
        while node is not None and node.depth >= 0:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return f"TrieNode(depth={self.depth}, key={self.node_key.hex()[:12]}, has_kv={self.has_kv})"


@dataclass(frozen=True)
class FastForwardResult:
    """What `WorldKVManager.try_fast_forward` decided: resume at ``start_chunk`` (0 = cold).
    ``node``: the deepest restored node (the parent of the next ingest); on a cold result the
    namespace's virtual root, or None on a namespace miss."""

    start_chunk: int
    node: Optional[TrieNode] = None
    namespace: Any = None
