"""Trie value types: tiers, blob handles, skeletons and trie nodes.

A trie node is one generated chunk. Its *skeleton* (the chunk's denoised latent, stored under
``{hex}:lat``) is cheap and kept; its *blob* (the chunk's KV for every layer, ~3.57 GiB at 480p)
is expensive and evictable. ``BlobHandle.ready`` is the publication bit: true only once every
value of the chunk is durably committed in the store. Lookups descend only through ready nodes.

Handle lifecycle (``BlobHandle.state``)::

    PENDING --(store completion callback)--> READY --(evict/free)--> dropped from the node
    PENDING --(write failed)--> FAILED                                (droppable, never ready)

Node lifetime under eviction (`WorldKVManager`): a node is *read* while ``ref_count > 0`` (a
restore holds its whole path) and *being evicted* while ``evicting`` is set (its blob was
detached under the forest lock and its values are being freed outside it). Neither kind is an
eviction victim; a node being evicted is not re-written until the free settles. A node found
without its values while another restore reads it is *invalidated*: its blob stops being a hit at
once (failed, ``evicting`` set) and is freed by its last reader's release, never under it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from cacheseek.kv.handles import BlobHandle, BlobState, Skeleton, Tier, kv_pairs

__all__ = ["ActionKey", "Tier", "BlobState", "BlobHandle", "Skeleton", "TrieNode", "FastForwardResult",
           "kv_pairs", "check_action"]

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
    raise TypeError(
        f"action must be an int, str or bytes, got {type(action).__name__} {action!r} "
        "(fix: pass a discrete code, a name, or a digest such as action_bytes(control))"
    )


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
    evicting: bool = False
    invalidated: bool = False
    pruned: bool = False  # dropped from its parent by `NamespaceForest.prune`

    @property
    def has_kv(self) -> bool:
        return self.blob is not None and self.blob.ready

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
