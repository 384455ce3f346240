"""Issue 12 item 3: LocalDisk on a full disk, after a restart, and in one unit.

- ENOSPC is `StoreFullError`: the tier caps itself at the bytes it holds, the manager evicts and
  the write is retried (simulated with a byte budget, and for real on a 256 KiB tmpfs when this
  process may mount one);
- a reopened root whose files no snapshot names is reconciled: the unreachable files go, the
  named ones stay and restore;
- usage is counted in file bytes at write time and at reopen.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import uuid

import pytest

from cacheseek.errors import StoreFullError
from cacheseek.reuse.exact_prefix import NamespaceForest, load_forest_snapshot, save_forest_snapshot
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.localdisk import LocalDiskTierStore, encode_key

from prodkit import FULL, ROLLING, BudgetDisk, acts, check_invariants, cold_hashes, new_manager, run_session


def test_enospc_is_store_full_from_the_real_write_path(tmp_path, monkeypatch):
    store = LocalDiskTierStore(str(tmp_path / "kv"), fsync=False)
    try:
        real_replace = os.replace

        def replace(src, dst, **dir_fds):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "replace", replace)
        with pytest.raises(StoreFullError, match="disk full"):
            store.put_skeleton("aa:lat", b"x" * 10)
        monkeypatch.setattr(os, "replace", real_replace)
        assert store.capacity_bytes == 0  # nothing fitted: the medium holds nothing more
        assert store.keys() == [] and store.usage().used_bytes == 0
        assert store.capacity_bytes > 0  # usage() re-probed: the real disk has room (issue 33 item 12)
    finally:
        store.close()


def shared_sink(i: int) -> list:
    """Sessions of one namespace that share chunk 0 (the one pinned sink) and then branch."""
    return acts(3)[:1] + acts(3, variant=i + 1)[1:]


@pytest.mark.parametrize("mode", [FULL, ROLLING], ids=["full", "L7S3"])
def test_full_disk_evicts_and_sessions_go_on(tmp_path, mode):
    probe = LocalDiskTierStore(str(tmp_path / "probe"), fsync=False)
    run_session(new_manager(probe, mode), mode, acts(3, variant=9))
    per_session = probe.usage().used_bytes
    probe.close()
    store = LocalDiskTierStore(str(tmp_path / "kv"), fsync=False)  # unbounded by config
    try:
        store.backend = BudgetDisk(store.backend, budget=int(2.5 * per_session))
        mgr = new_manager(store, mode)
        for i in range(8):
            actions = shared_sink(i)
            b, _, hashes = run_session(mgr, mode, actions)
            assert hashes == cold_hashes(mode, actions)
            assert check_invariants(mgr.forest, store.keys()) == []
        m = mgr.metrics.as_dict()
        # the budget covers values; the chunk records beside them are counted by the tier, not the fake
        records = sum(n for k, n in store.disk.key_sizes().items() if k.endswith(":rec"))
        assert store.capacity_bytes is not None and store.capacity_bytes <= 2.5 * per_session + records
        assert m["evictions"] > 0 and m["store_full_retries"] > 0
        assert mgr.metrics.dropped_writes <= 2  # only writes that cannot fit beside a live path
        b, _, hashes = run_session(mgr, mode, shared_sink(7), ingest=False)
        assert b.last_fast_forward == 3 and hashes == cold_hashes(mode, shared_sink(7))
    finally:
        store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                          capture_output=True)
    if done.returncode != 0:
        why = "needs root" if os.geteuid() != 0 else "mount refused"
        pytest.skip(f"cannot mount a tmpfs here ({why}): {done.stderr.decode().strip()[-300:]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_real_enospc_on_a_small_tmpfs(tiny_tmpfs):
    store = LocalDiskTierStore(str(tiny_tmpfs / "kv"))
    try:
        mgr = new_manager(store, FULL)
        for i in range(16):
            actions = acts(3, variant=i)
            _, _, hashes = run_session(mgr, FULL, actions)
            assert hashes == cold_hashes(FULL, actions)
        assert check_invariants(mgr.forest, store.keys()) == []
        m = mgr.metrics.as_dict()
        assert store.stats.capacity_bytes is not None  # learned from ENOSPC
        assert m["evictions"] > 0
        # most chunks of later sessions were written: eviction made room
        assert m["dropped_writes"] + m["failed_writes"] < 16
        b, _, _ = run_session(mgr, FULL, acts(3, variant=15), ingest=False)
        assert b.last_fast_forward == 3
    finally:
        store.close()


def test_reopen_removes_the_values_of_chunks_never_committed(tmp_path):
    """Values without a record (a killed writer's half chunk) are removed at reopen once older
    than ``orphan_grace_s``; every committed chunk stays and is hit."""
    root = str(tmp_path / "kv")
    store = LocalDiskTierStore(root)
    mgr = new_manager(store, FULL)
    run_session(mgr, FULL, acts(3, variant=1))
    committed = set(store.keys())
    run_session(mgr, FULL, acts(3, variant=2))
    half = sorted(k for k in store.keys() if k.endswith(":rec") and k not in committed)
    assert len(half) == 3
    store.close()
    for key in half:  # as if the writer died before its commit points
        (tmp_path / "kv" / hashlib.sha256(key.encode()).hexdigest()[:2] / encode_key(key)).unlink()

    store = LocalDiskTierStore(root, capacity_bytes=1 << 20, orphan_grace_s=0)
    try:
        full = store.usage().used_bytes
        mgr = new_manager(store, FULL)
        done = mgr.reconcile()
        assert done["orphans_removed"] == 5 * 3 and done["invalidated"] == 0
        assert set(store.keys()) == committed and store.usage().used_bytes < full
        b, _, hashes = run_session(mgr, FULL, acts(3, variant=1), ingest=False)
        assert b.last_fast_forward == 3 and hashes == cold_hashes(FULL, acts(3, variant=1))
        b, _, _ = run_session(mgr, FULL, acts(3, variant=2), ingest=False)
        assert b.last_fast_forward == 0  # half chunks are never a hit
        assert check_invariants(mgr.forest, store.keys()) == []
    finally:
        store.close()


def test_a_young_value_without_a_record_is_another_writers_and_stays(tmp_path):
    """Another process may be writing a chunk right now: its values have no record yet. A
    reopen within ``orphan_grace_s`` removes none of them."""
    root = str(tmp_path / "kv")
    store = LocalDiskTierStore(root)
    run_session(new_manager(store, FULL), FULL, acts(2))
    records = [k for k in store.keys() if k.endswith(":rec")]
    for key in records:
        store.records.retract(bytes.fromhex(key.partition(":")[0]))
    values = set(store.keys())
    store.close()
    store = LocalDiskTierStore(root)  # the default grace: minutes
    try:
        assert new_manager(store, FULL).reconcile()["orphans_removed"] == 0
        assert set(store.keys()) == values
    finally:
        store.close()


def test_stack_over_a_reused_root_keeps_what_was_committed(compose_cfg, tmp_path):
    from cacheseek.orchestrator import build_stack

    root = str(tmp_path / "kv")
    store = LocalDiskTierStore(root)
    run_session(new_manager(store, FULL), FULL, acts(2))
    kept = set(store.keys())
    store.close()
    stack = build_stack(compose_cfg("+store=localdisk", f"store.root={root}"), run_dir=tmp_path)
    try:
        # the records name every committed chunk: nothing is removed, the usage counts it
        assert set(stack.store.keys()) == kept and stack.store.usage().used_bytes > 0
    finally:
        stack.close()


def test_capacity_comes_back_when_another_tenant_frees_the_disk(tiny_tmpfs):
    """A filler file takes most of a real tmpfs: ENOSPC caps the tier at what it holds. The filler
    goes: the next session's writes find the capacity raised again, and its chunks are stored."""
    filler = tiny_tmpfs / "other-tenant"
    filler.write_bytes(b"\0" * (200 << 10))
    store = LocalDiskTierStore(str(tiny_tmpfs / "kv"))
    try:
        # no eviction: the cap must rise because a write needs it (the manager would keep usage under it)
        mgr = new_manager(store, FULL, eviction={"enabled": False})
        for i in range(3):
            run_session(mgr, FULL, acts(3, variant=i))
        capped = store.stats.capacity_bytes
        assert capped is not None and capped < (56 << 10)  # learned from ENOSPC beside the filler
        filler.unlink()
        writes = mgr.metrics.writes
        actions = acts(3, variant=9)
        _, _, hashes = run_session(mgr, FULL, actions)
        assert hashes == cold_hashes(FULL, actions)
        assert store.stats.capacity_bytes > capped + (100 << 10)  # raised to what the disk holds now
        assert mgr.metrics.writes == writes + 3  # every chunk of the new session stored
        assert check_invariants(mgr.forest, store.keys()) == []
    finally:
        store.close()
