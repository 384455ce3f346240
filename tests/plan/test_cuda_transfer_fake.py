"""The CUDA transfer runtime on the fake cudart: registration rules, submission forms, stream use,
one synchronize per batch, and synchronize-before-raise after a partial submission."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import RegistrationError, TransferError
from cacheseek.transfer.batch import CopyDescriptor, Direction
from cacheseek.transfer.cuda_bindings import parameter_names
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from plan_testkit import HostBuffer

from fakes.cudart import FakeCudart
from fakes.cudart_types import cudaError_t, cudaMemcpyKind

H2D, D2H = Direction.H2D, Direction.D2H
OK = cudaError_t.cudaSuccess


def make(batch_api="13", stream=5, **kw):
    fake = FakeCudart(batch_api=batch_api, **kw)
    rt = CudaTransferRuntime(cudart=fake, current_stream=lambda: stream, tensor_device_type="cpu")
    return rt, fake


def names(fake):
    return [c.name for c in fake.calls]


# -- registration -------------------------------------------------------------------------------


def test_register_default_flags_once_per_mapping():
    rt, fake = make()
    host = HostBuffer(4096)
    rt.register([host.mapping(), host.mapping()])
    rt.register([host.mapping()])
    regs = fake.calls_named("cudaHostRegister")
    assert [c.args for c in regs] == [(host.ptr, 4096, fake.cudaHostRegisterDefault)]


def test_new_generation_is_a_new_registration_and_already_registered_is_success():
    rt, fake = make()
    host = HostBuffer(4096)
    rt.register([host.mapping(generation=1)])
    rt.register([host.mapping(generation=2)])  # same range, driver answers "already registered"
    assert rt.stats.n_registered == 2
    assert fake.last_error == OK
    rt.close()
    # only the registration this runtime made is undone, once
    assert [c.args for c in fake.calls_named("cudaHostUnregister")] == [(host.ptr,)]


def test_readonly_mapping_falls_back_and_clears_the_sticky_error():
    rt, fake = make()
    host = HostBuffer(4096)
    fake.readonly_ranges.append((host.ptr, host.n))
    rt.register([host.mapping(writable=False)])
    assert [c.args[2] for c in fake.calls_named("cudaHostRegister")] == [
        fake.cudaHostRegisterDefault,
        fake.cudaHostRegisterReadOnly,
    ]
    i_fail = names(fake).index("cudaHostRegister")
    assert names(fake)[i_fail + 1] == "cudaGetLastError"
    assert fake.last_error == OK
    assert fake.is_registered(host.ptr)


def test_writable_mapping_failure_raises_and_clears_sticky_error():
    rt, fake = make()
    host = HostBuffer(4096)
    fake.fail("cudaHostRegister", cudaError_t.cudaErrorMemoryAllocation)
    with pytest.raises(RegistrationError, match="cudaErrorMemoryAllocation"):
        rt.register([host.mapping()])
    assert fake.last_error == OK
    assert rt.stats.n_registered == 0


def test_readonly_fallback_failure_names_both_errors():
    rt, fake = make()
    host = HostBuffer(4096)
    fake.fail("cudaHostRegister", times=2)
    with pytest.raises(RegistrationError, match="default flags cudaErrorInvalidValue, read-only flags"):
        rt.register([host.mapping(writable=False)])
    assert fake.last_error == OK


def test_readonly_registration_is_only_a_source():
    rt, fake = make(unknown_is_device=True)
    host = HostBuffer(64)
    fake.readonly_ranges.append((host.ptr, host.n))
    rt.register([host.mapping(writable=False)])
    dev = torch.zeros(64, dtype=torch.uint8)
    rng = rt.device_range(dev)
    rt.copy_batch([CopyDescriptor(dev.data_ptr(), host.ptr, 64, H2D)], device_ranges=[rng])
    with pytest.raises(TransferError, match="writable"):
        rt.copy_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], device_ranges=[rng])


# -- submission ---------------------------------------------------------------------------------


def setup_copies(rt, fake, n=4, size=32):
    host = HostBuffer(n * size)
    rt.register([host.mapping()])
    dev = torch.arange(n * size, dtype=torch.uint8)
    fake.add_device_range(dev.data_ptr(), n * size)
    descs = [CopyDescriptor(host.ptr + i * size, dev.data_ptr() + i * size, size, D2H) for i in range(n)]
    return host, dev, descs


def test_loop_on_legacy_stream_keeps_order_and_kind_and_syncs_once():
    rt, fake = make(stream=0)
    host, dev, descs = setup_copies(rt, fake)
    rt.copy_batch(descs)
    memcpys = fake.calls_named("cudaMemcpyAsync")
    assert [(c.args[0], c.args[1], c.args[2]) for c in memcpys] == [(d.dst, d.src, d.nbytes) for d in descs]
    assert {c.args[3] for c in memcpys} == {cudaMemcpyKind.cudaMemcpyDeviceToHost}
    assert {c.args[4] for c in memcpys} == {0}
    assert not fake.calls_named("cudaMemcpyBatchAsync")
    assert [c.args for c in fake.calls_named("cudaStreamSynchronize")] == [(0,)]
    assert names(fake)[-1] == "cudaStreamSynchronize"
    assert host.read() == bytes(dev.tolist())


def test_h2d_uses_host_to_device_kind():
    rt, fake = make(stream=0)
    host, dev, descs = setup_copies(rt, fake)
    back = [CopyDescriptor(d.src, d.dst, d.nbytes, H2D) for d in descs]
    rt.copy_batch(back)
    assert {c.args[3] for c in fake.calls_named("cudaMemcpyAsync")} == {cudaMemcpyKind.cudaMemcpyHostToDevice}


@pytest.mark.parametrize("batch_api", ["13", "12"])
def test_batch_call_on_a_real_stream_in_descriptor_order(batch_api):
    rt, fake = make(batch_api=batch_api, stream=5)
    host, dev, descs = setup_copies(rt, fake)
    assert rt.batch_api
    rt.copy_batch(descs)
    (batch,) = fake.calls_named("cudaMemcpyBatchAsync")
    dsts, srcs, sizes, count, num_attrs, stream = batch.args
    assert dsts == tuple(d.dst for d in descs) and srcs == tuple(d.src for d in descs)
    assert sizes == (32,) * 4 and count == 4 and num_attrs == 1 and stream == 5
    assert not fake.calls_named("cudaMemcpyAsync")
    assert [c.args for c in fake.calls_named("cudaStreamSynchronize")] == [(5,)]
    assert host.read() == bytes(dev.tolist())


def test_explicit_stream_object_wins_over_current_stream():
    class TorchLikeStream:
        cuda_stream = 9

    rt, fake = make(stream=5)
    host, dev, descs = setup_copies(rt, fake)  # keep the buffers alive
    rt.copy_batch(descs, stream=TorchLikeStream())
    assert fake.calls_named("cudaMemcpyBatchAsync")[0].args[-1] == 9
    assert [c.args for c in fake.calls_named("cudaStreamSynchronize")] == [(9,)]


def test_no_batch_api_uses_the_loop():
    rt, fake = make(batch_api=None)
    host, dev, descs = setup_copies(rt, fake)
    assert not rt.batch_api
    rt.copy_batch(descs)
    assert len(fake.calls_named("cudaMemcpyAsync")) == 4
    assert host.read() == bytes(dev.tolist())


def test_unsupported_batch_call_falls_back_to_the_loop_for_good():
    rt, fake = make()
    host, dev, descs = setup_copies(rt, fake)
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorNotSupported)
    rt.copy_batch(descs)
    assert not rt.batch_api
    assert len(fake.calls_named("cudaMemcpyAsync")) == 4
    assert host.read() == bytes(dev.tolist())
    assert fake.last_error == OK


def test_batch_failure_synchronizes_then_raises_with_index():
    rt, fake = make(batch_api="12")
    host, dev, descs = setup_copies(rt, fake)  # keep the buffers alive
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue)
    with pytest.raises(TransferError, match="cudaMemcpyBatchAsync of 4 copies failed at copy 0"):
        rt.copy_batch(descs)
    assert names(fake)[-1] == "cudaStreamSynchronize"
    assert fake.last_error == OK


def test_partial_submission_synchronizes_before_raising():
    rt, fake = make(stream=0)
    host, dev, descs = setup_copies(rt, fake)
    fake.fail("cudaMemcpyAsync", nth=3)
    with pytest.raises(TransferError, match="cudaMemcpyAsync 2 of 4"):
        rt.copy_batch(descs)
    assert names(fake)[-2:] == ["cudaGetLastError", "cudaStreamSynchronize"]
    assert fake.pending() == 0  # the two copies that went out have landed
    assert host.read(0, 64) == bytes(dev.tolist())[:64]
    assert host.read(64) == bytes(64)


def test_failure_of_the_first_submission_needs_no_synchronize():
    rt, fake = make(stream=0)
    host, dev, descs = setup_copies(rt, fake)  # keep the buffers alive
    fake.fail("cudaMemcpyAsync", nth=1)
    with pytest.raises(TransferError):
        rt.copy_batch(descs)
    assert not fake.calls_named("cudaStreamSynchronize")


def test_synchronize_failure_raises():
    rt, fake = make()
    host, dev, descs = setup_copies(rt, fake)  # keep the buffers alive
    fake.fail("cudaStreamSynchronize", cudaError_t.cudaErrorIllegalAddress)
    with pytest.raises(TransferError, match="cudaStreamSynchronize failed: cudaErrorIllegalAddress"):
        rt.copy_batch(descs)


def test_undeclared_device_memory_checked_with_pointer_attributes():
    rt, fake = make()
    host = HostBuffer(64)
    rt.register([host.mapping()])
    dev = fake.device_alloc(64)
    rt.copy_batch([CopyDescriptor(host.ptr, dev, 64, D2H)])
    assert fake.calls_named("cudaPointerGetAttributes")
    other = HostBuffer(64)
    with pytest.raises(TransferError, match="declared device range"):
        rt.copy_batch([CopyDescriptor(host.ptr, other.ptr, 64, D2H)])


def test_use_batch_api_true_requires_the_call():
    with pytest.raises(TransferError, match="lack cudaMemcpyBatchAsync"):
        CudaTransferRuntime(cudart=FakeCudart(batch_api=None), use_batch_api=True, current_stream=lambda: 5)
    rt = CudaTransferRuntime(cudart=FakeCudart(), use_batch_api=False, current_stream=lambda: 5)
    assert not rt.batch_api


def test_batch_signature_read_from_the_binding_docstring():
    fake = FakeCudart()
    assert parameter_names(fake.cudaMemcpyBatchAsync) == [
        "dsts", "srcs", "sizes", "count", "attrs", "attrsIdxs", "numAttrs", "stream",
    ]

    def with_fail_idx():
        """cudaMemcpyBatchAsync(dsts: list[Any], srcs: list[Any], sizes: list[int], size_t count, attrs: Optional[tuple[A] | list[A]], attrsIdxs: list[int], size_t numAttrs, failIdx, hStream)"""

    assert parameter_names(with_fail_idx)[-2:] == ["failIdx", "hStream"]


# -- cuda:N (issue 12): CUDA state is made on the runtime's device, on every thread ------------


def test_streams_events_registrations_and_worker_threads_run_on_the_runtimes_device():
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.reuse.exact_prefix.types import Tier
    from cacheseek.stores.plan_tier import PlanTierStore

    fake = FakeCudart(unknown_is_device=True)
    runtime = CudaTransferRuntime(cudart=fake, current_stream=lambda: 7, tensor_device_type="cpu", device="cuda:1")
    assert runtime.device_index == 1
    client = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1)
    store = PlanTierStore(plan_client=client, transfer=runtime, overlap=True)
    try:
        k = torch.ones(1, 4, 2, 4, dtype=torch.bfloat16)
        h = store.put_async("dv:kv", [(k, k.clone())], tier=Tier.FLUXON_DRAM)
        store.flush()
        assert h.ready
        # every call that makes or uses CUDA state, on the caller's thread and on the completion
        # thread (its event queries included), ran with device 1 current
        made = {"cudaStreamCreateWithFlags", "cudaEventCreateWithFlags", "cudaHostRegister", "cudaEventRecord",
                "cudaMemcpyAsync", "cudaMemcpyBatchAsync", "cudaEventQuery", "cudaEventSynchronize"}
        seen = [(name, dev) for name, dev in fake.device_log if name in made]
        assert {name for name, _ in seen} >= {"cudaStreamCreateWithFlags", "cudaHostRegister", "cudaEventQuery"}
        assert all(dev == 1 for _, dev in seen), [s for s in seen if s[1] != 1]
    finally:
        store.close()
        client.close()
        runtime.close()


def test_device_of_the_runtime_is_parsed():
    from cacheseek.errors import TransferError
    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

    fake = FakeCudart()
    assert CudaTransferRuntime(cudart=fake, device="cuda").device_index is None
    assert CudaTransferRuntime(cudart=fake, device=3).device_index == 3
    with pytest.raises(TransferError, match="cuda:N"):
        CudaTransferRuntime(cudart=fake, device="cuda:one")
