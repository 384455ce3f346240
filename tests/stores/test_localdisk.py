"""LocalDisk-specific behaviour: files, atomicity, reclamation, bad roots, corruption, write-back."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from cacheseek.errors import ConfigError, CorruptValueError, StoreError
from cacheseek.registry import STORES
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores import localdisk
from cacheseek.stores.localdisk import (
    LocalDiskTierStore,
    decode_key,
    encode_key,
)

WAIT_S = 5.0
LOC = "ab" * 32 + ":kv"


@pytest.fixture
def store(tmp_path):
    s = LocalDiskTierStore(str(tmp_path / "kv"))
    yield s
    s.close()


def kv(n_layers=2, tokens=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, tokens, 2, 4, generator=g).to(torch.bfloat16),
         torch.randn(1, tokens, 2, 4, generator=g).to(torch.bfloat16))
        for _ in range(n_layers)
    ]


def put(store, payload, locator=LOC, **kw):
    return store.put_async(locator, payload, tier=Tier.DISK, **kw)


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")


# -- registration and config --------------------------------------------------------------------


def test_registered_with_schema():
    assert STORES.get("localdisk") is LocalDiskTierStore
    fields = {f.name: f.default for f in STORES.schema("localdisk").__dataclass_fields__.values()}
    assert fields == {
        "_target_": "cacheseek.stores.localdisk.LocalDiskTierStore",
        "root": None,
        "write_back": False,
        "queue_depth": 4,
        "orphan_grace_s": 600.0,
        "fsync": True,
        "capacity_bytes": "auto",
        "op_timeout_s": 30.0,
        "codec": "none",
        "codec_device": "auto",
    }


def test_instantiates_from_schema(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(STORES.schema("localdisk"))
    cfg.root = str(tmp_path / "kv")
    cfg.write_back = True
    s = instantiate(cfg)
    try:
        assert isinstance(s, LocalDiskTierStore) and s.root == tmp_path / "kv"
        h = put(s, [("k", "v")])
        s.flush()
        assert h.ready
    finally:
        s.close()


# -- bad roots ----------------------------------------------------------------------------------


@pytest.mark.parametrize("root", [None, "", "   "])
def test_missing_root_names_the_field(root):
    with pytest.raises(ConfigError) as info:
        LocalDiskTierStore(root)
    assert info.value.field == "store.root" and info.value.fix


def test_root_under_a_file_names_the_field(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for root in (blocker, blocker / "kv"):
        with pytest.raises(ConfigError) as info:
            LocalDiskTierStore(str(root))
        assert info.value.field == "store.root"
        assert str(blocker) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_unwritable_root_names_the_field(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError) as info:
            LocalDiskTierStore(str(ro))
        assert info.value.field == "store.root" and "not writable" in str(info.value)
    finally:
        ro.chmod(0o700)


def test_failed_probe_write_names_the_field(tmp_path, monkeypatch):
    # works as root too: the probe file's name is taken by a folder, so writing it fails (its
    # random part made known here; a name planted in advance is never met: issue 33 item 3)
    import secrets

    monkeypatch.setattr(secrets, "token_hex", lambda n: "0" * 2 * n)
    root = tmp_path / "kv"
    (root / f".probe-{os.getpid()}-{threading.get_ident()}-00000000").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        LocalDiskTierStore(str(root))
    assert info.value.field == "store.root" and "not writable" in str(info.value)


def test_two_stores_share_one_root(store):
    """One root, several processes (each a store): what one commits, the other reads."""
    other = LocalDiskTierStore(str(store.root))
    try:
        k, v = torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
        h = put(store, [(k, v)])
        assert h.ready and torch.equal(other.get_layer(h, 0)[1], v)
    finally:
        other.close()
    store.close()
    LocalDiskTierStore(str(store.root)).close()


@pytest.mark.parametrize("depth", [0, -1, True])
def test_bad_queue_depth_names_the_field(tmp_path, depth):
    with pytest.raises(ConfigError) as info:
        LocalDiskTierStore(str(tmp_path / "kv"), write_back=True, queue_depth=depth)
    assert info.value.field == "store.queue_depth"


# -- files and keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [LOC + ":L3:k", "ab" * 32 + ":lat", "a/b", "..", ".", "%41", "ünï:cödé", "x y\n"],
)
def test_key_encoding_is_safe_and_reversible(key):
    name = encode_key(key)
    assert decode_key(name) == key
    assert "." not in name and "/" not in name and len(name) <= 200


def test_one_file_per_value_and_keys(store):
    h = put(store, kv())
    store.put_skeleton("ab" * 32 + ":lat", "latent")
    files = all_files(store.root)
    assert len(files) == 5
    expected = sorted([*layer_keys(LOC, 0), *layer_keys(LOC, 1), "ab" * 32 + ":lat"])
    assert store.keys() == expected
    assert h.ready


def test_values_survive_a_restart(tmp_path):
    payload = kv()
    s = LocalDiskTierStore(str(tmp_path / "kv"), fsync=True)
    h = put(s, [(k.clone(), v.clone()) for k, v in payload])
    s.close()
    s2 = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        got = s2.get_layer(h, 1)
        assert torch.equal(got[0], payload[1][0]) and torch.equal(got[1], payload[1][1])
    finally:
        s2.close()


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        torch.tensor(3.5, dtype=torch.bfloat16),  # 0-dim
        torch.empty(0, 5, dtype=torch.bfloat16),  # empty
        torch.tensor([True, False]),
        torch.arange(5, dtype=torch.int64),
        torch.randn(2, 3, dtype=torch.float16),
        b"\x00raw bytes\xff",
        "",
    ],
    ids=["strided", "scalar", "empty", "bool", "int64", "fp16", "bytes", "empty-str"],
)
def test_value_kinds_round_trip(store, value):
    store.put_skeleton("x:lat", value)
    got = store.get_skeleton("x:lat")
    if isinstance(value, torch.Tensor):
        assert got.dtype == value.dtype and got.shape == value.shape and got.is_contiguous()
        assert torch.equal(got, value)
    else:
        assert got == value and type(got) is type(value)


def test_stored_bytes_are_independent_of_the_callers_tensor(tmp_path):
    for write_back in (False, True):
        s = LocalDiskTierStore(str(tmp_path / f"kv{write_back}"), write_back=write_back)
        try:
            k = torch.ones(1, 4, 2, 4, dtype=torch.bfloat16)
            v = torch.full((1, 4, 2, 4), 2.0, dtype=torch.bfloat16)
            h = put(s, [(k, v)])
            s.flush()
            k.zero_()
            v.zero_()
            got_k, got_v = s.get_layer(h, 0)
            assert bool((got_k == 1).all()) and bool((got_v == 2).all())
            got_k.fill_(7)  # a read returns a private tensor too
            assert bool((s.get_layer(h, 0)[0] == 1).all())
        finally:
            s.close()


def test_unsupported_values_fail_the_write(store):
    h = put(store, [({1, 2}, "v")])  # neither a tensor, bytes, str nor plain JSON data
    assert not h.ready and isinstance(h.error, StoreError) and "set" in str(h.error)
    meta = torch.empty(2, device="meta")
    h2 = put(store, [(meta, meta)], locator="cd" * 32 + ":kv")
    assert not h2.ready and "CPU snapshot" in str(h2.error)
    assert store.stats.failed_writes == 2 and store.keys() == []


# -- atomic writes ------------------------------------------------------------------------------


def test_interrupted_write_leaves_no_value_and_no_temp(store, monkeypatch):
    seen = []
    real_replace = os.replace

    def failing_replace(src, dst, *, src_dir_fd, dst_dir_fd):
        seen.append((src, os.stat(src, dir_fd=src_dir_fd).st_size))  # the temp file was fully written
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(localdisk.os, "replace", failing_replace)
    h = put(store, kv(n_layers=1))
    monkeypatch.setattr(localdisk.os, "replace", real_replace)
    assert len(seen) == 1 and seen[0][1] > 4 * 2 * 4 * 2
    assert not h.ready and isinstance(h.error, StoreError)
    assert str(store.disk.path_of(layer_keys(LOC, 0)[0])) in str(h.error)
    assert all_files(store.root) == [] and store.keys() == []
    assert store.stats.failed_writes == 1


def test_temp_file_of_a_killed_write_is_invisible_and_swept(tmp_path):
    """A temp file names its writer: one whose writer is gone is swept at the next open; one of
    a live writer (another process's write in flight) stays; one that names no writer (an older
    version's) is swept once older than ``TEMP_GRACE_S``."""
    s = LocalDiskTierStore(str(tmp_path / "kv"))
    key = layer_keys(LOC, 0)[0]
    path = s.disk.path_of(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = path.parent / f".{path.name}.w{gone.pid}x0123456789ab.tmp"
    live = path.parent / f".{path.name}.w1x0123456789ab.tmp"  # pid 1: alive
    young = path.parent / f".{path.name}.abc123.tmp"
    old = path.parent / f".{path.name}.def456.tmp"
    for tmp in (dead, live, young, old):
        tmp.write_bytes(localdisk.MAGIC + b"half a value")
    past = time.time() - localdisk.TEMP_GRACE_S - 60
    os.utime(old, (past, past))
    assert s.keys() == [] and s.get_skeleton(key) is None
    s.close()
    LocalDiskTierStore(str(tmp_path / "kv")).close()
    assert not dead.exists() and not old.exists()
    assert live.exists() and young.exists()


def test_real_write_error_surfaces_on_the_handle(tmp_path):
    s = LocalDiskTierStore(str(tmp_path / "kv"), write_back=True)
    try:
        # the folder of V0 is a file now, as if the disk had been taken away mid-run
        folder = s.disk.path_of(layer_keys(LOC, 0)[1]).parent
        folder.mkdir(exist_ok=True)
        os.rmdir(folder)
        folder.write_text("in the way")
        h = put(s, kv(n_layers=1))
        s.flush()
        assert not h.ready and isinstance(h.error, StoreError) and str(folder) in str(h.error)
        assert s.stats.failed_writes == 1 and s.stats.pending_writes == 0
        assert s.keys() == []
    finally:
        s.close()


# -- reclamation --------------------------------------------------------------------------------


def test_free_gives_disk_space_back(store):
    assert store.disk_usage_bytes() == 0
    store.put_skeleton("ab" * 32 + ":lat", "kept")
    base = store.disk_usage_bytes()
    h = put(store, kv(n_layers=2, tokens=1024))
    assert h.nbytes == 4 * 1024 * 2 * 4 * 2
    assert store.disk_usage_bytes() >= base + h.nbytes
    store.free(h)
    assert [p.name for p in all_files(store.root)] == [encode_key("ab" * 32 + ":lat")]
    assert store.disk_usage_bytes() == base < 200
    assert store.stats.frees == 1


# -- corruption ---------------------------------------------------------------------------------


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


DAMAGES = ["truncate", "garbage", "empty", "bad-header", "extra", "flip-payload", "flip-last",
           "flip-header", "old-format"]


def _damaged(data: bytes, damage: str) -> bytes:
    hlen = int.from_bytes(data[8:12], "little")
    return {
        "truncate": lambda: data[:-3],
        "garbage": lambda: b"not a value at all",
        "empty": lambda: b"",
        "bad-header": lambda: data[:12] + b"{" * (len(data) - 12),
        "extra": lambda: data + b"\x00",
        "flip-payload": lambda: _flip(data, 12 + hlen + 1),
        "flip-last": lambda: _flip(data, len(data) - 1),
        "flip-header": lambda: _flip(data, 12 + hlen // 2),
        "old-format": lambda: b"CSKVAL01" + data[8:],
    }[damage]()


@pytest.mark.parametrize("damage", DAMAGES)
def test_corrupt_file_is_a_corrupt_value_error_naming_it(store, damage):
    put(store, kv(n_layers=1))
    key = layer_keys(LOC, 0)[1]
    path = store.disk.path_of(key)
    path.write_bytes(_damaged(path.read_bytes(), damage))
    with pytest.raises(CorruptValueError) as info:
        store.disk.read(key)
    assert str(path) in str(info.value) and "corrupt" in str(info.value) and info.value.key == key


@pytest.mark.parametrize("damage", DAMAGES)
def test_corrupt_value_reads_as_missing_and_is_removed(store, damage):
    h = put(store, kv(n_layers=2))
    key = layer_keys(LOC, 1)[0]
    path = store.disk.path_of(key)
    path.write_bytes(_damaged(path.read_bytes(), damage))
    used = store.usage().used_bytes
    assert store.get_layer(h, 0) is not None
    assert store.get_layer(h, 1) is None
    assert not path.exists() and store.contains([key]) == [False]
    assert store.stats.corrupt_values == 1
    assert store.usage().used_bytes < used
    store.free(h)
    assert store.usage().used_bytes == 0


def test_checksum_covers_every_payload_byte(store):
    """Every single-bit flip of a small value's file is caught (header or payload)."""
    put(store, kv(n_layers=1, tokens=1))
    key = layer_keys(LOC, 0)[0]
    path = store.disk.path_of(key)
    data = path.read_bytes()
    for at in range(len(data)):
        path.write_bytes(_flip(data, at))
        with pytest.raises(CorruptValueError):
            store.disk.read(key)
    path.write_bytes(data)
    assert store.disk.read(key) is not None


# -- write-back ---------------------------------------------------------------------------------


class GatedDisk:
    """Delegates to the real backend; every write first waits for ``gate``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, value):
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("test gate never opened")
        self.inner.write(key, value)


def test_put_async_blocks_when_the_write_back_queue_is_full(tmp_path):
    s = LocalDiskTierStore(str(tmp_path / "kv"), write_back=True, queue_depth=1)
    gated = s.backend = GatedDisk(s.backend)
    try:
        first = put(s, [("k", "v")], locator="01" * 32 + ":kv")
        assert gated.entered.wait(WAIT_S)  # the worker holds the first blob
        second = put(s, [("k", "v")], locator="02" * 32 + ":kv")  # fills the queue
        third = []
        t = threading.Thread(target=lambda: third.append(put(s, [("k", "v")], locator="03" * 32 + ":kv")))
        t.start()
        t.join(0.2)
        assert t.is_alive() and third == []  # back-pressure: blocked, not queued without bound
        assert s.stats.pending_writes == 3
        gated.gate.set()
        t.join(WAIT_S)
        assert not t.is_alive()
        s.flush()
        assert first.ready and second.ready and third[0].ready
        assert len(s.keys()) == 6
    finally:
        gated.gate.set()
        s.close()


def test_describe_reports_root_and_usage(store):
    put(store, [("k", "v")])
    d = store.describe()
    assert d["name"] == "localdisk" and d["root"] == str(store.root)
    assert d["disk_usage_bytes"] > 0 and d["stats"]["puts"] == 1


def test_flush_and_close_are_bounded_and_never_close_under_a_live_writer(tmp_path):
    from cacheseek.errors import StoreTimeoutError

    s = LocalDiskTierStore(str(tmp_path / "kv"), write_back=True)
    gated = GatedDisk(s.backend)
    s.backend = gated
    closed = []
    real_close = gated.inner.close
    gated.close = lambda: (closed.append(True), real_close())
    h = put(s, kv(n_layers=1))
    assert gated.entered.wait(WAIT_S)
    with pytest.raises(StoreTimeoutError, match="1 writes still pending"):
        s.flush(timeout_s=0.1)
    s.flush_timeout_s = 0.1
    with pytest.raises(StoreTimeoutError):
        s.close()
    assert closed == [] and s.write_back_worker.is_alive()  # the backend stays open under the writer
    gated.gate.set()
    s.write_back_worker.join(WAIT_S)
    assert h.ready and not s.write_back_worker.is_alive()
    real_close()
