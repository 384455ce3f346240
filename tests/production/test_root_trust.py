"""Issue 33: a root's own files and the concurrency around them, one test per item (item 13: against
the record-based LocalDisk root, which loads and saves no snapshot, and against the public
`save_forest_snapshot` / `load_forest_snapshot` that upstream users still call).

Each test reproduces the fault campaign's finding on real files: FIFOs and links in place of the
snapshot, its ``.prev`` or the lock; a stalled or failing save; the root's parent swapped for a
link after open; concurrent saves and loads; a user's files beside the snapshot; a misplaced
value file; a full disk that frees up again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest

from cacheseek.errors import ConfigError, StoreError, StoreTimeoutError
from cacheseek.reuse.exact_prefix import NamespaceForest, load_forest_snapshot, save_forest_snapshot
from cacheseek.reuse.exact_prefix import snapshot_file
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding
from cacheseek.stores.disk_names import place
from cacheseek.stores.localdisk import LocalDiskTierStore

from prodkit import FULL, BudgetDisk, acts, cold_hashes, factory, new_manager, nodes, run_session

N = 4


def _commit(root, variant: int = 0, **kw) -> set[str]:
    """A session's chunks committed on ``root``; the root's record names after it."""
    store = LocalDiskTierStore(str(root), **kw)
    try:
        run_session(new_manager(store), FULL, acts(N, variant=variant))
        return {k for k in store.keys() if k.endswith(":rec")}
    finally:
        store.close()


def _found(root, variant: int = 0) -> int:
    """How many chunks of the session a new process-like stack on ``root`` restores (frames checked)."""
    store = LocalDiskTierStore(str(root))
    try:
        b, _, hashes = run_session(new_manager(store), FULL, acts(N, variant=variant), ingest=False)
        assert hashes == cold_hashes(FULL, acts(N, variant=variant))
        return b.last_fast_forward
    finally:
        store.close()


def _ends(fn, timeout_s: float = 20.0):
    """``fn()``'s outcome on a thread; fails when it does not return within ``timeout_s`` (a hang)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s (hung)"
    return box


def _forest_with_chunks(tmp_path, n: int = N) -> NamespaceForest:
    store = LocalDiskTierStore(str(tmp_path / "src-kv"))
    mgr = new_manager(store)
    run_session(mgr, FULL, acts(n))
    store.close()
    return mgr.forest


def _victim(tmp_path):
    v = tmp_path / "outside" / "victim"
    v.parent.mkdir(exist_ok=True)
    v.write_bytes(b"precious")
    return v


# -- item 1: FIFOs in place of the root's files never block ----------------------------------------------


@pytest.mark.parametrize("name", ["forest.json", "forest.json.prev"])
def test_a_fifo_in_place_of_the_snapshot_never_blocks(tmp_path, name):
    root = tmp_path / "kv"
    _commit(root)
    os.mkfifo(root / name)
    assert "value" in _ends(lambda: _found(root)) and _found(root) == N  # the stack never opens it
    snap = tmp_path / "snap" / "forest.json"
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    (snap.parent / name).unlink()
    os.mkfifo(snap.parent / name)
    forest = _ends(lambda: load_forest_snapshot(snap))["value"]
    assert len(forest) == 1 and bool(forest.incomplete) == (name == "forest.json")  # the other generation
    assert "error" not in _ends(lambda: save_forest_snapshot(NamespaceForest(), snap))
    assert snap.is_file() and not snap.is_symlink()


# -- item 2: a save is bounded ---------------------------------------------------------------------------


def test_a_stalled_snapshot_save_fails_within_its_bound(tmp_path, monkeypatch):
    forest = _forest_with_chunks(tmp_path)
    snap = tmp_path / "forest.json"
    release = threading.Event()
    real = os.fsync

    def stalled(fd):
        release.wait(60)
        return real(fd)

    monkeypatch.setattr(os, "fsync", stalled)
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreTimeoutError) as err:
            save_forest_snapshot(forest, snap, timeout_s=0.5)
        assert time.monotonic() - t0 < 10
        assert str(snap) in str(err.value) and "store.op_timeout_s" in str(err.value)
        assert "\n" not in str(err.value)
    finally:
        release.set()


# -- item 3: links in place of the lock, the probe and .prev are never written through -------------------


def test_hard_links_in_the_root_never_write_outside_it(tmp_path):
    victim = _victim(tmp_path)
    root = tmp_path / "kv"
    _commit(root)
    os.link(victim, root / f".probe-{os.getpid()}-{threading.get_ident()}")
    (root / ".lock").unlink()
    os.link(victim, root / ".lock")
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(root))
    assert err.value.field == "store.root" and "lock" in str(err.value) and "rm " in err.value.fix
    assert victim.read_bytes() == b"precious"
    (root / ".lock").unlink()  # the fix the error names
    assert _found(root) == N and victim.read_bytes() == b"precious"

    snap = tmp_path / "snap" / "forest.json"
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    os.link(victim, snapshot_file.previous(snap))
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    assert victim.read_bytes() == b"precious" and os.stat(snapshot_file.previous(snap)).st_nlink == 1


# -- item 4: the root's parent swapped for a link after open ----------------------------------------------


def test_a_parent_swapped_for_a_link_after_open_changes_nothing_outside(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    root = home / "kv"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "kv").mkdir(parents=True, mode=0o700)
    decoy = elsewhere / "kv" / "decoy"
    decoy.write_bytes(b"untouched")
    store = LocalDiskTierStore(str(root))
    try:
        mgr = new_manager(store)
        run_session(mgr, FULL, acts(N))
        moved = tmp_path / "home-moved"
        home.rename(moved)
        home.symlink_to(elsewhere)  # the path now names another folder
        run_session(mgr, FULL, acts(N, variant=1))  # every write through the root opened
        assert store.usage().used_bytes > 0 and store.describe()["disk_usage_bytes"] > 0
    finally:
        store.close()
    assert sorted(p.name for p in (elsewhere / "kv").iterdir()) == ["decoy"] and decoy.read_bytes() == b"untouched"
    home.unlink()
    moved.rename(home)
    assert _found(root) == N and _found(root, variant=1) == N  # all 8 chunks committed where they belong


# -- items 5 and 7: concurrent saves, a failing save, a damaged snapshot --------------------------------


def test_four_bindings_saving_one_snapshot_at_once(tmp_path):
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    snap = tmp_path / "forest.json"
    mgr = new_manager(store)
    errors: list = []
    loads: list = []
    stop = threading.Event()

    def session(i: int) -> None:
        try:
            b = LingBotWorldKVBinding(mgr, mgr.forest, snapshot_path=str(snap), snapshot_on_finalize=True)
            rt = factory(FULL).make(acts(N, variant=10 + i), hooks=b)
            rt.generate()
            for _ in range(5):
                assert b.flush_snapshot()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def reader() -> None:
        while not stop.is_set():
            if snap.exists():
                loaded = snapshot_file.load(snap)
                loads.append((loaded.records is not None, loaded.problems))

    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    r.join(30)
    store.close()
    assert errors == [] and loads and all(ok and not problems for ok, problems in loads), (errors, loads[:3])
    assert len(nodes(load_forest_snapshot(snap))) == 4 * N  # the newest complete snapshot names every session
    assert not [p for p in tmp_path.iterdir() if ".cstmp-" in p.name]  # no temp file left


def test_a_failing_save_is_one_line_and_loses_nothing(tmp_path, monkeypatch, caplog):
    root = tmp_path / "kv"
    snap = tmp_path / "forest.json"
    store = LocalDiskTierStore(str(root))
    mgr = new_manager(store)
    b = LingBotWorldKVBinding(mgr, mgr.forest, snapshot_path=str(snap))
    factory(FULL).make(acts(N), hooks=b).generate()
    store.flush()
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreError) as err:
        save_forest_snapshot(mgr.forest, snap)
    assert str(snap) in str(err.value) and "No space left" in str(err.value) and "\n" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="cacheseek"):
        assert b.flush_snapshot() is False  # one warning, no traceback
    assert [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    monkeypatch.setattr(os, "fsync", real)
    snapshot_file.previous(snap).mkdir()  # .prev a folder: the newest is saved anyway
    assert b.flush_snapshot() is True and len(load_forest_snapshot(snap)) == 1
    store.close()
    assert _found(root) == N  # the chunks are found by their records whatever the snapshot did


def test_a_damaged_snapshot_never_makes_the_root_unopenable(tmp_path, caplog):
    root = tmp_path / "kv"
    _commit(root)
    snap = tmp_path / "forest.json"
    snap.write_bytes(b'{"version": 1, "namespaces": [')  # a crash mid-write of an older version
    store = LocalDiskTierStore(str(root))
    try:
        forest = NamespaceForest()
        mgr = new_manager(store, forest=forest)
        with caplog.at_level(logging.WARNING, logger="cacheseek"):
            b = LingBotWorldKVBinding(mgr, forest, snapshot_path=str(snap), ingest_enabled=False)
        assert forest.incomplete and any("not loaded" in r.getMessage() for r in caplog.records)
        rt = factory(FULL).make(acts(N), hooks=b)
        assert rt.generate() == cold_hashes(FULL, acts(N)) and b.last_fast_forward == N  # from the records
    finally:
        store.close()


# -- item 6: a sweep never removes a live writer's temp file ---------------------------------------------


def test_a_live_writers_temp_file_survives_another_open(tmp_path):
    root = tmp_path / "kv"
    _commit(root)
    shard = root / place("k")[0]
    shard.mkdir(exist_ok=True)
    live = shard / f".k.w{os.getppid()}x0123456789ab.tmp"  # the parent process: alive
    live.write_bytes(b"in flight")
    LocalDiskTierStore(str(root)).close()
    assert live.read_bytes() == b"in flight"


# -- items 8 and 9: a user's files are kept; a link in place of the snapshot is never followed ------------


def test_a_users_files_beside_the_snapshot_are_kept(tmp_path):
    root = tmp_path / "kv"
    _commit(root)
    users = [".forest.json.bak", ".forest.json.orig", ".forest.json.prev.keep"]
    for where in (root, tmp_path):
        for name in users:
            (where / name).write_bytes(b"mine")
    assert _found(root) == N
    snap = tmp_path / "forest.json"
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    load_forest_snapshot(snap)
    assert all((w / n).read_bytes() == b"mine" for w in (root, tmp_path) for n in users)


def test_a_snapshot_that_is_a_link_is_never_followed_and_no_link_is_made(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    save_forest_snapshot(_forest_with_chunks(tmp_path), elsewhere)
    before = elsewhere.read_bytes()
    root = tmp_path / "kv"
    _commit(root)
    (root / "forest.json").symlink_to(elsewhere)
    assert _found(root) == N
    assert not os.path.lexists(root / "forest.json.prev")
    snap = tmp_path / "snap" / "forest.json"
    snap.parent.mkdir()
    snap.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="link"):
        load_forest_snapshot(snap)
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    assert not snap.is_symlink() and snap.is_file() and elsewhere.read_bytes() == before
    prev = snapshot_file.previous(snap)
    assert not os.path.lexists(prev) or (not prev.is_symlink() and os.stat(prev).st_nlink == 1)
    save_forest_snapshot(_forest_with_chunks(tmp_path), snap)
    assert not prev.is_symlink() and os.stat(prev).st_nlink == 1 and os.stat(snap).st_nlink == 1


# -- item 12: a misplaced value file, a FIFO lock, a full disk that frees up ------------------------------


def test_a_misplaced_value_file_is_not_a_value(tmp_path, caplog):
    root = tmp_path / "kv"
    _commit(root)
    store = LocalDiskTierStore(str(root), orphan_grace_s=0)
    key = next(k for k in store.keys() if k.endswith(":rec"))
    shard, name = place(key)
    wrong = next(s for s in ("00", "01") if s != shard)
    (root / wrong).mkdir(exist_ok=True)
    stray = root / wrong / name
    stray.write_bytes(b"a value's name in another key's folder")
    (root / wrong / "%ZZ").write_bytes(b"not an escape encode_key writes")
    try:
        keys = store.keys()
        assert keys.count(key) == 1 and len(keys) == len(set(keys))
        mgr = new_manager(store)
        for _ in range(2):
            assert mgr.reconcile()["orphans_removed"] == 0  # nothing claimed removed that stays
        assert stray.exists()
    finally:
        store.close()
    assert _found(root) == N


def test_a_fifo_lock_is_one_config_error(tmp_path):
    root = tmp_path / "kv"
    _commit(root)
    (root / ".lock").unlink()
    os.mkfifo(root / ".lock")
    box = _ends(lambda: LocalDiskTierStore(str(root)))
    err = box["error"]
    assert isinstance(err, ConfigError) and err.field == "store.root"
    assert "FIFO" in str(err) and "Invalid argument" not in str(err) and "rm " in err.fix


def test_the_capacity_rises_again_after_a_transient_full_disk(tmp_path, monkeypatch):
    """With eviction on (the manager keeps its writes under the lowered cap, so no write asks):
    once the disk has room again, the capacity rises back and sessions store every chunk."""
    from cacheseek.stores import value_ledger

    monkeypatch.setattr(value_ledger, "REPROBE_S", 0.0)
    probe_root = tmp_path / "probe"
    _commit(probe_root, fsync=False)
    per_session = LocalDiskTierStore(str(probe_root)).usage().used_bytes
    store = LocalDiskTierStore(str(tmp_path / "kv"), fsync=False)
    try:
        budget = BudgetDisk(store.backend, int(1.5 * per_session))
        store.backend = budget
        mgr = new_manager(store)
        for i in range(3):
            run_session(mgr, FULL, acts(N, variant=i))
        capped = store.capacity_bytes
        assert capped is not None and capped <= 1.5 * per_session
        budget.budget = 100 * per_session  # another tenant freed the disk
        writes = mgr.metrics.writes
        for i in range(3, 6):
            _, _, hashes = run_session(mgr, FULL, acts(N, variant=i))
            assert hashes == cold_hashes(FULL, acts(N, variant=i))
        assert store.capacity_bytes is None or store.capacity_bytes > 3 * per_session
        assert mgr.metrics.writes == writes + 3 * N
        assert store.usage().used_bytes > 2 * per_session  # more than the full disk held
    finally:
        store.close()
