"""Issue 23 (items 2, 5, 7): the forest snapshot is data, not authority.

Each test reproduces a finding of the review on real files (LocalDisk, the synthetic runtime):

- a blob whose recorded geometry does not fit the runtime, or a node moved to another action's
  slot, is a restore the binding refuses: frames equal a cold run's, the node is dropped and no
  later session meets it again (before: wrong frames, every session);
- crafted fields (0, true, 2.7, ``"false"``, 10**12 layers, a locator or latent of another node)
  are a `ConfigError` naming the file and the field;
- a damaged newest file (any single bit flip) is a `ConfigError` or falls back to the previous
  generation, and a reconcile after it removes no committed value (before: UnicodeDecodeError,
  JSONDecodeError, and the empty-forest wipe);
- temp files of an interrupted save are removed when the snapshot is loaded;
- a save visits each node O(1) times; nodes holding nothing and dead namespaces are pruned.
"""

from __future__ import annotations

import json
import os

import pytest

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import NamespaceForest, load_forest_snapshot, save_forest_snapshot
from cacheseek.reuse.exact_prefix import snapshot_file
from cacheseek.reuse.exact_prefix.keys import node_key, sha256
from cacheseek.reuse.exact_prefix.types import BlobHandle, Skeleton, Tier, TrieNode
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

from prodkit import MODES, ROLLING, acts, check_invariants, cold_hashes, new_manager, nodes, run_session

N = 4
P_X = acts(N)
P_Y = P_X[:3] + acts(N, variant=1)[3:]  # shares the first 3 chunks with P_X


@pytest.fixture
def disk(tmp_path):
    # one process on the root: a value no record names is nobody's write in flight
    store = LocalDiskTierStore(str(tmp_path / "kv"), orphan_grace_s=0)
    yield store
    store.close()


def _written(store, tmp_path, mode, paths=(P_X,)):
    mgr = new_manager(store, mode)
    for p in paths:
        run_session(mgr, mode, p)
    snap = tmp_path / "forest.json"
    save_forest_snapshot(mgr.forest, snap)
    return snap


def _rewrite(snap, edit):
    """A crafted file: edited, its checksum recomputed (a checksum is not a signature)."""
    data = json.loads(snap.read_bytes())
    data.pop("xxh3")
    edit(data)
    snap.write_bytes(snapshot_file.encode_file(data))


def _node(data, depth, i=0):
    return [n for n in data["namespaces"][0]["nodes"] if n["depth"] == depth][i]


# -- item 2: what the runtime cannot restore is refused, and dropped ---------------------------------


@pytest.mark.parametrize("craft", ["n_layers=1", "nbytes", "moved"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_node_the_runtime_cannot_restore_is_a_miss_and_is_dropped(disk, tmp_path, mode, craft):
    mode = MODES[mode]
    snap = _written(disk, tmp_path, mode, (P_X, P_Y))

    def edit(data):
        if craft == "n_layers=1":
            _node(data, 2)["blob"]["n_layers"] = 1
        elif craft == "nbytes":
            _node(data, 2)["blob"]["nbytes"] += 2
        else:  # the two depth-3 siblings swap their actions: each sits in the other's slot
            a, b = _node(data, 3, 0), _node(data, 3, 1)
            a["action"], b["action"] = b["action"], a["action"]

    _rewrite(snap, edit)
    mgr = new_manager(disk, mode, forest=load_forest_snapshot(snap))
    b, _, hashes = run_session(mgr, mode, P_X, ingest=False)
    assert hashes == cold_hashes(mode, P_X)
    expect = 3 if craft == "moved" else 2
    assert b.last_fast_forward == expect and mgr.metrics.invalidations == 1
    # dropped: the next session neither meets it nor fails on it again
    b, _, hashes = run_session(mgr, mode, P_X, ingest=False)
    assert hashes == cold_hashes(mode, P_X) and b.last_fast_forward == expect
    assert mgr.metrics.invalidations == 1
    mgr.reconcile()  # values the crafted record did not name (layer 1 of a 1-layer blob) go at the next one
    assert check_invariants(mgr.forest, disk.keys()) == []


# -- item 2: crafted fields are refused, naming the file and the field ------------------------------


def _small_snapshot(tmp_path):
    mgr = new_manager(InMemoryTierStore())
    ns = mgr.forest.get_or_create_namespace(sha256(b"root"), b"cfg")
    parent = ns.root
    for d in range(3):
        key = node_key(parent.node_key, bytes([d]))
        parent = mgr.ingest(ns, parent, bytes([d]), key, d, [("k", "v")] * 2, f"x0@{d}")
    snap = tmp_path / "forest.json"
    save_forest_snapshot(mgr.forest, snap)
    return snap


@pytest.mark.parametrize("field, value", [
    ("blob.n_layers", 0), ("blob.n_layers", True), ("blob.n_layers", 2.7), ("blob.n_layers", 10**12),
    ("blob.n_layers", "2"), ("blob.nbytes", -1), ("blob.nbytes", 1.0), ("blob.pairs", "false"),
    ("pinned", "false"), ("pinned", 1), ("depth", True), ("depth", 1.0), ("blob.tier", 3),
    ("blob.locator", "other"), ("skeleton", "other"), ("node_key", "ab" * 8),
])
def test_a_crafted_field_is_refused_naming_the_file_and_the_field(tmp_path, field, value):
    snap = _small_snapshot(tmp_path)

    def edit(data):
        node = _node(data, 1)
        *up, last = field.split(".")
        for part in up:
            node = node[part]
        node[last] = value

    _rewrite(snap, edit)
    forest = NamespaceForest()
    with pytest.raises(ConfigError) as err:
        load_forest_snapshot(snap, into=forest)
    assert str(snap) in err.value.field and err.value.field.endswith(field.split(".")[-1])
    assert len(forest) == 0


def test_a_locator_or_latent_of_another_node_is_refused(tmp_path):
    snap = _small_snapshot(tmp_path)
    for name in ("locator", "skeleton"):
        _rewrite(snap, lambda d: (_node(d, 1)["blob"].update(locator=_node(d, 2)["blob"]["locator"])
                                  if name == "locator" else _node(d, 1).update(skeleton=_node(d, 2)["skeleton"])))
        with pytest.raises(ConfigError, match=name):
            load_forest_snapshot(snap)
        snap = _small_snapshot(tmp_path)


# -- item 5: checksum, previous generation, no wipe, no temp files ---------------------------------


def _flips(raw):
    step = max(1, len(raw) // 50)
    return sorted(set(range(0, len(raw), step)) | set(range(max(0, len(raw) - 40), len(raw))))


def test_any_bit_flip_is_a_config_error_naming_the_file(tmp_path):
    snap = _small_snapshot(tmp_path)
    raw = snap.read_bytes()
    good = load_forest_snapshot(snap).snapshot()
    for pos in _flips(raw):
        for bit in (0x01, 0x80):
            damaged = bytearray(raw)
            damaged[pos] ^= bit
            snap.write_bytes(bytes(damaged))
            try:
                forest = load_forest_snapshot(snap)
            except ConfigError as exc:
                assert str(snap) in exc.field
                continue
            assert forest.snapshot() == good  # a flip in the checksum field's name: the body is whole


def test_a_damaged_newest_generation_falls_back_to_the_previous_one(tmp_path):
    mgr = new_manager(InMemoryTierStore())
    ns = mgr.forest.get_or_create_namespace(sha256(b"root"), b"cfg")
    snap = tmp_path / "forest.json"
    gens = []
    parent = ns.root
    for d in range(2):
        parent = mgr.ingest(ns, parent, bytes([d]), node_key(parent.node_key, bytes([d])), d, [("k", "v")], "x0")
        save_forest_snapshot(mgr.forest, snap)
        gens.append(mgr.forest.snapshot())
    assert snapshot_file.previous(snap).exists()
    raw = snap.read_bytes()
    for pos in _flips(raw):
        damaged = bytearray(raw)
        damaged[pos] ^= 0x80
        snap.write_bytes(bytes(damaged))
        forest = load_forest_snapshot(snap)
        got = forest.snapshot()
        assert got == gens[0] and forest.incomplete or got == gens[1] and not forest.incomplete


@pytest.mark.parametrize("prev", [False, True])
def test_a_reconcile_after_a_damaged_snapshot_removes_no_committed_value(disk, tmp_path, prev):
    mode = ROLLING
    mgr = new_manager(disk, mode)
    snap = tmp_path / "forest.json"
    run_session(mgr, mode, P_X)
    save_forest_snapshot(mgr.forest, snap)
    if prev:
        run_session(mgr, mode, P_Y)
        save_forest_snapshot(mgr.forest, snap)
    keys = disk.keys()
    raw = bytearray(snap.read_bytes())
    raw[len(raw) // 2] ^= 0x80  # not UTF-8 any more
    snap.write_bytes(bytes(raw))
    forest = NamespaceForest()
    if prev:
        load_forest_snapshot(snap, into=forest)  # the previous generation: P_X only
    else:
        with pytest.raises(ConfigError, match="forest.json"):
            load_forest_snapshot(snap, into=forest)
    assert forest.incomplete
    done = new_manager(disk, mode, forest=forest).reconcile()
    assert done["orphans_removed"] == 0 and disk.keys() == keys


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temp_files_of_an_interrupted_save_are_removed_at_load(tmp_path):
    """Only this module's marked temp files whose writer is gone (issue 33 items 6 and 8): a live
    writer's save in flight and a user's ``.forest.json.bak``-like files stay."""
    snap = _small_snapshot(tmp_path)
    left = tmp_path / f".forest.json.cstmp-w{_dead_pid()}x0123456789ab"
    left.write_bytes(b'{"version": 1, "namesp')  # a kill mid-write
    prev_left = tmp_path / f".forest.json.prev.cstmp-w{_dead_pid()}x0123456789ab"
    prev_left.write_bytes(b"{")
    live = tmp_path / f".forest.json.cstmp-w{os.getppid()}x0123456789ab"  # a live writer's save in flight
    live.write_bytes(b"{")
    folder = tmp_path / f".forest.json.cstmp-w{_dead_pid()}x0123456789ac"  # a folder: never removed
    folder.mkdir()
    users = [tmp_path / n for n in (".forest.json.bak", ".forest.json.orig", ".forest.json.prev.keep",
                                    ".forest.json.x1y2z3", ".other.json.abc")]
    for u in users:
        u.write_bytes(b"mine")
    assert len(load_forest_snapshot(snap)) == 1
    assert not left.exists() and not prev_left.exists()
    assert live.exists() and folder.is_dir() and all(u.read_bytes() == b"mine" for u in users)


# -- item 7: O(n) and pruned -----------------------------------------------------------------------


def test_a_chain_of_nodes_without_kv_saves_in_linear_time(tmp_path, monkeypatch):
    """2,000 nodes without KV above one ready leaf: the save reads each node's state O(1) times
    (before: once per ancestor, 2 million reads)."""
    n = 2000
    forest = NamespaceForest()
    ns = forest.get_or_create_namespace(sha256(b"root"), b"cfg")
    parent = ns.root
    for d in range(n):
        parent = forest.commit(ns, parent, bytes([d % 256, d // 256]), sha256(b"k", d.to_bytes(4, "little")), d)
        parent.skeleton = Skeleton(f"{parent.node_key.hex()}:lat")
    parent.blob = BlobHandle(Tier.CPU, f"{parent.node_key.hex()}:kv", 0, 1, ready=True)
    reads = [0]
    real = TrieNode.has_kv

    def counted(node):
        reads[0] += 1
        return real.fget(node)

    monkeypatch.setattr(TrieNode, "has_kv", property(counted))
    save_forest_snapshot(forest, tmp_path / "forest.json")
    assert reads[0] <= 2 * n
    monkeypatch.undo()
    assert len(load_forest_snapshot(tmp_path / "forest.json").snapshot()["namespaces"][0]["nodes"]) == n


def test_one_off_sessions_leave_no_dead_namespace_or_empty_node(tmp_path):
    """30 one-off sessions (each its own namespace) on a store of 8 chunks: eviction frees their
    values and the trie keeps only nodes that hold something (before: 30 namespaces, 120 nodes)."""
    from test_live_pins import chunk_bytes, session

    store = InMemoryTierStore(capacity_bytes=8 * chunk_bytes())
    mgr = new_manager(store, ROLLING)
    for i in range(30):
        session(mgr, i)
    assert check_invariants(mgr.forest, store.keys()) == []
    held = nodes(mgr.forest)
    assert all(n.has_kv or n.skeleton is not None or n.children for n in held)
    assert len(mgr.forest) <= 8 and all(ns.root.children for ns in mgr.forest.namespaces())


def test_a_save_prunes_and_a_pruned_cursor_is_put_back(tmp_path):
    forest = NamespaceForest()
    ns = forest.get_or_create_namespace(sha256(b"root"), b"cfg")
    empty = forest.commit(ns, ns.root, b"a", node_key(ns.root.node_key, b"a"), 0)  # holds nothing
    save_forest_snapshot(forest, tmp_path / "forest.json", live_sessions=4)
    assert ns.root.children == {} and len(forest) == 1  # the namespace is live (touched now)
    forest.sessions += 10
    forest.prune(4)
    assert len(forest) == 0 and empty.pruned
    # a session still holding the pruned node as its cursor commits its next chunk: path put back
    child = forest.commit(ns, empty, b"b", node_key(empty.node_key, b"b"), 1)
    child.blob = BlobHandle(Tier.CPU, f"{child.node_key.hex()}:kv", 0, 1, ready=True)
    empty.blob = BlobHandle(Tier.CPU, f"{empty.node_key.hex()}:kv", 0, 1, ready=True)
    assert forest.lookup(ns.root_hash, [b"a", b"b"]).node is child


@pytest.mark.parametrize("raw", [b"\xff\xfe", b'{"version": 1, "namespaces": [', b"[" * 100_000, b"[]",
                                 b'{"version": 1, "namespaces": [], "n": 1' + b"0" * 5000 + b"}"])
def test_any_undecodable_file_is_a_config_error_naming_it(tmp_path, raw):
    snap = tmp_path / "forest.json"
    snap.write_bytes(raw)
    with pytest.raises(ConfigError) as err:
        load_forest_snapshot(snap)
    assert str(snap) in err.value.field
