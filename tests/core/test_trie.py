import json

from cacheseek.reuse.exact_prefix import (
    BlobHandle,
    NamespaceForest,
    Skeleton,
    Tier,
    load_forest_snapshot,
    save_forest_snapshot,
)
from cacheseek.reuse.exact_prefix.keys import node_key


def _grow(forest, actions, ready=True):
    ns = forest.get_or_create_namespace(b"R" * 32, b"C" * 32)
    parent = ns.root
    for d, a in enumerate(actions):
        node = forest.commit(ns, parent, a, node_key(parent.node_key, a), d)
        node.skeleton = Skeleton(f"{node.node_key.hex()}:lat")
        node.blob = BlobHandle(Tier.CPU, f"{node.node_key.hex()}:kv", 10, 2, ready=ready)
        parent = node
    return ns


def test_lookup_descends_only_ready_nodes():
    forest = NamespaceForest()
    ns = _grow(forest, [b"a", b"b", b"c"])
    assert forest.lookup(b"R" * 32, [b"a", b"b", b"c", b"d"]).matched_len == 3
    ns.root.children[b"a"].children[b"b"].blob.ready = False
    m = forest.lookup(b"R" * 32, [b"a", b"b", b"c"])
    assert m.matched_len == 1 and m.node.depth == 0
    miss = forest.lookup(b"X" * 32, [b"a"])
    assert miss.namespace is None and miss.matched_len == 0
    assert forest.lookup(b"R" * 32, [b"z"]).node is ns.root


def test_snapshot_round_trip_keeps_only_ready(tmp_path):
    forest = NamespaceForest()
    ns = _grow(forest, [b"a", b"b"])
    ns.root.children[b"a"].children[b"b"].blob.ready = False
    path = tmp_path / "forest.json"
    save_forest_snapshot(forest, path)
    assert json.loads(path.read_text())["version"] == 1
    loaded = load_forest_snapshot(path)
    assert len(loaded) == 1
    m = loaded.lookup(b"R" * 32, [b"a", b"b"])
    assert m.matched_len == 1
    assert b"b" not in m.node.children
    assert load_forest_snapshot(tmp_path / "missing.json").__len__() == 0
