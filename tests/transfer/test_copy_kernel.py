"""The range-copy kernel: its parameter table, the runtime's policy for it, and (marked ``cuda``)
the real kernel on a GPU, device-to-device and from registered host memory."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from cacheseek.errors import TransferError
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.copy_kernel import (
    MAX_RANGES,
    PARAM_BYTES,
    TILE_BYTES,
    RangeTable,
    aligned,
    range_tables,
)
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.memory import HostMapping, MemoryRange

from fakes.cudart import FakeCudart
from fakes.range_kernel import FakeRangeKernel


def _arrays(sizes, base_dst=1 << 20, base_src=1 << 40):
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return base_dst + offsets, base_src + offsets, sizes


def test_table_maps_every_tile_to_its_range():
    dsts, srcs, sizes = _arrays([16, TILE_BYTES, TILE_BYTES + 32, 3 * TILE_BYTES])
    table = RangeTable(dsts, srcs, sizes)
    assert table.buffer.nbytes == PARAM_BYTES <= 32764
    assert table.tiles == 1 + 1 + 2 + 3
    tiles = list(table.ranges())
    assert [t for t, *_ in tiles] == list(range(7))
    # the tiles cover each range exactly, in order, at the same offsets on both sides
    covered = {}
    for _, dst, src, n in tiles:
        assert dst - dsts[0] == src - srcs[0]
        covered[dst] = n
    assert sum(covered.values()) == int(sizes.sum())
    assert covered[int(dsts[2]) + TILE_BYTES] == 32


def test_batches_over_max_ranges_become_several_tables():
    dsts, srcs, sizes = _arrays([16] * (2 * MAX_RANGES + 3))
    tables = range_tables(dsts, srcs, sizes)
    assert [t.n for t in tables] == [MAX_RANGES, MAX_RANGES, 3]
    assert sum(t.tiles for t in tables) == 2 * MAX_RANGES + 3


def test_unaligned_batches_are_refused_with_the_reason():
    dsts, srcs, sizes = _arrays([16, 24])
    assert not aligned(dsts, srcs, sizes)
    with pytest.raises(TransferError, match="multiple of 16"):
        range_tables(dsts, srcs, sizes)
    with pytest.raises(TransferError, match="1 to 1024"):
        RangeTable(dsts[:0], srcs[:0], sizes[:0])


@pytest.fixture
def fake():
    rt = FakeCudart()
    rt.unknown_is_device = True
    return rt


def _runtime(fake, kernel=None, **kw):
    return CudaTransferRuntime(cudart=fake, current_stream=lambda: 7, tensor_device_type="cpu",
                               range_kernel=kernel, **kw)


def _buffers(n, size):
    src = np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(n * size, dtype=np.uint8)
    return src, dst


def test_runtime_sends_many_device_copies_to_the_kernel_and_bytes_arrive_in_stream_order(fake):
    kernel = FakeRangeKernel(fake)
    rt = _runtime(fake, kernel, kernel_min_copies=4)
    src, dst = _buffers(8, 4096)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    batch = CopyBatch.of(d + np.arange(8) * 4096, s + np.arange(8)[::-1] * 4096, 4096, Direction.D2D)
    pending = rt.submit_batch(batch, stream=7)
    assert kernel.launches == [(7, 8, 8)]
    assert not dst.any()  # queued on the stream, not yet performed
    pending.wait()
    assert np.array_equal(dst.reshape(8, -1), src.reshape(8, -1)[::-1])
    assert rt.kernel_batches == 1


def test_fast_on_the_producer_stream_where_the_kernel_or_the_batch_api_takes_the_batch(fake):
    """`fast_on` says whether a restore may go straight on the caller's stream: the kernel takes
    its batch on any stream; the copy engines' batch API only off the legacy default stream."""
    d2d = CopyBatch.of((1 << 20) + np.arange(8) * 4096, (1 << 40) + np.arange(8) * 4096, 4096, Direction.D2D)
    h2d = CopyBatch.of((1 << 20) + np.arange(8) * 4096, (1 << 40) + np.arange(8) * 4096, 4096, Direction.H2D)
    legacy = CudaTransferRuntime(cudart=fake, current_stream=lambda: 0, tensor_device_type="cpu",
                                 range_kernel=FakeRangeKernel(fake), kernel_min_copies=4)
    assert legacy.fast_on(d2d) and not legacy.fast_on(h2d) and legacy.fast_on(h2d, stream=7)
    assert not _runtime(fake, None, copy_kernel=False, use_batch_api=False).fast_on(d2d, stream=7)


def test_policy_keeps_few_copies_large_host_reads_and_unaligned_batches_on_the_copy_engines(fake):
    kernel = FakeRangeKernel(fake)
    rt = _runtime(fake, kernel, kernel_min_copies=4, kernel_h2d_max_mean_bytes=8192)
    src, dst = _buffers(8, 16384)
    host = HostMapping(int(src.ctypes.data), src.nbytes, 0)
    rt.register([host])
    d = int(dst.ctypes.data)
    dev_src = src.copy()  # device memory of the fake: anything not registered
    s = int(dev_src.ctypes.data)
    cases = {
        "few": CopyBatch.of(d + np.arange(3) * 16, s + np.arange(3) * 16, 16, Direction.D2D),
        "large host reads": CopyBatch.of(d + np.arange(8) * 16384, host.ptr + np.arange(8) * 16384, 16384, Direction.H2D),
        "unaligned": CopyBatch.of(d + np.arange(8) * 24, s + np.arange(8) * 24, 24, Direction.D2D),
    }
    for name, batch in cases.items():
        rt.copy_batch(batch, stream=7, device_ranges=[MemoryRange(d, dst.nbytes)])
        assert kernel.launches == [], name
    small_host = CopyBatch.of(d + np.arange(8) * 4096, host.ptr + np.arange(8) * 4096, 4096, Direction.H2D)
    rt.copy_batch(small_host, stream=7, device_ranges=[MemoryRange(d, dst.nbytes)])
    assert len(kernel.launches) == 1
    assert np.array_equal(dst[: 8 * 4096], src[: 8 * 4096])
    kernel.host_readable = False  # a device that cannot read registered memory at its host address
    rt.copy_batch(small_host, stream=7, device_ranges=[MemoryRange(d, dst.nbytes)])
    assert len(kernel.launches) == 1
    rt.unregister([host])


def test_copy_kernel_false_never_launches_and_auto_over_a_fake_builds_nothing(fake):
    kernel = FakeRangeKernel(fake)
    off = _runtime(fake, kernel, copy_kernel=False, kernel_min_copies=1)
    auto = _runtime(fake, None, kernel_min_copies=1)
    src, dst = _buffers(4, 4096)
    batch = CopyBatch.of(int(dst.ctypes.data) + np.arange(4) * 4096, int(src.ctypes.data) + np.arange(4) * 4096, 4096, Direction.D2D)
    for rt in (off, auto):
        rt.copy_batch(batch, stream=7)
        assert rt.range_kernel is None and rt.kernel_batches == 0
    assert kernel.launches == []
    assert np.array_equal(dst, src)


def test_a_failing_launch_is_a_transfer_error_and_nothing_is_counted(fake):
    class Broken(FakeRangeKernel):
        def launch(self, table, stream):
            raise TransferError("cuLaunchKernel(copy_ranges, 4 ranges) failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    rt = _runtime(fake, Broken(fake), kernel_min_copies=1)
    src, dst = _buffers(4, 4096)
    batch = CopyBatch.of(int(dst.ctypes.data) + np.arange(4) * 4096, int(src.ctypes.data) + np.arange(4) * 4096, 4096, Direction.D2D)
    with pytest.raises(TransferError, match="LAUNCH_OUT_OF_RESOURCES"):
        rt.copy_batch(batch, stream=7)
    assert rt.kernel_batches == 0 and rt.stats.batches == 0


def test_bad_policy_knobs_name_the_field(fake):
    with pytest.raises(TransferError, match="kernel_min_copies"):
        _runtime(fake, kernel_min_copies=0)
    with pytest.raises(TransferError, match="kernel_h2d_max_mean_bytes"):
        _runtime(fake, kernel_h2d_max_mean_bytes=-1)


# -- the real kernel -------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs CUDA and cuda-bindings",
)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("n,size", [(7, 16), (300, 48 * 1024 + 16), (2 * MAX_RANGES + 5, 4096), (3, 3 * TILE_BYTES + 4080)])
@pytest.mark.parametrize("direction", ["d2d", "h2d"])
def test_real_kernel_copies_every_byte(direction, n, size):
    rt = CudaTransferRuntime(copy_kernel=True, kernel_min_copies=1, kernel_h2d_max_mean_bytes=1 << 40)
    try:
        src = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(n * size + 32, dtype=torch.uint8, device="cuda")
        order = np.random.default_rng(1).permutation(n)
        host = None
        if direction == "h2d":
            host_np = src.cpu().numpy().copy()
            host = HostMapping(int(host_np.ctypes.data), host_np.nbytes, 0)
            rt.register([host])
            src_base = host.ptr
        else:
            src_base = int(src.data_ptr())
        batch = CopyBatch.of(int(dst.data_ptr()) + np.arange(n) * size, src_base + order * size, size, Direction(direction))
        stream = rt.new_stream()
        rt.copy_batch(batch, stream=stream, device_ranges=[MemoryRange(int(dst.data_ptr()), dst.numel()), MemoryRange(int(src.data_ptr()), src.numel())])
        assert rt.kernel_batches == 1
        want = src.view(n, size)[torch.as_tensor(order, device="cuda")].reshape(-1)
        assert torch.equal(dst[: n * size], want)
        assert not dst[n * size :].any()  # nothing written past the last range
        rt.destroy_stream(stream)
        if host is not None:
            rt.unregister([host])
    finally:
        rt.close()


@pytest.mark.cuda
@needs_gpu
def test_real_runtime_in_auto_mode_builds_the_kernel_for_a_restore_shaped_batch():
    rt = CudaTransferRuntime()
    try:
        src = torch.randint(0, 256, (64 * 65536,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        batch = CopyBatch.of(int(dst.data_ptr()) + np.arange(64) * 65536, int(src.data_ptr()) + np.arange(64) * 65536, 65536, Direction.D2D)
        rt.copy_batch(batch, stream=rt.new_stream())
        assert rt.range_kernel is not None, rt.kernel_unavailable
        assert rt.kernel_batches == 1 and torch.equal(dst, src)
    finally:
        rt.close()
