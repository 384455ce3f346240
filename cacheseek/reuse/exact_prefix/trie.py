"""The namespace forest: one trie of chunks per namespace root, and its JSON snapshot.

A namespace is identified by its root hash (image, prompt and every config field that changes the
bits). Inside it, a node per chunk keyed by the action that produced it; ``depth`` is the chunk
index and the namespace's ``root`` is a virtual node of depth -1. `lookup` descends only through
nodes whose blob is ready, so a pending or failed write is never a hit.

Actions are ints, strings or bytes (`ActionKey`), compared exactly. The snapshot persists only
ready blobs (plus the latents on their paths), so a restarted worker finds exactly what the
store committed; its format (`cacheseek.reuse.exact_prefix.snapshot`) is the one upstream
CacheSeek reads and writes; on disk it is checksummed and keeps its previous generation
(`cacheseek.reuse.exact_prefix.snapshot_file`). A forest whose newest snapshot could not be
loaded whole says so (``incomplete``), and `WorldKVManager.reconcile` then removes no value.

Pruning (`prune`): nodes that hold no value (no blob, or a failed one, and no latent) and have no
child are dropped, and so are namespaces left without nodes that no session touched within the
last ``live_sessions``; it runs at every save and after each eviction pass. A node a session still
holds (the parent of its next chunk) may be pruned: `commit` under it puts its path back.

Liveness (what pins protect): the forest counts sessions (`begin_session`, once per lookup of a
session) and stamps a namespace with the session count whenever a session looks it up or writes
into it (``last_session``). A namespace is *live* while it was touched within the last ``n``
sessions (`is_live`); the manager's eviction honours the pins of live namespaces only, so the sink
chunks of namespaces nobody uses any more become ordinary LRU victims. The count is per process
(a loaded snapshot's namespaces start as touched at session 0).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import snapshot as snapshot_format
from cacheseek.reuse.exact_prefix import snapshot_file
from cacheseek.reuse.exact_prefix.types import ActionKey, Skeleton, TrieNode, check_action

__all__ = ["Namespace", "NamespaceForest", "PrefixMatch", "save_forest_snapshot", "load_forest_snapshot"]

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
        """Every node, each parent before its children."""
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
        self.incomplete: Optional[str] = None  # why the newest snapshot did not load whole

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
            self._namespaces.get(ns.root_hash, ns).last_session = self.sessions

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

    def commit(self, ns: Namespace, parent: TrieNode, action: ActionKey, node_key: bytes, depth: int) -> TrieNode:
        """Get or create the child of ``parent`` for ``action`` (an int, str or bytes); a pruned
        ``parent`` (or namespace) is put back first."""
        action = check_action(action)
        with self.lock:
            if parent.pruned:
                parent = self._reattach(ns, parent)
            child = parent.children.get(action)
            if child is None:
                if depth != parent.depth + 1:
                    raise ValueError(f"depth {depth} is not parent depth {parent.depth} + 1")
                child = TrieNode(node_key=node_key, action=action, depth=depth, parent=parent)
                parent.children[action] = child
            elif child.node_key != node_key:
                raise ValueError(f"node key mismatch at depth {depth}: trie has {child.node_key.hex()[:16]}, "
                                 f"caller derived {node_key.hex()[:16]}")
            return child

    def _reattach(self, ns: Namespace, node: TrieNode) -> TrieNode:
        """Under ``lock``: the node at pruned ``node``'s place, its path put back where it is gone."""
        live = self._namespaces.setdefault(ns.root_hash, ns)
        live.root.pruned = False
        here = live.root
        for n in node.path():
            child = here.children.get(n.action)
            if child is None:
                n.parent, n.pruned, child = here, False, n
                here.children[n.action] = n
            here = child
        return here

    def prune(self, live_sessions: int) -> int:
        """Drop the nodes that hold no value and have no child, then the namespaces left without
        nodes and not touched within the last ``live_sessions`` sessions (see the module
        docstring). One pass, O(nodes). Returns the number of nodes and namespaces dropped."""
        dropped = 0
        with self.lock:
            for ns in list(self._namespaces.values()):
                for node in reversed(list(ns.iter_nodes())):  # children before parents
                    if not node.children and _holds_nothing(node):
                        del node.parent.children[node.action]
                        node.pruned = True
                        dropped += 1
                if not ns.root.children and not self.is_live(ns, live_sessions):
                    del self._namespaces[ns.root_hash]
                    ns.root.pruned = True
                    dropped += 1
        return dropped

    # -- snapshot ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able dict of every namespace, with only ready blobs and their ancestors
        (format: `cacheseek.reuse.exact_prefix.snapshot`). O(nodes)."""
        with self.lock:
            out = []
            for ns in self._namespaces.values():
                order = list(ns.iter_nodes())
                ready_below: set[int] = set()
                for n in reversed(order):  # children before parents
                    if n.has_kv or any(id(c) in ready_below for c in n.children.values()):
                        ready_below.add(id(n))
                nodes = sorted((n for n in order if id(n) in ready_below), key=lambda n: n.depth)
                if nodes:
                    out.append(snapshot_format.encode_namespace(ns.root_hash, ns.config_blob_hash, nodes))
            return {"version": snapshot_format.SNAPSHOT_VERSION, "namespaces": out}

    def load_snapshot(self, data: Mapping[str, Any]) -> int:
        """Merge a snapshot (this project's or upstream CacheSeek's) into this forest; returns the
        number of ready blobs loaded. The whole snapshot is checked, against itself and against
        the nodes already here, before anything changes (`ConfigError` naming the field)."""
        return self.load_records(snapshot_format.decode(data))

    def load_records(self, records: Sequence["snapshot_format.NamespaceRecord"]) -> int:
        """`load_snapshot` of decoded records."""
        with self.lock:
            for rec in records:
                self._check_merge(rec)
            return sum(self._merge(rec) for rec in records)

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
                    "load it into an empty forest (keys are derived differently)")
            here[n.node_key] = child

    def _merge(self, rec: "snapshot_format.NamespaceRecord") -> int:
        ns = self.get_or_create_namespace(rec.root_hash, rec.config_blob_hash)
        by_key = {ns.root.node_key: ns.root}
        loaded = 0
        for n in rec.nodes:
            node = self.commit(ns, by_key[n.parent_key], n.action, n.node_key, n.depth)
            if n.latent and node.skeleton is None:
                node.skeleton = Skeleton(n.latent)
            node.pinned = node.pinned or n.pinned
            if n.blob is not None and node.state.vacant:
                node.blob = n.blob.handle()
                loaded += 1
            by_key[node.node_key] = node
        return loaded


def _holds_nothing(node: TrieNode) -> bool:
    """No value in the store (no latent; no blob, or a failed one) and nobody holding it."""
    return node.skeleton is None and node.state.vacant and node.ref_count == 0


def save_forest_snapshot(forest: NamespaceForest, path: str | os.PathLike[str], *,
                         live_sessions: Optional[int] = None,
                         timeout_s: float = snapshot_file.SAVE_TIMEOUT_S) -> None:
    """Write the snapshot, checksummed, keeping the previous generation (`snapshot_file.save`:
    safe against concurrent saves, never through a link); ``live_sessions``: prune the forest
    first (`NamespaceForest.prune`). Bounded by ``timeout_s``; any failure is one `StoreError`
    naming the file (the forest is unchanged)."""
    if live_sessions is not None:
        forest.prune(live_sessions)
    snapshot_file.save(forest.snapshot(), Path(path), timeout_s=timeout_s)


def load_forest_snapshot(path: str | os.PathLike[str], *, into: Optional[NamespaceForest] = None,
                         timeout_s: float = snapshot_file.SAVE_TIMEOUT_S) -> NamespaceForest:
    """Load a snapshot file into ``into`` (or a new forest); a missing file gives an empty forest.
    Temp files of interrupted saves whose writer is gone are removed first; a damaged newest
    generation (or one that is a link or a FIFO: never followed or waited on) falls back to the
    previous one and marks the forest ``incomplete``; with neither usable, the forest is marked
    and the newest's `ConfigError` (naming the file and the field) raised. Bounded by ``timeout_s``."""
    forest = into if into is not None else NamespaceForest()
    p = Path(path)
    loaded = snapshot_file.load(p, timeout_s=timeout_s, sweep=True)
    if loaded.problems:
        forest.incomplete = f"{p} did not load: {loaded.problems[0]}"
    if loaded.records is None:
        if loaded.problems:
            raise loaded.problems[0]
        return forest
    forest.load_records(loaded.records)
    return forest
