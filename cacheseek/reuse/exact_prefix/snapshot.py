"""The forest snapshot format (``forest.json``): what `NamespaceForest.snapshot` writes and what
`NamespaceForest.load_snapshot` reads.

Written (version 1, the field names upstream CacheSeek writes and reads, so either can load the
other's file)::

    {"version": 1, "namespaces": [
      {"root_hash": hex, "config_blob_hash": hex, "nodes": [
        {"node_key": hex, "parent": hex (the namespace root's key at depth 0), "depth": int,
         "action": int | str | hex of bytes, "action_type": "bytes" (only for bytes actions),
         "pinned": bool, "skeleton": "{hex}:lat" | null,
         "blob": {"tier": "cpu"|..., "locator": "{hex}:kv", "nbytes": int, "n_layers": int,
                  "pairs": bool} | null}, ...]}, ...]}

Nodes are listed parents first. Only ready blobs are written, and only nodes with a ready blob at
or below them. ``action_type`` and ``pairs`` are additions that upstream's loader ignores (it then
sees a bytes action as its hex string, and never meets a bytes action of its own binding anyway).

Read: that format and upstream's (the same fields, every node, ``nbytes`` optional). A file is
decoded and checked whole before the forest changes; a bad field is a `ConfigError` naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobHandle, Tier, TrieNode, check_action

__all__ = ["SNAPSHOT_VERSION", "BlobRecord", "NodeRecord", "NamespaceRecord", "encode_namespace", "decode"]

SNAPSHOT_VERSION = 1
_FIX = "pass a file written by save_forest_snapshot (this project's or upstream CacheSeek's)"


@attrs.frozen(slots=True)
class BlobRecord:
    tier: Tier
    locator: str
    nbytes: int
    n_layers: int
    pairs: bool = True

    def handle(self) -> BlobHandle:
        """A ready handle: only ready blobs are ever written."""
        return BlobHandle(self.tier, self.locator, self.nbytes, self.n_layers, ready=True, pairs=self.pairs)


@attrs.frozen(slots=True)
class NodeRecord:
    node_key: bytes
    parent_key: bytes
    action: ActionKey
    depth: int
    pinned: bool
    skeleton: Optional[str]
    blob: Optional[BlobRecord]


@attrs.frozen(slots=True)
class NamespaceRecord:
    """One namespace of a snapshot; ``nodes`` parents first, each parent in the namespace."""

    root_hash: bytes
    config_blob_hash: bytes
    nodes: tuple[NodeRecord, ...]


# -- writing ---------------------------------------------------------------------------------


def encode_namespace(root_hash: bytes, config_blob_hash: bytes, nodes: Iterable[TrieNode]) -> dict[str, Any]:
    """One namespace entry from ``nodes`` (parents first; the caller chooses which)."""
    out = []
    for node in nodes:
        entry: dict[str, Any] = {
            "node_key": node.node_key.hex(),
            "parent": node.parent.node_key.hex() if node.parent is not None else None,
            "depth": node.depth,
            "pinned": node.pinned,
            "skeleton": node.skeleton.latent_locator if node.skeleton is not None else None,
            "blob": None,
        }
        entry.update(_encode_action(node.action))
        b = node.blob
        if b is not None and b.ready:
            entry["blob"] = {"tier": b.tier.value, "locator": b.locator, "nbytes": b.nbytes,
                             "n_layers": b.n_layers, "pairs": b.pairs}
        out.append(entry)
    return {"root_hash": root_hash.hex(), "config_blob_hash": config_blob_hash.hex(), "nodes": out}


def _encode_action(action: ActionKey) -> dict[str, Any]:
    if isinstance(action, bytes):
        return {"action": action.hex(), "action_type": "bytes"}
    return {"action": check_action(action)}


# -- reading ---------------------------------------------------------------------------------


def decode(data: Any) -> list[NamespaceRecord]:
    """Every namespace of a snapshot, checked: see the module docstring for the formats."""
    if not isinstance(data, Mapping):
        raise ConfigError("snapshot", f"must be a JSON object, got {type(data).__name__}", _FIX)
    if data.get("version") != SNAPSHOT_VERSION:
        raise ConfigError("snapshot.version", f"unsupported version {data.get('version')!r} "
                          f"(this CacheSeek reads version {SNAPSHOT_VERSION})", _FIX)
    namespaces = data.get("namespaces", [])
    if not isinstance(namespaces, list):
        raise ConfigError("snapshot.namespaces", "must be a list", _FIX)
    out = [_decode_namespace(nsd, f"snapshot.namespaces[{i}]") for i, nsd in enumerate(namespaces)]
    roots = [rec.root_hash for rec in out]
    if len(set(roots)) != len(roots):
        raise ConfigError("snapshot.namespaces", "a namespace root appears twice", _FIX)
    return out


def _decode_namespace(nsd: Any, where: str) -> NamespaceRecord:
    if not isinstance(nsd, Mapping):
        raise ConfigError(where, "must be an object", _FIX)
    root = _hex(nsd, "root_hash", where)
    cfg = _hex(nsd, "config_blob_hash", where)
    raw = nsd.get("nodes", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{where}.nodes", "must be a list", _FIX)
    nodes = [_decode_node(nd, f"{where}.nodes[{j}]", root) for j, nd in enumerate(raw)]
    nodes.sort(key=lambda n: n.depth)
    depth_of = {root: -1}
    seen: set[tuple[bytes, ActionKey]] = set()
    for n in nodes:
        field = f"{where}.nodes (node {n.node_key.hex()[:16]})"
        parent_depth = depth_of.get(n.parent_key)
        if parent_depth is None:
            raise ConfigError(field, f"its parent {n.parent_key.hex()[:16]} is not in the snapshot", _FIX)
        if n.depth != parent_depth + 1:
            raise ConfigError(field, f"depth {n.depth} is not its parent's depth {parent_depth} + 1", _FIX)
        slot = (n.parent_key, n.action)
        if slot in seen or n.node_key in depth_of:
            raise ConfigError(field, "appears twice (same parent and action, or same key)", _FIX)
        seen.add(slot)
        depth_of[n.node_key] = n.depth
    return NamespaceRecord(root, cfg, tuple(nodes))


def _decode_node(nd: Any, where: str, root: bytes) -> NodeRecord:
    if not isinstance(nd, Mapping):
        raise ConfigError(where, "must be an object", _FIX)
    key = _hex(nd, "node_key", where)
    parent = _hex(nd, "parent", where) if nd.get("parent") is not None else None  # None: the root
    depth = nd.get("depth")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"{where}.depth", f"must be an integer >= 0, got {depth!r}", _FIX)
    if parent is None and depth != 0:
        raise ConfigError(f"{where}.parent", f"missing on a node of depth {depth}", _FIX)
    skeleton = nd.get("skeleton")
    if skeleton is not None and not isinstance(skeleton, str):
        raise ConfigError(f"{where}.skeleton", f"must be a locator string or null, got {skeleton!r}", _FIX)
    return NodeRecord(
        node_key=key,
        parent_key=root if parent is None else parent,
        action=_decode_action(nd, where),
        depth=depth,
        pinned=bool(nd.get("pinned", False)),
        skeleton=skeleton or None,
        blob=_decode_blob(nd.get("blob"), f"{where}.blob"),
    )


def _decode_action(nd: Mapping[str, Any], where: str) -> ActionKey:
    if "action" not in nd:
        raise ConfigError(f"{where}.action", "missing", _FIX)
    action = nd["action"]
    kind = nd.get("action_type")
    if kind == "bytes":
        return _hex(nd, "action", where)
    if kind is not None:
        raise ConfigError(f"{where}.action_type", f"unknown action type {kind!r} (only 'bytes')", _FIX)
    try:
        return check_action(action)
    except TypeError:
        raise ConfigError(f"{where}.action", f"must be an int or a string, got {action!r}", _FIX) from None


def _decode_blob(b: Any, where: str) -> Optional[BlobRecord]:
    if b is None:
        return None
    if not isinstance(b, Mapping):
        raise ConfigError(where, f"must be an object or null, got {b!r}", _FIX)
    try:
        tier = Tier(b["tier"])
        locator = b["locator"]
        nbytes = int(b.get("nbytes", 0))
        n_layers = int(b["n_layers"])
    except KeyError as exc:
        raise ConfigError(f"{where}.{exc.args[0]}", "missing", _FIX) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(where, f"bad value: {exc}", _FIX) from None
    if not isinstance(locator, str) or not locator:
        raise ConfigError(f"{where}.locator", f"must be a non-empty string, got {locator!r}", _FIX)
    if n_layers < 0 or nbytes < 0:
        raise ConfigError(where, f"n_layers and nbytes must be >= 0, got {n_layers}, {nbytes}", _FIX)
    return BlobRecord(tier, locator, nbytes, n_layers, bool(b.get("pairs", True)))


def _hex(d: Mapping[str, Any], name: str, where: str) -> bytes:
    value = d.get(name)
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{name}", f"must be a hex string, got {value!r}", _FIX)
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"{where}.{name}", f"not hex: {value!r}", _FIX) from None
