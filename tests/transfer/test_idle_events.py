"""`CudaTransferRuntime` keeps released events for reuse: per device, bounded, destroyed on close."""

from __future__ import annotations

import numpy as np
import torch

from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.idle_events import IDLE_EVENTS

from fakes.cudart import FakeCudart


def _runtime(fake, **kw):
    return CudaTransferRuntime(cudart=fake, current_stream=lambda: 7, tensor_device_type="cpu", **kw)


def _d2d(n=4, size=64):
    src = torch.arange(n * size, dtype=torch.uint8)
    dst = torch.zeros(n * size, dtype=torch.uint8)
    offs = np.arange(n) * size
    return src, dst, CopyBatch.of(dst.data_ptr() + offs, src.data_ptr() + offs, size, Direction.D2D)


def test_released_events_are_reused_and_every_copy_still_lands():
    fake = FakeCudart(unknown_is_device=True)
    rt = _runtime(fake)
    stream = rt.new_stream()
    for _ in range(20):
        src, dst, batch = _d2d()
        producer = rt.record_event(None)
        pending = rt.submit_batch(batch, stream=stream, after=[producer])
        rt.release_event(producer)
        pending.wait()
        assert torch.equal(src, dst)
    assert len(fake.calls_named("cudaEventCreateWithFlags")) == 2  # the first round's two, then reused
    assert rt.idle_events == 2 and fake.live_events() == 2
    rt.destroy_stream(stream)
    rt.close()
    assert rt.idle_events == 0 and fake.live_events() == 0


def test_idle_events_are_bounded_and_kept_per_device():
    fake = FakeCudart(unknown_is_device=True)
    rt = _runtime(fake)
    many = [rt.record_event(None) for _ in range(IDLE_EVENTS + 5)]
    for ev in many:
        rt.release_event(ev)
    assert rt.idle_events == IDLE_EVENTS and fake.live_events() == IDLE_EVENTS  # the rest destroyed
    fake.cudaSetDevice(1)
    made = len(fake.calls_named("cudaEventCreateWithFlags"))
    other = rt.record_event(None)  # device 1 gets none of device 0's events
    assert len(fake.calls_named("cudaEventCreateWithFlags")) == made + 1
    rt.release_event(other)
    fake.cudaSetDevice(0)
    again = rt.record_event(None)
    assert again.handle in [ev.handle for ev in many] and len(fake.calls_named("cudaEventCreateWithFlags")) == made + 1
    rt.release_event(again)
    rt.close()
    assert fake.live_events() == 0
