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

The snapshot is data, not authority: types are strict (an int is an int, never a bool or a float;
``pinned`` and ``pairs`` are bools), keys are 32 bytes, depth, layers and sizes are bounded
(`MAX_DEPTH`, `MAX_LAYERS`, `MAX_NBYTES`, so a crafted file costs O(n) and never builds 10^12
keys), and every locator is the one derived from its node's key (a node cannot name another
node's values). Node keys are the caller's derivation, so the file cannot check them; the binding
checks its own (``node_key(parent, action)``) and whether each blob fits the runtime (layers,
bytes) when it restores a node (`Restorer`, the window's ``node_problem``), and a node that fails
is dropped, so no later session meets it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError
from cacheseek.kv.locators import kv_locator, latent_locator
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobHandle, Tier, TrieNode, check_action

__all__ = ["SNAPSHOT_VERSION", "MAX_DEPTH", "MAX_LAYERS", "MAX_NBYTES", "BlobRecord", "NodeRecord",
           "NamespaceRecord", "encode_namespace", "decode"]

SNAPSHOT_VERSION = 1
MAX_DEPTH = 1 << 16  # chunks along one path (hours of video)
MAX_LAYERS = 1 << 12  # transformer layers of one chunk's KV
MAX_NBYTES = 1 << 40  # bytes of one chunk's KV
_KEY_BYTES = 32  # sha256 node keys and namespace roots
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
    latent: Optional[str]  # the file's "skeleton": the latent's locator
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
        if node.has_kv:
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
    keys = [n.node_key for rec in out for n in rec.nodes]
    if len(set(keys)) != len(keys):  # keys chain from distinct roots: two namespaces never share one
        raise ConfigError("snapshot.namespaces", "a node key appears in two namespaces", _FIX)
    return out


def _decode_namespace(nsd: Any, where: str) -> NamespaceRecord:
    if not isinstance(nsd, Mapping):
        raise ConfigError(where, "must be an object", _FIX)
    root = _hex(nsd, "root_hash", where, _KEY_BYTES)
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
    key = _hex(nd, "node_key", where, _KEY_BYTES)
    parent = _hex(nd, "parent", where, _KEY_BYTES) if nd.get("parent") is not None else None  # None: the root
    depth = _int(nd, "depth", where, hi=MAX_DEPTH - 1)
    if parent is None and depth != 0:
        raise ConfigError(f"{where}.parent", f"missing on a node of depth {depth}", _FIX)
    parent = root if parent is None else parent
    latent = nd.get("skeleton")
    if latent is not None and latent != latent_locator(key):
        raise ConfigError(f"{where}.skeleton", f"must be null or {latent_locator(key)!r} (derived from the "
                          f"node's key), got {latent!r}", _FIX)
    action = _decode_action(nd, where)
    blob = _decode_blob(nd.get("blob"), f"{where}.blob")
    if blob is not None and blob.locator != kv_locator(key):
        raise ConfigError(f"{where}.blob.locator", f"must be {kv_locator(key)!r} (derived from the node's "
                          f"key), got {blob.locator!r}", _FIX)
    return NodeRecord(node_key=key, parent_key=parent, action=action, depth=depth,
                      pinned=_bool(nd, "pinned", where, False), latent=latent, blob=blob)


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
    tier = b.get("tier")
    if not isinstance(tier, str) or tier not in {t.value for t in Tier}:
        raise ConfigError(f"{where}.tier", f"must be one of {[t.value for t in Tier]}, got {tier!r}", _FIX)
    locator = b.get("locator")
    if not isinstance(locator, str) or not locator:
        raise ConfigError(f"{where}.locator", f"must be a non-empty string, got {locator!r}", _FIX)
    nbytes = _int(b, "nbytes", where, hi=MAX_NBYTES, default=0)
    n_layers = _int(b, "n_layers", where, lo=1, hi=MAX_LAYERS)
    return BlobRecord(Tier(tier), locator, nbytes, n_layers, _bool(b, "pairs", where, True))


_MISSING = object()


def _int(d: Mapping[str, Any], name: str, where: str, *, lo: int = 0, hi: int, default: Any = _MISSING) -> int:
    """A JSON integer in ``[lo, hi]`` (a bool, a float or a string is refused)."""
    value = d.get(name, default)
    if value is _MISSING:
        raise ConfigError(f"{where}.{name}", "missing", _FIX)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{where}.{name}", f"must be an integer in [{lo}, {hi}], got {value!r}", _FIX)
    return value


def _bool(d: Mapping[str, Any], name: str, where: str, default: bool) -> bool:
    value = d.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name}", f"must be true or false, got {value!r}", _FIX)
    return value


def _hex(d: Mapping[str, Any], name: str, where: str, length: Optional[int] = None) -> bytes:
    """Hex of bytes (of exactly ``length`` bytes when given; at most 256 bytes otherwise)."""
    value = d.get(name)
    if not isinstance(value, str) or len(value) > 2 * (length or 256):
        raise ConfigError(f"{where}.{name}", f"must be a hex string, got {value!r:.80}", _FIX)
    try:
        out = bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"{where}.{name}", f"not hex: {value!r}", _FIX) from None
    if length is not None and len(out) != length:
        raise ConfigError(f"{where}.{name}", f"must be {length} bytes, got {len(out)}", _FIX)
    return out
