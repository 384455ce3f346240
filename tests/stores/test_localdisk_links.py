"""Issue 23, item 3: LocalDisk refuses links and files it did not write (real files, real links).

The review planted a shard folder linked to a victim folder (``passwd``, ``notes``, ``id_rsa``, an
editor's temp file, a sub-folder): opening the store and reconciling deleted the victim's files,
later writes landed there, and ``build_stack`` failed holding the root's lock. A value file linked
to another file was counted in usage; a FIFO in its place blocked a read for ever.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest

from cacheseek.errors import ConfigError, StoreError
from cacheseek.kv.handles import Tier
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.stores.localdisk import LocalDiskTierStore

LOC = "ab" * 32 + ":kv"
KEY = layer_keys(LOC, 0)[0]


@pytest.fixture
def victim(tmp_path):
    """A folder outside the root with files whose names a store could take for its own."""
    v = tmp_path / "victim"
    v.mkdir()
    for name in ("passwd", "notes", "id_rsa", ".id_rsa.abc123.tmp"):
        (v / name).write_text(f"the victim's {name}")
    (v / "sub").mkdir()
    (v / "sub" / "keep").write_text("x")
    return v


def _victim_intact(v):
    names = sorted(p.name for p in v.iterdir())
    return names == sorted(["passwd", "notes", "id_rsa", ".id_rsa.abc123.tmp", "sub"]) and \
        (v / "id_rsa").read_text() == "the victim's id_rsa" and (v / "sub" / "keep").exists()


def _shard_of(store, key):
    return store.disk.path_of(key).parent


def test_a_shard_linked_outside_is_one_config_error_and_touches_nothing(tmp_path, victim, compose_cfg):
    from cacheseek.orchestrator import build_stack

    root = tmp_path / "kv"
    store = LocalDiskTierStore(str(root))
    store.put_skeleton(KEY, b"value")
    shard = _shard_of(store, KEY)
    store.close()
    for p in shard.iterdir():
        p.unlink()
    shard.rmdir()
    shard.symlink_to(victim)  # planted
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(root))
    assert err.value.field == "store.root" and shard.name in str(err.value) and "remove" in err.value.fix
    with pytest.raises(ConfigError, match="store.root"):
        build_stack(compose_cfg("+store=localdisk", f"store.root={root}"), run_dir=tmp_path)
    assert _victim_intact(victim)
    shard.unlink()  # the fix: the lock was not kept by the failed opens
    LocalDiskTierStore(str(root)).close()


def test_a_link_planted_while_open_is_never_followed(tmp_path, victim):
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        shard = _shard_of(store, KEY)
        shard.symlink_to(victim)  # planted under the open store
        h = store.put_async(LOC, [(b"k", b"v")], tier=Tier.DISK)
        assert not h.ready and isinstance(h.error, StoreError) and "link" in str(h.error)
        assert store.get_skeleton(KEY) is None and store.keys() == [] and store.disk_usage_bytes() == 0
        store.delete_values(["passwd", "notes", "id_rsa", "sub"])
        assert _victim_intact(victim)
    finally:
        store.close()


def test_a_value_file_that_is_a_link_is_not_counted_or_read(tmp_path):
    outside = tmp_path / "big"
    outside.write_bytes(b"x" * 100_000)
    root = tmp_path / "kv"
    store = LocalDiskTierStore(str(root))
    store.put_skeleton(KEY, b"value")
    path = store.disk.path_of(KEY)
    store.close()
    path.unlink()
    path.symlink_to(outside)
    store = LocalDiskTierStore(str(root))
    try:
        assert store.usage().used_bytes == 0 and store.keys() == [] and store.disk_usage_bytes() == 0
        assert store.get_skeleton(KEY) is None and store.stats.corrupt_values == 1  # refused, the link removed
        assert not os.path.lexists(path) and outside.read_bytes() == b"x" * 100_000
    finally:
        store.close()


def test_a_fifo_in_place_of_a_value_never_blocks(tmp_path):
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        store.put_skeleton(KEY, b"value")
        path = store.disk.path_of(KEY)
        path.unlink()
        os.mkfifo(path)
        got = []
        reader = threading.Thread(target=lambda: got.append(store.get_skeleton(KEY)), daemon=True)
        reader.start()
        reader.join(30)  # a hang guard: the read returns at once or never
        assert not reader.is_alive() and got == [None] and store.stats.corrupt_values == 1
        assert store.keys() == [] and not os.path.lexists(path)
    finally:
        store.close()


def test_only_names_it_could_have_written_are_removed(tmp_path):
    root = tmp_path / "kv"
    store = LocalDiskTierStore(str(root))
    store.put_skeleton(KEY, b"value")
    shard = _shard_of(store, KEY)
    store.close()
    foreign = {"README": "a", ".hidden": "b", "x.y": "c", ".x.tmp": "d"}
    for name, text in foreign.items():
        (shard / name).write_text(text)
    folder = shard / "aa%3Akv"  # a value's name, but a folder
    folder.mkdir()
    (root / "notes.txt").write_text("beside the shards")
    store = LocalDiskTierStore(str(root))
    try:
        store.delete_values(store.keys() + ["aa:kv"])
        assert sorted(p.name for p in shard.iterdir()) == sorted([*foreign, folder.name])
        assert (root / "notes.txt").exists()
    finally:
        store.close()


def test_the_root_is_created_private_and_an_untrusted_one_refused(tmp_path):
    deep = tmp_path / "new" / "kv"
    with pytest.raises(ConfigError) as err:  # only the root itself is created, never its parents
        LocalDiskTierStore(str(deep))
    assert err.value.field == "store.root" and f"mkdir -p {deep.parent}" in err.value.fix
    assert not deep.parent.exists()
    root = tmp_path / "kv"
    LocalDiskTierStore(str(root)).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(shared))
    assert err.value.field == "store.root" and "chmod 700" in err.value.fix
    assert not (shared / ".lock").exists()

    link = tmp_path / "mine"
    link.symlink_to(root)  # a link this user owns to a folder of its own: followed
    LocalDiskTierStore(str(link)).close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_root_of_another_user_is_refused(tmp_path):
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 4321, 4321)
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(other))
    assert err.value.field == "store.root" and "uid 4321" in str(err.value)
    assert "chown" in err.value.fix and "chmod" not in err.value.fix  # chmod cannot make it this user's
    link = tmp_path / "their-link"
    link.symlink_to(tmp_path)
    os.lchown(link, 4321, 4321)
    with pytest.raises(ConfigError, match="link owned by uid 4321"):
        LocalDiskTierStore(str(link))
