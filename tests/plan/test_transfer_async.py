"""The asynchronous half of the transfer contract (`AsyncTransfer`) and `CopyBatch`: submit without
waiting, events across streams, idempotent waits, device-to-device snapshots, vectorized
validation, batch splitting. Host runtime and CUDA runtime over the fake cudart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheseek.errors import TransferError
from cacheseek.transfer.batch import CopyBatch, CopyDescriptor, Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.host_transfer import HostTransferRuntime
from cacheseek.transfer.pending import PendingBatch
from cacheseek.transfer.protocol import AsyncTransfer
from plan_testkit import HostBuffer

from fakes.cudart import FakeCudart
from fakes.cudart_types import cudaError_t

H2D, D2H, D2D = Direction.H2D, Direction.D2H, Direction.D2D


def cuda(**kw):
    fake = FakeCudart(**{"unknown_is_device": True, **kw})
    return CudaTransferRuntime(cudart=fake, current_stream=lambda: 0, tensor_device_type="cpu"), fake


@pytest.fixture(params=["host", "fake_cuda"])
def rt(request):
    runtime = HostTransferRuntime() if request.param == "host" else cuda()[0]
    yield runtime
    runtime.close()


def test_runtimes_offer_the_async_capability(rt):
    assert isinstance(rt, AsyncTransfer)


def test_submit_returns_before_the_copies_land_then_wait_lands_them():
    runtime, fake = cuda()
    host = HostBuffer(256)
    runtime.register([host.mapping()])
    dev = torch.arange(256, dtype=torch.uint8)
    stream = runtime.new_stream()
    assert fake.calls_named("cudaStreamCreateWithFlags")[0].args == (fake.cudaStreamNonBlocking,)
    batch = CopyBatch.of([host.ptr], [dev.data_ptr()], [256], D2H)
    pending = runtime.submit_batch(batch, stream=stream, device_ranges=[runtime.device_range(dev)])
    assert isinstance(pending, PendingBatch) and host.read() == bytes(256)  # not landed yet
    assert fake.calls_named("cudaMemcpyBatchAsync")[-1].args[-1] == stream
    pending.wait()
    pending.wait()  # idempotent
    assert host.read() == bytes(dev.tolist()) and pending.done()
    assert runtime.stats.d2h.bytes == 256 and fake.live_events() == runtime.idle_events
    runtime.destroy_stream(stream)
    assert fake.live_streams() == []


def _snapshot_then_read_on_a_side_stream(wait: bool):
    """A D2D snapshot of ``src`` on one stream, then a D2H of the snapshot on another, after an
    event of the first (``wait``) or not. Returns (runtime, fake, host, src, snapshot batch, the
    snapshot's tensor: the caller keeps it alive until the batch is waited for)."""
    runtime, fake = cuda()
    host = HostBuffer(64)
    runtime.register([host.mapping()])
    src = torch.arange(64, dtype=torch.uint8)
    mid = torch.zeros(64, dtype=torch.uint8)
    ranges = [runtime.device_range(src), runtime.device_range(mid)]
    producer, side = runtime.new_stream(), runtime.new_stream()
    snap = runtime.submit_batch(CopyBatch.of([mid.data_ptr()], [src.data_ptr()], [64], D2D), stream=producer,
                                device_ranges=ranges)
    out = runtime.submit_batch(CopyBatch.of([host.ptr], [mid.data_ptr()], [64], D2H), stream=side,
                               device_ranges=ranges, after=[snap] if wait else ())
    out.wait()
    return runtime, fake, host, src, snap, mid


def test_a_stream_waits_for_an_event_of_another():
    runtime, fake, host, src, snap, mid = _snapshot_then_read_on_a_side_stream(wait=True)
    assert host.read() == bytes(src.tolist())  # the D2H saw the snapshot, not zeros
    snap.wait()
    assert fake.live_events() == runtime.idle_events


def test_without_the_wait_the_side_stream_would_read_stale_bytes():
    runtime, fake, host, src, snap, mid = _snapshot_then_read_on_a_side_stream(wait=False)
    assert host.read() == bytes(64)  # the fake models the race a missing event would be
    snap.wait()


def test_record_event_and_stream_wait(rt):
    event = rt.record_event(rt.new_stream())
    rt.stream_wait(rt.new_stream(), event)
    rt.release_event(event)
    rt.release_event(event)  # idempotent
    rt.stream_wait(rt.new_stream(), event)  # a released event was waited for: nothing to do


def test_poll_wait_queries_until_done():
    runtime, fake = cuda(not_ready_queries=3)
    host = HostBuffer(64)
    runtime.register([host.mapping()])
    dev = torch.ones(64, dtype=torch.uint8)
    pending = runtime.submit_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], stream=runtime.new_stream(),
                                   device_ranges=[runtime.device_range(dev)])
    assert not pending.done()
    pending.wait(poll_s=0.0001)
    assert len(fake.calls_named("cudaEventQuery")) == 4 and host.read() == bytes([1]) * 64


def test_failed_wait_raises_every_time():
    runtime, fake = cuda()
    host = HostBuffer(64)
    runtime.register([host.mapping()])
    dev = torch.ones(64, dtype=torch.uint8)
    pending = runtime.submit_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], stream=runtime.new_stream(),
                                   device_ranges=[runtime.device_range(dev)])
    fake.fail("cudaEventSynchronize", cudaError_t.cudaErrorIllegalAddress)
    for _ in range(2):
        with pytest.raises(TransferError, match="cudaErrorIllegalAddress"):
            pending.wait()
    assert fake.live_events() == runtime.idle_events and fake.last_error == cudaError_t.cudaSuccess


def test_submission_failure_synchronizes_and_leaves_no_event():
    runtime, fake = cuda()
    host = HostBuffer(64)
    runtime.register([host.mapping()])
    dev = torch.ones(64, dtype=torch.uint8)
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue)
    with pytest.raises(TransferError):
        runtime.submit_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], stream=runtime.new_stream(),
                             device_ranges=[runtime.device_range(dev)])
    assert fake.calls[-1].name == "cudaStreamSynchronize" and fake.live_events() == runtime.idle_events


def test_large_batches_are_split_into_max_batch_calls():
    fake = FakeCudart(unknown_is_device=True)
    runtime = CudaTransferRuntime(cudart=fake, current_stream=lambda: 5, tensor_device_type="cpu", max_batch=3)
    host = HostBuffer(8 * 16)
    runtime.register([host.mapping()])
    dev = torch.arange(8 * 16, dtype=torch.uint8)
    runtime.copy_batch(CopyBatch.of(host.ptr + np.arange(8) * 16, dev.data_ptr() + np.arange(8) * 16, 16, D2H),
                       device_ranges=[runtime.device_range(dev)])
    assert [c.args[3] for c in fake.calls_named("cudaMemcpyBatchAsync")] == [3, 3, 2]
    assert host.read() == bytes(dev.tolist())


def test_a_batch_starts_with_a_short_call_then_doubles_up_to_max_batch():
    """The first batched call is short, so the copy engine starts while the bindings convert the
    rest; every copy goes out once, in order, and a failing call names its copy's index."""
    fake = FakeCudart(unknown_is_device=True)
    runtime = CudaTransferRuntime(cudart=fake, current_stream=lambda: 5, tensor_device_type="cpu", max_batch=100)
    n = 300
    host = HostBuffer(n * 16)
    runtime.register([host.mapping()])
    dev = torch.arange(n * 16, dtype=torch.uint8)
    runtime.copy_batch(CopyBatch.of(host.ptr + np.arange(n) * 16, dev.data_ptr() + np.arange(n) * 16, 16, D2H),
                       device_ranges=[runtime.device_range(dev)])
    calls = fake.calls_named("cudaMemcpyBatchAsync")
    assert [c.args[3] for c in calls] == [32, 64, 100, 100, 4]
    assert [d for c in calls for d in c.args[0]] == list(host.ptr + np.arange(n) * 16)
    assert host.read() == bytes(dev.tolist())
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue, nth=2)
    with pytest.raises(TransferError, match="cudaMemcpyBatchAsync of 64 copies failed"):
        runtime.copy_batch(CopyBatch.of(host.ptr + np.arange(n) * 16, dev.data_ptr() + np.arange(n) * 16, 16, D2H),
                           device_ranges=[runtime.device_range(dev)])


def test_copy_batch_arrays_match_descriptors():
    descs = [CopyDescriptor(100 + 10 * i, 5000 + 10 * i, 10, H2D if i % 2 else D2H) for i in range(5)]
    batch = CopyBatch.from_descriptors(descs)
    assert batch.descriptors() == descs and len(batch) == 5 and batch.nbytes == 50
    assert batch.by_direction() == {H2D: (20, 2), D2H: (30, 3)}
    joined = CopyBatch.concat([batch, CopyBatch.of([1], [2], [3], D2D)])
    assert joined.descriptors()[-1] == CopyDescriptor(1, 2, 3, D2D)
    with pytest.raises(TransferError, match="descriptor 1 is a str"):
        CopyBatch.from_descriptors([descs[0], "nope"])


@pytest.mark.parametrize("case", ["outside", "overlap", "zero", "read_only_dst"])
@pytest.mark.parametrize("kind", ["host", "fake_cuda"])
def test_vectorized_validation_refuses_before_submission(kind, case):
    # on the fake CUDA runtime, undeclared memory is not device memory here
    rt = HostTransferRuntime() if kind == "host" else cuda(unknown_is_device=False)[0]
    try:
        _refuses_before_submission(rt, case)
    finally:
        rt.close()


def _refuses_before_submission(rt, case):
    host = HostBuffer(4096)
    ro = HostBuffer(256)
    rt.register([host.mapping(), ro.mapping(generation=2, writable=False)])
    dev = torch.zeros(4096, dtype=torch.uint8)
    rng = rt.device_range(dev)
    n = 1000
    dsts = host.ptr + np.arange(n) * 4
    srcs = dev.data_ptr() + np.arange(n) * 4
    sizes = np.full(n, 4)
    if case == "outside":
        srcs[777] = dev.data_ptr() + 4095
    elif case == "overlap":
        dsts[500] = dsts[499] + 2
    elif case == "zero":
        sizes[3] = 0
    else:
        dsts[10] = ro.ptr
    with pytest.raises(TransferError, match="nothing of the batch was submitted"):
        rt.submit_batch(CopyBatch.of(dsts, srcs, sizes, D2H), stream=rt.new_stream(), device_ranges=[rng])
    assert host.read() == bytes(4096)
    assert rt.stats.batches == 0


def test_overlapping_declared_ranges_fall_back_to_the_exact_check(rt):
    host = HostBuffer(256)
    rt.register([host.mapping()])
    big = torch.zeros(256, dtype=torch.uint8)
    small = big[8:16]
    ranges = [rt.device_range(big), rt.device_range(small)]
    rt.copy_batch([CopyDescriptor(host.ptr, big.data_ptr() + 100, 50, D2H)], device_ranges=ranges)
