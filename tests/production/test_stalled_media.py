"""Issue 23 item 6: every LocalDisk operation is bounded, stalled media included.

A `Stall` makes the real `DiskBackend`'s reads or writes block until released (what a hung disk or
network file system does): a session on the store must finish with the cold run's frames (a
restore that stalls is a failed restore, a write that stalls a dropped write), never hang. A
latent write counts as pending: `close` waits for it and for every stuck call before it releases
the root's lock, and a write that lands after its blob was reported failed leaves no file.
"""

from __future__ import annotations

import os

import threading

import pytest

from cacheseek.errors import ConfigError, StoreTimeoutError
from cacheseek.stores.localdisk import LocalDiskTierStore

from prodkit import FULL, acts, check_invariants, cold_hashes, new_manager, run_session

HANG_S = 60  # a session still running after this is hung (a detector, not a timing assertion)


class Stall:
    """Blocks ``store.disk``'s ``op`` (write or read) while armed; ``entered`` is set by the
    first call that blocks."""

    def __init__(self, monkeypatch, store: LocalDiskTierStore, op: str) -> None:
        self.release_event = threading.Event()
        self.entered = threading.Event()
        self.armed = True
        real = getattr(store.disk, op)

        def stalled(*args, **kw):
            if self.armed:
                self.entered.set()
                self.release_event.wait()
            return real(*args, **kw)

        monkeypatch.setattr(store.disk, op, stalled)

    def release(self) -> None:
        self.armed = False
        self.release_event.set()


def in_thread(fn):
    """Run ``fn`` on a thread; its result, or a failure when it is still running after HANG_S."""
    box = {}
    t = threading.Thread(target=lambda: box.update(out=fn()), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "the session hung on a stalled medium"
    return box["out"]


def _store(tmp_path, **kw) -> LocalDiskTierStore:
    return LocalDiskTierStore(str(tmp_path / "kv"), fsync=False, op_timeout_s=0.2, **kw)


def test_a_stalled_read_is_a_cold_run_not_a_hang(tmp_path, monkeypatch):
    store = _store(tmp_path)
    stall = None
    try:
        mgr = new_manager(store, FULL)
        run_session(mgr, FULL, acts(3))
        stall = Stall(monkeypatch, store, "read")
        b, _, hashes = in_thread(lambda: run_session(mgr, FULL, acts(3), ingest=False))
        assert stall.entered.is_set() and b.last_fast_forward == 0
        assert hashes == cold_hashes(FULL, acts(3))
        stall.release()
        b, _, hashes = run_session(mgr, FULL, acts(3), ingest=False)  # nothing was invalidated
        assert b.last_fast_forward == 3 and hashes == cold_hashes(FULL, acts(3))
    finally:
        if stall is not None:
            stall.release()
        store.close()


@pytest.mark.parametrize("write_back", [False, True], ids=["write_through", "write_back"])
def test_a_stalled_write_is_a_dropped_write_and_leaves_no_file(tmp_path, monkeypatch, write_back):
    store = _store(tmp_path, write_back=write_back)
    stall = Stall(monkeypatch, store, "write")
    try:
        mgr = new_manager(store, FULL)
        _, _, hashes = in_thread(lambda: run_session(mgr, FULL, acts(3)))
        assert stall.entered.is_set() and hashes == cold_hashes(FULL, acts(3))
        assert store.stats.failed_writes + mgr.metrics.as_dict()["dropped_writes"] > 0
        assert not any(n.has_kv for ns in mgr.forest.namespaces() for n in ns.iter_nodes())
        stall.release()  # the stuck writes land late: each is removed again
        store.calls.bounded.wait_quiet(HANG_S)
        assert set(store.keys()) == set(store.ledger.sizes)  # no file the tier does not count
        assert check_invariants(mgr.forest, store.keys()) == []
        b, _, hashes = run_session(mgr, FULL, acts(3))  # the medium is back: writes land again
        assert hashes == cold_hashes(FULL, acts(3))
        b, _, _ = run_session(mgr, FULL, acts(3), ingest=False)
        assert b.last_fast_forward == 3
    finally:
        stall.release()
        store.close()


def root_held(root) -> bool:
    """Whether an open store still holds ``root`` (its shared lock on ``.lock``): an exclusive
    lock cannot be had while any store holds it."""
    import fcntl

    fd = os.open(root / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_close_waits_for_a_latent_write_before_it_releases_the_root(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    store = LocalDiskTierStore(str(root), fsync=False, op_timeout_s=HANG_S)
    store.flush_timeout_s = 0.1
    stall = Stall(monkeypatch, store, "write")
    writer = threading.Thread(target=store.put_skeleton, args=("aa:lat", b"latent"), daemon=True)
    writer.start()
    try:
        assert stall.entered.wait(HANG_S)
        assert store.stats.pending_writes == 1  # a latent write is pending like a blob
        with pytest.raises(StoreTimeoutError, match="pending"):
            store.close()
        assert root_held(root)  # the store still holds the root under the write
    finally:
        stall.release()
        writer.join(HANG_S)
    store.close()  # the write landed: this close releases the root
    assert not root_held(root)
    reopened = LocalDiskTierStore(str(root))
    try:
        assert reopened.keys() == ["aa:lat"]
    finally:
        reopened.close()


def test_close_leaves_the_root_locked_under_a_stuck_call(tmp_path, monkeypatch):
    """A write that timed out still runs: close does not release the root under it."""
    root = tmp_path / "kv"
    store = _store(tmp_path)
    store.flush_timeout_s = 0.1
    stall = Stall(monkeypatch, store, "write")
    try:
        with pytest.raises(StoreTimeoutError):
            store.put_skeleton("aa:lat", b"latent")
        assert store.stats.pending_writes == 0
        with pytest.raises(StoreTimeoutError, match="still running"):
            store.close()
        assert root_held(root)
    finally:
        stall.release()
    store.calls.bounded.wait_quiet(HANG_S)
    store.close()
    reopened = LocalDiskTierStore(str(root))
    try:
        assert reopened.keys() == []  # the late write was removed: its caller was told it failed
    finally:
        reopened.close()
