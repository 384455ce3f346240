"""Content-addressed keys for namespaces, trie nodes and store values.

All hashes are sha256 over length-prefixed parts with a domain tag first, so that no two
different part lists (and no two domains) can produce the same preimage:
``sha256(len(p0) | p0 | len(p1) | p1 | ...)`` with each length as 8 little-endian bytes.

    namespace root = H("root", image_fp, prompt_fp, config_blob_hash)
    config blob    = H("cfg", canonical_json(config), weights_fingerprint)
    node key       = H("node", parent_key, action_bytes)        # 32 bytes, chained from the root
    seed           = first 8 bytes of H("seed", node_key), little-endian

Store keys derive from a node key's hex: ``{hex}:kv:L{i}:k``, ``{hex}:kv:L{i}:v``, ``{hex}:lat``;
a layer that is not a ``(k, v)`` pair (any object, on a generic tier) is one value ``{hex}:kv:L{i}``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cacheseek.kv.locators import blob_keys, frames_locator, kv_locator, latent_locator, layer_keys, object_key

__all__ = ["sha256", "sha256_of_parts", "canonical_json_bytes", "config_blob_hash", "root_hash", "node_key",
           "build_action_chain", "derive_seed", "kv_locator", "frames_locator", "latent_locator", "layer_keys",
           "object_key", "blob_keys"]


def sha256(*parts: bytes) -> bytes:
    """sha256 over ``len(part).to_bytes(8, 'little') + part`` for each part."""
    return sha256_of_parts(*parts).digest()


def sha256_of_parts(*parts: bytes) -> "hashlib._Hash":
    """The running hash of `sha256` after ``parts``: a caller that streams a large last part
    writes its length (8 bytes, little-endian) and then its bytes in pieces."""
    h = hashlib.sha256()
    for part in parts:
        if not isinstance(part, (bytes, bytearray, memoryview)):
            raise TypeError(f"sha256 parts must be bytes, got {type(part).__name__}")
        view = memoryview(part).cast("B")  # no copy, even of a large value
        h.update(view.nbytes.to_bytes(8, "little"))
        h.update(view)
    return h


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite float {value!r} cannot be hashed canonically")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if hasattr(value, "value") and hasattr(value, "name") and type(value).__module__ != "builtins":
        return _jsonable(value.value)  # enums
    return value


def canonical_json_bytes(value: Any) -> bytes:
    """JSON with sorted keys, no spaces, UTF-8 (bytes values as ``{"__bytes__": hex}``)."""
    return json.dumps(
        _jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def config_blob_hash(config: Mapping[str, Any], *, weights_fingerprint: bytes) -> bytes:
    return sha256(b"cfg", canonical_json_bytes(dict(config)), weights_fingerprint)


def root_hash(*, image_fp: bytes, prompt_fp: bytes, config_blob_hash: bytes) -> bytes:
    return sha256(b"root", image_fp, prompt_fp, config_blob_hash)


def node_key(parent_key: bytes, action_bytes: bytes) -> bytes:
    return sha256(b"node", parent_key, action_bytes)


def build_action_chain(root: bytes, action_bytes_seq: Sequence[bytes]) -> list[bytes]:
    """The node key of every prefix of the action sequence, root excluded."""
    chain: list[bytes] = []
    parent = root
    for action in action_bytes_seq:
        parent = node_key(parent, action)
        chain.append(parent)
    return chain


def derive_seed(node_key: bytes) -> int:
    return int.from_bytes(sha256(b"seed", node_key)[:8], "little")
