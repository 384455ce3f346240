"""forest.json: actions of every kind round-trip; upstream CacheSeek's layout loads (this
project's earlier one is refused, naming the field); what is written carries the fields upstream's loader reads; a bad file
changes nothing. Torch-free."""

import json

import pytest

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import (
    InMemoryTierStore,
    NamespaceForest,
    WorldKVConfig,
    WorldKVManager,
    load_forest_snapshot,
    save_forest_snapshot,
)
from cacheseek.reuse.exact_prefix.keys import canonical_json_bytes, node_key, root_hash, sha256
from cacheseek.reuse.exact_prefix.types import Tier

ROOT = root_hash(image_fp=sha256(b"img", b"A"), prompt_fp=sha256(b"p", b"A"), config_blob_hash=sha256(b"cfg"))
CFG = b"C" * 8
MIXED = [7, "left", b"\x00\xffdigest"]  # one action of each kind along one path


class Window:
    def __init__(self):
        self.blobs, self.depth = {}, None

    def seed_layer(self, layer, blobs, depth):
        self.blobs[layer] = blobs

    def set_resume_depth(self, depth):
        self.depth = depth


def ingest(mgr, actions, *, root=ROOT, key_of=canonical_json_bytes):
    """Ingest one chain; layer payloads are strings, as upstream's tests store them."""
    ns = mgr.forest.get_or_create_namespace(root, CFG)
    parent = ns.root
    for d, a in enumerate(actions):
        key = node_key(parent.node_key, key_of(a))
        parent = mgr.ingest(ns, parent, a, key, d, [f"{key.hex()[:8]}:L{i}" for i in range(2)], f"x0@{d}")
    return ns


def manager(forest=None, store=None):
    cfg = WorldKVConfig(window_chunks=2, sink_chunks=1, break_even_k=1)
    return WorldKVManager(forest if forest is not None else NamespaceForest(),
                          store if store is not None else InMemoryTierStore(), cfg)


# -- actions: int, str and bytes ------------------------------------------------------------------


def test_int_str_and_bytes_actions_round_trip_through_a_snapshot_file(tmp_path):
    mgr = manager()
    ns = ingest(mgr, MIXED)
    # 1, "1" and b"1" are three different actions: three siblings.
    for a in (1, "1", b"1"):
        mgr.ingest(ns, ns.root, a, node_key(ns.root.node_key, canonical_json_bytes(a)), 0, ["kv"], "lat")
    path = tmp_path / "forest.json"
    save_forest_snapshot(mgr.forest, path)

    loaded = load_forest_snapshot(path)
    m = loaded.lookup(ROOT, MIXED)
    assert m.matched_len == 3
    actions = [n.action for n in m.node.path()]
    assert actions == MIXED and [type(a) for a in actions] == [int, str, bytes]
    (lns,) = loaded.namespaces()
    assert {(type(a), a) for a in lns.root.children} == {(int, 7), (int, 1), (str, "1"), (bytes, b"1")}
    assert loaded.lookup(ROOT, ["7"]).matched_len == 0  # "7" is not 7
    assert loaded.lookup(ROOT, [b"1"]).node.action == b"1"


@pytest.mark.parametrize("bad", [True, 1.5, ("a",), None])
def test_an_action_of_another_kind_is_refused_naming_its_type(bad):
    forest = NamespaceForest()
    ns = forest.get_or_create_namespace(ROOT, CFG)
    with pytest.raises(TypeError, match=type(bad).__name__):
        forest.commit(ns, ns.root, bad, b"k" * 32, 0)
    assert ns.root.children == {}


# -- reading upstream CacheSeek's layout ----------------------------------------------------------


@pytest.fixture
def upstream_file(tmp_path):
    """A forest.json in upstream CacheSeek's layout (its field names; every node written, a
    skeleton-only leaf included; no ``nbytes`` on one blob), for the chain u, 3, r."""
    k0 = node_key(ROOT, canonical_json_bytes("u"))
    k1 = node_key(k0, canonical_json_bytes(3))
    k2 = node_key(k1, canonical_json_bytes("r"))

    def blob(k, **extra):
        return {"tier": "fluxon_dram", "locator": f"{k.hex()}:kv", "n_layers": 2, **extra}

    data = {"version": 1, "namespaces": [{
        "root_hash": ROOT.hex(), "config_blob_hash": CFG.hex(), "pinned": False,
        "nodes": [  # not depth-sorted: the loader orders them
            {"node_key": k2.hex(), "action": "r", "depth": 2, "parent": k1.hex(), "pinned": False,
             "skeleton": f"{k2.hex()}:lat", "blob": None},
            {"node_key": k0.hex(), "action": "u", "depth": 0, "parent": ROOT.hex(), "pinned": True,
             "skeleton": f"{k0.hex()}:lat", "blob": blob(k0, nbytes=64)},
            {"node_key": k1.hex(), "action": 3, "depth": 1, "parent": k0.hex(), "pinned": False,
             "skeleton": f"{k1.hex()}:lat", "blob": blob(k1)},
        ]}]}
    path = tmp_path / "upstream_forest.json"
    path.write_text(json.dumps(data))
    return path, (k0, k1, k2)


def test_an_upstream_snapshot_loads(upstream_file):
    path, (k0, k1, k2) = upstream_file
    forest = NamespaceForest()
    assert forest.load_snapshot(json.loads(path.read_text())) == 2  # ready blobs
    m = forest.lookup(ROOT, ["u", 3, "r"])
    assert m.matched_len == 2 and m.node.node_key == k1  # the skeleton-only leaf is not a hit
    d0 = m.node.parent
    assert d0.pinned and d0.blob.tier is Tier.FLUXON_DRAM and d0.blob.nbytes == 64 and d0.blob.ready
    assert m.node.blob.nbytes == 0 and m.node.blob.n_layers == 2 and m.node.blob.pairs
    leaf = m.node.children["r"]
    assert leaf.node_key == k2 and leaf.blob is None and leaf.skeleton.latent_locator == f"{k2.hex()}:lat"


def test_an_upstream_snapshot_restores_from_this_projects_store(upstream_file):
    """The index written by upstream over values this project's tier holds: a hit, and the
    window is told the deepest node's depth."""
    path, _ = upstream_file
    store = InMemoryTierStore()
    writer = manager(store=store)
    ns = writer.forest.get_or_create_namespace(ROOT, CFG)
    parent = ns.root
    for d, a in enumerate(["u", 3]):  # (k, v) pairs: what upstream's file (no "pairs") implies
        key = node_key(parent.node_key, canonical_json_bytes(a))
        parent = writer.ingest(ns, parent, a, key, d, [(f"k{d}", f"v{d}")] * 2, f"x0@{d}")
    reader = manager(forest=load_forest_snapshot(path), store=store)
    w = Window()
    res = reader.try_fast_forward(ROOT, ["u", 3, "r"], w)
    assert res.start_chunk == 2 and w.depth == 1
    assert w.blobs[0] == [(0, ("k0", "v0")), (1, ("k1", "v1"))]


# -- reading this project's earlier layout --------------------------------------------------------


def test_the_earlier_project_layout_is_refused_naming_the_field(tmp_path):
    """Version 1 as this project first wrote it (root/cfg per namespace, key per node, every
    action the hex of bytes) is no longer read: one ConfigError, nothing loaded."""
    a0, a1 = b"\x01act", b"\x02act"
    k0 = node_key(ROOT, a0)
    k1 = node_key(k0, a1)
    data = {"version": 1, "namespaces": [{"root": ROOT.hex(), "cfg": CFG.hex(), "nodes": [
        {"key": k0.hex(), "parent": ROOT.hex(), "action": a0.hex(), "depth": 0,
         "skeleton": f"{k0.hex()}:lat", "pinned": True,
         "blob": {"tier": "cpu", "locator": f"{k0.hex()}:kv", "nbytes": 10, "n_layers": 2}},
        {"key": k1.hex(), "parent": k0.hex(), "action": a1.hex(), "depth": 1,
         "skeleton": f"{k1.hex()}:lat", "pinned": False,
         "blob": {"tier": "cpu", "locator": f"{k1.hex()}:kv", "nbytes": 10, "n_layers": 2}},
    ]}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data, sort_keys=True))
    forest = NamespaceForest()
    with pytest.raises(ConfigError, match="root_hash"):
        load_forest_snapshot(path, into=forest)
    assert len(forest) == 0


# -- what is written ------------------------------------------------------------------------------


def test_the_written_file_has_the_fields_upstreams_loader_reads(tmp_path):
    mgr = manager()
    ingest(mgr, MIXED)
    path = tmp_path / "forest.json"
    save_forest_snapshot(mgr.forest, path)
    data = json.loads(path.read_text())
    assert data["version"] == 1
    (nsd,) = data["namespaces"]
    assert bytes.fromhex(nsd["root_hash"]) == ROOT and bytes.fromhex(nsd["config_blob_hash"]) == CFG
    by_depth = {n["depth"]: n for n in nsd["nodes"]}
    assert [n["depth"] for n in nsd["nodes"]] == [0, 1, 2]  # parents first
    assert by_depth[0]["parent"] == ROOT.hex()
    assert [by_depth[d]["action"] for d in range(3)] == [7, "left", b"\x00\xffdigest".hex()]
    assert "action_type" not in by_depth[0] and by_depth[2]["action_type"] == "bytes"
    for d, n in by_depth.items():
        assert n["skeleton"] == f"{n['node_key']}:lat" and n["pinned"] == (d == 0)
        assert {"tier", "locator", "nbytes", "n_layers"} <= set(n["blob"])
        assert n["blob"]["pairs"] is False  # string layers


# -- a bad file changes nothing -------------------------------------------------------------------


def _snapshot_with_bad_second_namespace():
    mgr = manager()
    ingest(mgr, ["a", "b"])
    other = root_hash(image_fp=sha256(b"img", b"B"), prompt_fp=sha256(b"p"), config_blob_hash=sha256(b"cfg"))
    ingest(mgr, ["a", "b"], root=other)
    data = mgr.forest.snapshot()
    return data, [ns for ns in data["namespaces"] if ns["root_hash"] == other.hex()][0]


@pytest.mark.parametrize("damage, field", [
    (lambda ns: ns["nodes"][1].update(depth=5), "depth"),
    (lambda ns: ns["nodes"][1].update(parent="ab" * 32), "parent"),
    (lambda ns: ns["nodes"][0].update(action=[1, 2]), "action"),
    (lambda ns: ns["nodes"][0].update(action_type="float"), "action_type"),
    (lambda ns: ns["nodes"][0]["blob"].pop("locator"), "blob.locator"),
    (lambda ns: ns["nodes"][0]["blob"].update(tier="tape"), "blob"),
    (lambda ns: ns.update(root_hash="not hex"), "root_hash"),
])
def test_a_bad_snapshot_names_the_field_and_loads_nothing(damage, field):
    data, bad = _snapshot_with_bad_second_namespace()
    damage(bad)
    forest = NamespaceForest()
    with pytest.raises(ConfigError, match=field):
        forest.load_snapshot(data)
    assert len(forest) == 0  # the first, good namespace was not merged either


def test_a_snapshot_that_disagrees_with_the_forest_changes_nothing():
    mgr = manager()
    ingest(mgr, ["a", "b"])
    data = mgr.forest.snapshot()
    target = NamespaceForest()
    ingest(manager(forest=target), ["a"], key_of=lambda a: b"another derivation")
    before = {n.node_key for ns in target.namespaces() for n in ns.iter_nodes()}
    with pytest.raises(ConfigError, match="already has"):
        target.load_snapshot(data)
    assert {n.node_key for ns in target.namespaces() for n in ns.iter_nodes()} == before


def test_unsupported_version_is_refused():
    with pytest.raises(ConfigError, match="version"):
        NamespaceForest().load_snapshot({"version": 2, "namespaces": []})
