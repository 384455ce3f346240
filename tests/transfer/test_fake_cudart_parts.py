"""The parts of the fake cudart alone: `FakeMemory` (where an address lives, which copies are
allowed), `FakeStreams` (copies performed only when waited for) and `CallLog` (armed faults).
Their assembly, `FakeCudart`, is exercised through the CUDA runtime in tests/plan."""

from __future__ import annotations

import ctypes

from fakes.cudart_faults import CallLog
from fakes.cudart_types import (
    cudaError_t,
    cudaHostRegisterDefault,
    cudaHostRegisterReadOnly,
    cudaMemcpyKind,
    cudaMemoryType,
)
from fakes.memory import FakeMemory
from fakes.streams import FakeStreams

OK = cudaError_t.cudaSuccess


def test_memory_registration_overlap_and_read_only_ranges():
    mem = FakeMemory()
    mem.readonly_ranges.append((0x5000, 0x100))
    assert mem.register(0x1000, 0x100, cudaHostRegisterDefault) == OK
    assert mem.register(0x1080, 0x100, cudaHostRegisterDefault) == cudaError_t.cudaErrorHostMemoryAlreadyRegistered
    assert mem.register(0x5000, 0x100, cudaHostRegisterDefault) == cudaError_t.cudaErrorInvalidValue
    assert mem.register(0x5000, 0x100, cudaHostRegisterReadOnly) == OK
    assert mem.unregister(0x1000) == OK
    assert mem.unregister(0x1000) == cudaError_t.cudaErrorHostMemoryNotRegistered
    assert list(mem.registered) == [0x5000]


def test_memory_allows_copies_by_where_they_live():
    mem = FakeMemory()
    dev = mem.alloc(256)
    mem.register(0x1000, 0x100, cudaHostRegisterDefault)
    mem.register(0x2000, 0x100, cudaHostRegisterReadOnly)
    H2D, D2H = cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToHost
    assert mem.check_copy(dev, 0x1000, 64, H2D) and mem.check_copy(0x1000, dev, 64, D2H)
    assert not mem.check_copy(dev, 0x1000, 64, D2H)  # the kind contradicts the memory
    assert not mem.check_copy(0x2000, dev, 64, D2H)  # writes a read-only registration
    assert not mem.check_copy(dev, 0x9000, 64, None)  # unregistered source
    assert mem.pointer_attributes(dev).type == cudaMemoryType.cudaMemoryTypeDevice
    assert mem.pointer_attributes(0x9000).type == cudaMemoryType.cudaMemoryTypeUnregistered
    mem.unknown_is_device = True
    assert mem.check_copy(dev, 0x9000, 64, None) and mem.where(0x9000, 1) == "device"
    mem.strict = False
    assert mem.check_copy(0x2000, dev, 64, D2H)


def test_streams_perform_copies_only_when_waited_for():
    src, dst = ctypes.create_string_buffer(b"abcd", 4), ctypes.create_string_buffer(4)
    streams = FakeStreams()
    s = streams.create(1)
    assert s >= 1000 and streams.live_streams() == [s]
    streams.enqueue(s, [(ctypes.addressof(dst), ctypes.addressof(src), 4)])
    event = streams.new_event(2)
    streams.record(event, s)
    streams.enqueue(s, [(ctypes.addressof(dst), ctypes.addressof(dst), 4)])  # after the event
    assert dst.raw == b"\0" * 4 and streams.pending(s) == 2
    assert not streams.query(event, not_ready_queries=2) and not streams.query(event, not_ready_queries=2)
    assert streams.query(event, not_ready_queries=2)  # then the device progresses
    assert dst.raw == b"abcd" and streams.pending() == 1  # only the copies before the event
    assert streams.destroy(s) and streams.pending() == 0 and not streams.destroy(s)
    streams.destroy_event(event)
    assert not streams.is_live(event) and streams.live_events() == 0


def test_call_log_answers_the_nth_call_for_the_times_asked():
    log: list = []
    calls = CallLog(log)
    calls.fail("cudaMemcpyAsync", cudaError_t.cudaErrorLaunchFailure, nth=2, times=2)
    answers = [calls.record("cudaMemcpyAsync", (i,)) for i in range(4)]
    assert answers == [None, cudaError_t.cudaErrorLaunchFailure, cudaError_t.cudaErrorLaunchFailure, None]
    assert calls.record("cudaStreamSynchronize", (5,)) is None
    assert len(calls.named("cudaMemcpyAsync")) == 4 and log[-1] == ("cudart", "cudaStreamSynchronize", (5,))
    calls.set_device(3)
    calls.record("cudaEventRecord", ())
    assert calls.device_log[-1] == ("cudaEventRecord", 3) and calls.device_log[0] == ("cudaMemcpyAsync", None)
