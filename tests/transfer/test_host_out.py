"""`host_out.from_device`: a value read out of a device pool is the caller's own host copy (pinned
on a GPU), bit-equal, unchanged when the pool's bytes change after; the frames it carries are
checked as any frames value (a damaged one is a `CorruptValueError`, a miss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheseek.errors import CorruptValueError
from cacheseek.kv import frames as frames_value
from cacheseek.transfer import host_out

KEY = bytes(range(32))


def _pool(device: str) -> tuple[torch.Tensor, torch.Tensor, frames_value.FramesSpec]:
    frames = torch.randint(0, 256, (4, 16, 24, 3), dtype=torch.uint8)
    value = frames_value.pack(KEY, frames)
    pool = torch.zeros(value.numel() + 512, dtype=torch.uint8, device=device)
    pool[256:256 + value.numel()] = value.to(device)
    return pool, frames, frames_value.FramesSpec(tuple(frames.shape), torch.uint8)


def _read_back(device: str) -> None:
    pool, frames, spec = _pool(device)
    view = pool[256:256 + frames_value.packed_nbytes(spec)]
    got = host_out.from_device(view)
    if device == "cuda":
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.is_pinned()
    else:
        assert isinstance(got, bytes)
    pool.fill_(7)  # the pool's bytes change (freed, written again): the copy is the caller's
    out = frames_value.unpack(KEY, got, spec, "k:frm")
    assert np.array_equal(out, frames.numpy())
    damaged = bytearray(bytes(got.numpy()) if isinstance(got, torch.Tensor) else got)
    damaged[-1] ^= 0x01
    bad = torch.frombuffer(damaged, dtype=torch.uint8) if device == "cuda" else bytes(damaged)
    with pytest.raises(CorruptValueError, match="checksum mismatch"):
        frames_value.unpack(KEY, bad, spec, "k:frm")


def test_a_cpu_pool_value_is_copied_into_bytes():
    _read_back("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_pool_value_lands_in_a_pinned_block_of_its_own():
    _read_back("cuda")
    pool, _, spec = _pool("cuda")
    view = pool[256:256 + frames_value.packed_nbytes(spec)]
    first = host_out.from_device(view)
    second = host_out.from_device(view)  # another read while the first is held: another block
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
