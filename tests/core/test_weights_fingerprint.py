"""Issue 24, item 2: the weights identity at a real user's cost. The tensor fingerprint is integer
arithmetic that numpy reproduces (so every device gives the same value), detects any change of one
word, and keeps names, shapes and dtypes apart; a checkpoint read from files is identified by its
files, hashed once and then read from a cache that a changed file never satisfies."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from cacheseek import weights


def _reference_lanes(raw: bytes) -> tuple[int, int]:
    """The module docstring's lanes written out with numpy (wrapping uint64/int64 arithmetic)."""
    x = np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<i8")
    a, b, v, u = (c.numpy() for c in weights.lane_coefficients("cpu", 1))
    block = weights.LANE_BLOCK
    i = np.arange(x.size)
    with np.errstate(over="ignore"):
        lane1 = int((x * a[i % block] * v[i // block]).sum())
        y = x * b[i % block]
        y ^= y >> 31
        lane2 = int((y * u[i // block]).sum())
    return lane1, lane2


@pytest.mark.parametrize("words", [0, 5, weights.LANE_BLOCK + 3, 2 * weights.LANE_BLOCK])
def test_lanes_are_the_documented_integer_sums(words):
    x = torch.from_numpy(np.random.default_rng(words).integers(-2**63, 2**63 - 1, words, dtype=np.int64))
    x = x if words else torch.empty(0, dtype=torch.int64)
    got = weights.tensor_lanes(x.view(torch.uint8), words).tolist()
    assert tuple(got) == _reference_lanes(x.numpy().tobytes())


def test_any_one_word_change_and_any_metadata_change_gives_another_fingerprint():
    base = torch.randn(257, 33, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # a 2-byte tail
    fp = weights.tensor_fingerprint([("w", base)])
    assert fp == weights.tensor_fingerprint([("w", base.clone())]) and len(fp) == 16
    flat = base.reshape(-1).view(torch.int16)
    seen = {fp}
    for pos in (0, 1, 3, 4, 1000, flat.numel() - 1):  # words and the tail
        for bit in (0, 7, 15):
            changed = flat.clone()
            changed[pos] ^= 1 << bit if bit < 15 else -(1 << 15)
            seen.add(weights.tensor_fingerprint([("w", changed.view(torch.bfloat16).reshape(base.shape))]))
    assert len(seen) == 1 + 6 * 3
    assert weights.tensor_fingerprint([("v", base)]) != fp  # the name
    assert weights.tensor_fingerprint([("w", base), ("e", torch.empty(0))]) != fp  # an empty tensor counts
    assert weights.tensor_fingerprint([("w", base.reshape(33, 257))]) != fp  # the shape, same bytes
    assert weights.tensor_fingerprint([("w", base.view(torch.float16))]) != fp  # the dtype, same bytes
    a, b = base[:100], base[100:]
    assert weights.tensor_fingerprint([("a", a), ("b", b)]) != weights.tensor_fingerprint([("a", b), ("b", a)])


def test_two_different_random_modules_never_share_and_equal_ones_do():
    one, two = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    same = torch.nn.Linear(64, 64)
    same.load_state_dict(one.state_dict())
    assert weights.module_fingerprint(one) != weights.module_fingerprint(two)
    assert weights.module_fingerprint(one) == weights.module_fingerprint(same)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHESEEK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


def test_checkpoint_files_are_hashed_once_then_read_from_the_cache(tmp_path, cache_dir, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)) * 64)
    (ckpt / "config.json").write_text('{"dim": 5120}')
    first = weights.checkpoint_fingerprint(ckpt)
    assert len(first) == 16 and len(list(cache_dir.glob("*.json"))) == 2

    with monkeypatch.context() as m:  # the weights are opened only to be hashed
        m.setattr("builtins.open", lambda *a, **k: pytest.fail(f"{a[0]} hashed again"))
        assert weights.checkpoint_fingerprint(ckpt) == first  # from the cache

    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-1] ^= 1  # same size; the write changes ctime, which the cache entry names
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    changed = weights.checkpoint_fingerprint(ckpt)
    assert changed != first

    for entry in cache_dir.glob("*.json"):  # a cache entry that lies about its file is not trusted
        body = json.loads(entry.read_text())
        entry.write_text(json.dumps({**body, "identity": body["identity"][:-1] + [0]}))
    assert weights.checkpoint_fingerprint(ckpt) == changed
    for entry in cache_dir.glob("*.json"):
        entry.write_text("{not json")
    assert weights.checkpoint_fingerprint(ckpt) == changed


def test_a_hugging_face_blob_is_identified_by_its_name_and_an_empty_path_is_refused(tmp_path, cache_dir):
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True), snap.mkdir(parents=True)
    name = "ab" * 32
    (blobs / name).write_bytes(b"weights")
    os.symlink(blobs / name, snap / "model.safetensors")
    fp = weights.checkpoint_fingerprint(snap)
    assert not cache_dir.exists()  # nothing hashed: the blob's name is its sha256
    (blobs / ("cd" * 32)).write_bytes(b"weights")
    os.remove(snap / "model.safetensors")
    os.symlink(blobs / ("cd" * 32), snap / "model.safetensors")
    assert weights.checkpoint_fingerprint(snap) != fp
    with pytest.raises(ValueError, match="holds no file"):
        weights.checkpoint_fingerprint(tmp_path / "empty")


def test_a_module_from_files_is_identified_by_them_and_its_dtype(tmp_path, cache_dir):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "dit.safetensors").write_bytes(b"x" * 100)
    layer = torch.nn.Linear(4, 4)
    by_tensors = weights.module_fingerprint(layer)
    weights.from_files(layer, ckpt)
    by_files = weights.module_fingerprint(layer)
    assert by_files != by_tensors
    other = torch.nn.Linear(4, 4)  # other tensors, the same files and dtype: the same checkpoint
    weights.from_files(other, ckpt)
    assert weights.module_fingerprint(other) == by_files
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    weights.from_files(half, ckpt)
    assert weights.module_fingerprint(half) != by_files


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fingerprint_on_cuda_equals_the_cpu_one():
    g = torch.Generator().manual_seed(5)
    named = [("big", torch.randn(3 * weights.LANE_BLOCK + 11, generator=g).to(torch.bfloat16)),
             ("odd", torch.randn(7, generator=g).to(torch.bfloat16)), ("i", torch.arange(5))]
    assert weights.tensor_fingerprint([(n, t.cuda()) for n, t in named]) == weights.tensor_fingerprint(named)
