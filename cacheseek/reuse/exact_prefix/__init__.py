"""Exact-prefix KV reuse: keys, trie, manager and the in-memory tier. Torch-free at import."""

from cacheseek.reuse.exact_prefix.config import SharedIndexConfig, WorldKVConfig
from cacheseek.reuse.exact_prefix.keys import (build_action_chain, canonical_json_bytes, config_blob_hash,
                                               derive_seed, node_key, root_hash, sha256)
from cacheseek.reuse.exact_prefix.manager import WorldKVManager
from cacheseek.reuse.exact_prefix.trie import (Namespace, NamespaceForest, PrefixMatch, load_forest_snapshot,
                                               save_forest_snapshot)
from cacheseek.reuse.exact_prefix.types import ActionKey, BlobHandle, FastForwardResult, Skeleton, Tier, TrieNode
from cacheseek.stores.memory import InMemoryTierStore

__all__ = ["NamespaceForest", "Namespace", "PrefixMatch", "WorldKVManager", "WorldKVConfig", "SharedIndexConfig",
           "InMemoryTierStore", "build_action_chain", "derive_seed", "root_hash", "node_key", "config_blob_hash",
           "canonical_json_bytes", "sha256", "TrieNode", "Skeleton", "BlobHandle", "Tier", "FastForwardResult",
           "ActionKey", "save_forest_snapshot", "load_forest_snapshot"]

