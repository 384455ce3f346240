"""The namespace forest: one trie of chunks per namespace root, and its JSON snapshot.

A namespace is identified by its root hash (image, prompt and every config field that changes the
bits). Inside it, a node per chunk keyed by the action that produced it; ``depth`` is the chunk
index and the namespace's ``root`` is a virtual node of depth -1. `lookup` descends only through
nodes whose blob is ready, so a pending or failed write is never a hit.

Actions are ints, strings or bytes (`ActionKey`), compared exactly. The snapshot persists only
ready blobs (plus the skeletons on their paths), so a restarted worker finds exactly what the
store committed; its format (`cacheseek.reuse.exact_prefix.snapshot`) is the one upstream
CacheSeek reads and writes. Saving is an atomic replace.

Liveness (what pins protect): the forest counts sessions (`begin_session`, once per lookup of a
session) and stamps a namespace with the session count whenever a session looks it up or writes
into it (``last_session``). A namespace is *live* while it was touched within the last ``n``
sessions (`is_live`); the manager's eviction honours the pins of live namespaces only, so the sink
chunks of namespaces nobody uses any more become ordinary LRU victims. The count is per process
(a loaded snapshot's namespaces start as touched at session 0).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import snapshot as snapshot_format
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobState, Skeleton, TrieNode, check_action

__all__ = [
    "Namespace",
    "NamespaceForest",
    "PrefixMatch",
    "save_forest_snapshot",
    "load_forest_snapshot",
]

SNAPSHOT_VERSION = snapshot_format.SNAPSHOT_VERSION
_END = object()  # the end of a lookup's actions


@dataclass(eq=False)
class Namespace:
    root_hash: bytes
    config_blob_hash: bytes
    root: TrieNode = field(init=False)
    last_session: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.root = TrieNode(node_key=self.root_hash, action=b"", depth=-1, parent=None)

    def iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


@dataclass(frozen=True)
class PrefixMatch:
    namespace: Optional[Namespace]
    node: Optional[TrieNode]
    matched_len: int


class NamespaceForest:
    """Thread-safe forest of namespace tries. All structural changes hold ``self.lock``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._namespaces: dict[bytes, Namespace] = {}
        self.sessions = 0

    def begin_session(self, root_hash: bytes) -> int:
        """Count one session (a lookup) and touch its namespace if it exists; the new count."""
        with self.lock:
            self.sessions += 1
            ns = self._namespaces.get(root_hash)
            if ns is not None:
                ns.last_session = self.sessions
            return self.sessions

    def touch(self, ns: Namespace) -> None:
        """A session wrote into ``ns``: it is live from now for the next sessions."""
        with self.lock:
            ns.last_session = self.sessions

    def is_live(self, ns: Namespace, n: int) -> bool:
        """Touched within the last ``n`` sessions (the current one included)."""
        with self.lock:
            return self.sessions - ns.last_session < n

    def __len__(self) -> int:
        return len(self._namespaces)

    def namespaces(self) -> list[Namespace]:
        with self.lock:
            return list(self._namespaces.values())

    def get_or_create_namespace(self, root_hash: bytes, config_blob_hash: bytes) -> Namespace:
        with self.lock:
            ns = self._namespaces.get(root_hash)
            if ns is None:
                ns = Namespace(root_hash, config_blob_hash)
                self._namespaces[root_hash] = ns
            return ns

    def resolve(self, root_hash: bytes) -> Optional[Namespace]:
        with self.lock:
            return self._namespaces.get(root_hash)

    def lookup(self, root_hash: bytes, actions: Sequence[ActionKey]) -> PrefixMatch:
        """The longest prefix of ``actions`` whose nodes hold ready KV. The next action is read
        only while the node reached has children, and outside the lock: ``actions`` may compute
        each key when read (`LazyActionKeys`), so a fresh namespace reads none."""
        with self.lock:
            ns = self._namespaces.get(root_hash)
            if ns is None:
                return PrefixMatch(None, None, 0)
            node = ns.root
            more = bool(node.children)
        matched = 0
        remaining = iter(actions)
        while more:
            action = next(remaining, _END)
            if action is _END:
                break
            with self.lock:
                child = node.children.get(action)
                if child is None or not child.has_kv:
                    break
                node = child
                matched += 1
                more = bool(node.children)
        return PrefixMatch(ns, node, matched)

    def commit(
        self, ns: Namespace, parent: TrieNode, action: ActionKey, node_key: bytes, depth: int
    ) -> TrieNode:
        """Get or create the child of ``parent`` for ``action`` (an int, str or bytes)."""
        action = check_action(action)
        with self.lock:
            child = parent.children.get(action)
            if child is None:
                if depth != parent.depth + 1:
                    raise ValueError(f"depth {depth} is not parent depth {parent.depth} + 1")
                child = TrieNode(node_key=node_key, action=action, depth=depth, parent=parent)
                parent.children[action] = child
            elif child.node_key != node_key:
                raise ValueError(
                    f"node key mismatch at depth {depth}: trie has {child.node_key.hex()[:16]}, "
                    f"caller derived {node_key.hex()[:16]}"
                )
            return child

    # -- snapshot ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able dict of every namespace, with only ready blobs and their ancestors
        (format: `cacheseek.reuse.exact_prefix.snapshot`)."""
        with self.lock:
            out = []
            for ns in self._namespaces.values():
                nodes = [n for n in sorted(ns.iter_nodes(), key=lambda n: n.depth) if _subtree_has_ready(n)]
                if nodes:
                    out.append(snapshot_format.encode_namespace(ns.root_hash, ns.config_blob_hash, nodes))
            return {"version": snapshot_format.SNAPSHOT_VERSION, "namespaces": out}

    def load_snapshot(self, data: Mapping[str, Any]) -> int:
        """Merge a snapshot (this project's or upstream CacheSeek's) into this forest; returns the
        number of ready blobs loaded. The whole snapshot is checked, against itself and against
        the nodes already here, before anything changes (`ConfigError` naming the field)."""
        records = snapshot_format.decode(data)
        with self.lock:
            for rec in records:
                self._check_merge(rec)
            loaded = 0
            for rec in records:
                loaded += self._merge(rec)
        return loaded

    def _check_merge(self, rec: "snapshot_format.NamespaceRecord") -> None:
        """Under ``lock``: a node of ``rec`` whose (parent, action) slot here holds another key."""
        ns = self._namespaces.get(rec.root_hash)
        if ns is None:
            return
        here: dict[bytes, Optional[TrieNode]] = {ns.root.node_key: ns.root}
        for n in rec.nodes:
            parent = here[n.parent_key]
            child = parent.children.get(n.action) if parent is not None else None
            if child is not None and child.node_key != n.node_key:
                raise ConfigError(
                    f"snapshot node {n.node_key.hex()[:16]}",
                    f"at depth {n.depth} this forest already has {child.node_key.hex()[:16]} for that action",
                    "load it into an empty forest (keys are derived differently)",
                )
            here[n.node_key] = child

    def _merge(self, rec: "snapshot_format.NamespaceRecord") -> int:
        ns = self.get_or_create_namespace(rec.root_hash, rec.config_blob_hash)
        by_key = {ns.root.node_key: ns.root}
        loaded = 0
        for n in rec.nodes:
            node = self.commit(ns, by_key[n.parent_key], n.action, n.node_key, n.depth)
            if n.skeleton and node.skeleton is None:
                node.skeleton = Skeleton(n.skeleton)
            node.pinned = node.pinned or n.pinned
            held = node.blob is not None and node.blob.state is not BlobState.FAILED
            if n.blob is not None and not held and not node.evicting:
                node.blob = n.blob.handle()
                loaded += 1
            by_key[node.node_key] = node
        return loaded


def _subtree_has_ready(node: TrieNode) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if n.has_kv:
            return True
        stack.extend(n.children.values())
    return False


def save_forest_snapshot(forest: NamespaceForest, path: str | os.PathLike[str]) -> None:
    """Write the snapshot as JSON with an atomic replace (temp file in the same folder, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(forest.snapshot(), sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_forest_snapshot(
    path: str | os.PathLike[str], *, into: Optional[NamespaceForest] = None
) -> NamespaceForest:
    """Load a snapshot file into ``into`` (or a new forest); a missing file gives an empty forest."""
    forest = into if into is not None else NamespaceForest()
    p = Path(path)
    if p.exists():
        forest.load_snapshot(json.loads(p.read_bytes()))
    return forest
