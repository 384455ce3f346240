"""A segment registered in pieces on the CUDA runtime over the fake cudart and on the host runtime:
every piece its own cudaHostRegister, copies over a joint cut (the fake refuses an uncut one, as
CUDA treats it as not pinned) with the bytes intact, a failing piece leaves nothing registered;
and the Plan tier faulting and registering piece by piece, in the foreground and the background."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import RegistrationError, StoreWarmingError, TransferError
from cacheseek.kv.ring import RingGeometry
from cacheseek.transfer.base import SubmitFailed
from cacheseek.transfer.batch import CopyBatch, CopyDescriptor, Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.host_transfer import HostTransferRuntime
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.stores.plan_tier import PlanTierStore
from plan_testkit import assert_restores_match, HostBuffer, fake_cuda_runtime, ingest

from fakes.cudart import FakeCudart
from fakes.cudart_types import cudaError_t, cudaMemcpyKind

P = 4096
STREAM = 5


def cuda(batch_api="13"):
    fake = FakeCudart(batch_api=batch_api)
    return CudaTransferRuntime(cudart=fake, current_stream=lambda: STREAM, tensor_device_type="cpu"), fake


@pytest.mark.parametrize("batch_api", ["13", None])
def test_each_piece_is_a_registration_and_close_undoes_them_all(batch_api):
    rt, fake = cuda(batch_api)
    host = HostBuffer(4 * P)
    rt.register_in_pieces(host.mapping(), P)
    assert [c.args[:2] for c in fake.calls_named("cudaHostRegister")] == [(host.ptr + i * P, P) for i in range(4)]
    assert sorted(fake.memory.registered) == [host.ptr + i * P for i in range(4)]
    stats = rt.stats
    assert (stats.n_registered, stats.registered_pieces, stats.registered_bytes) == (1, 4, 4 * P)
    assert rt.registered() == [host.mapping()] and len(rt.registered_pieces(host.mapping())) == 4
    rt.close()
    assert sorted(c.args[0] for c in fake.calls_named("cudaHostUnregister")) == [host.ptr + i * P for i in range(4)]
    assert fake.memory.registered == {}


@pytest.mark.parametrize("batch_api", ["13", "12", None])
def test_copies_over_a_joint_are_cut_and_the_bytes_arrive_intact(batch_api):
    rt, fake = cuda(batch_api)
    host = HostBuffer(3 * P)
    pattern = bytes(range(256)) * (3 * P // 256)
    host.write(pattern)
    rt.register_in_pieces(host.mapping(), P)
    dev = fake.device_alloc(3 * P)
    src, n = host.ptr + P - 100, P + 300  # over both joints' first: [P-100, 2P+200)
    rt.copy_batch([CopyDescriptor(dev, src, n, Direction.H2D)])
    assert torch.equal(torch.frombuffer(bytearray(read_at(dev, n)), dtype=torch.uint8),
                       torch.frombuffer(bytearray(pattern[P - 100: P - 100 + n]), dtype=torch.uint8))
    sizes = _copy_sizes(fake)
    assert sizes == [100, P, 200]  # one descriptor, three copies: one per registration
    # and back: a D2H whose host destination spans both joints
    host.write(bytes(3 * P))
    rt.copy_batch([CopyDescriptor(host.ptr + 10, dev, 2 * P + 10, Direction.D2H)])
    assert host.read(10, n) == pattern[P - 100: P - 100 + n]
    assert rt.stats.h2d.copies == 3 and rt.stats.d2h.copies == 3
    rt.close()


def read_at(ptr: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(ptr, n)


def _copy_sizes(fake: FakeCudart) -> list[int]:
    batch = fake.calls_named("cudaMemcpyBatchAsync")
    if batch:
        return list(batch[-1].args[2])
    return [c.args[2] for c in fake.calls_named("cudaMemcpyAsync")]


@pytest.mark.parametrize("batch_api", ["13", None])
def test_the_fake_refuses_an_uncut_copy_over_a_joint_like_unregistered_memory(batch_api):
    rt, fake = cuda(batch_api)
    host = HostBuffer(2 * P)
    rt.register_in_pieces(host.mapping(), P)
    dev = fake.device_alloc(2 * P)
    (err,) = fake.cudaMemcpyAsync(dev, host.ptr + P - 8, 16, cudaMemcpyKind.cudaMemcpyHostToDevice, STREAM)
    assert err == cudaError_t.cudaErrorInvalidValue
    fake.cudaGetLastError()
    uncut = CopyBatch.from_descriptors([CopyDescriptor(dev, host.ptr + P - 8, 16, Direction.H2D)])
    with pytest.raises(SubmitFailed):
        rt._submit(uncut, STREAM)  # the runtime's submission without the cut: refused
    fake.cudaGetLastError()
    rt.copy_batch(uncut)  # through the contract: cut, accepted
    rt.close()


def test_a_failing_middle_piece_leaves_nothing_registered():
    rt, fake = cuda()
    host = HostBuffer(4 * P)
    fake.fail("cudaHostRegister", cudaError_t.cudaErrorMemoryAllocation, nth=3)
    with pytest.raises(RegistrationError, match=r"piece 2 .*cudaErrorMemoryAllocation.*register_piece_bytes"):
        rt.register_in_pieces(host.mapping(), P)
    assert fake.memory.registered == {} and fake.last_error == cudaError_t.cudaSuccess
    assert [c.args[0] for c in fake.calls_named("cudaHostUnregister")] == [host.ptr, host.ptr + P]
    assert rt.stats.n_registered == 0 and rt.stats.registered_pieces == 0 and rt.registered() == []
    with pytest.raises(TransferError, match="not inside"):
        rt.copy_batch([CopyDescriptor(fake.device_alloc(16), host.ptr, 16, Direction.H2D)])
    rt.close()


def test_the_host_runtime_cuts_the_same_way():
    rt = HostTransferRuntime()
    host = HostBuffer(2 * P, fill=7)
    rt.register_in_pieces(host.mapping(), P)
    dev = torch.zeros(2 * P, dtype=torch.uint8)
    host.write(bytes(range(200)), P - 100)
    rng = rt.device_range(dev)
    rt.copy_batch([CopyDescriptor(rng.ptr, host.ptr + P - 100, 200, Direction.H2D)], device_ranges=[rng])
    assert bytes(dev[:200].tolist()) == bytes(range(200))
    assert rt.stats.h2d.copies == 2 and rt.stats.registered_pieces == 2
    rt.close()


# -- the Plan tier --------------------------------------------------------------------------------

GEOM = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)
RING = dict(n_layers=2, heads=64, dim=256)  # 384 KiB a K or V value: values straddle 2 MiB joints
MiB = 1 << 20


def _crossing(batches: list, joints: list[int]) -> int:
    return sum(1 for b in batches for d in b for side, on_host in ((d.src, not d.direction.src_on_device),
                                                                    (d.dst, not d.direction.dst_on_device))
               if on_host and any(side < j < side + d.nbytes for j in joints))


@pytest.mark.parametrize("warmup", ["foreground", "background"])
def test_the_plan_tier_faults_and_registers_piece_by_piece_and_round_trips_over_the_joints(make_store, warmup):
    store, parts = make_store("fake_cuda", segment_bytes=12 * MiB, register_piece_bytes="2MiB", warmup=warmup)
    assert store.wait_ready(30)
    fake, client = parts["fake"], parts["client"]
    seg = client.wait_local_segments_ready()[0]
    regs = fake.calls_named("cudaHostRegister")
    assert [c.args[:2] for c in regs] == [(seg.ptr + i * 2 * MiB, 2 * MiB) for i in range(6)]
    assert client.segment_timers().fault_seconds > 0 and client.segment_timers().fault_method != "none"
    stats = store.stats
    assert stats.register_pieces == 6 and stats.mappings[0]["pieces"] == 6
    assert stats.transfer["registered_pieces"] == 6 and stats.transfer["n_registered"] == 1
    nodes, states, _, kv_size = ingest(store, GEOM, 5, **RING)
    assert_restores_match(store, GEOM, nodes, states, kv_size, (3, 5), **RING)
    joints = [seg.ptr + i * 2 * MiB for i in range(1, 6)]
    assert _crossing(parts["transfer"].batches, joints) > 0  # the data path did hand over copies to cut
    runtime = parts["runtime"]
    store.close()
    assert fake.memory.registered == {} and runtime.stats.registered_pieces == 0


def test_faults_and_registrations_interleave(make_store, event_log, monkeypatch):
    original = EmbeddedPlanClient.fault_local_range

    def fault_local_range(self, ptr, length):
        event_log.append(("fault", ptr, length))  # the fake logs its calls into the same list
        original(self, ptr, length)

    monkeypatch.setattr(EmbeddedPlanClient, "fault_local_range", fault_local_range)
    store, parts = make_store("fake_cuda", segment_bytes=6 * MiB, register_piece_bytes="2MiB")
    seg = parts["client"].wait_local_segments_ready()[0]
    steps = [("fault", (e[1] - seg.ptr) // (2 * MiB)) if e[0] == "fault" else ("register", (e[2][0] - seg.ptr) // (2 * MiB))
             for e in event_log if e[0] == "fault" or e[:2] == ("cudart", "cudaHostRegister")]
    assert steps == [("fault", 0), ("register", 0), ("fault", 1), ("register", 1), ("fault", 2), ("register", 2)]
    assert store.stats.segment_ready_seconds >= parts["client"].segment_timers().fault_seconds > 0


def test_a_failing_middle_piece_in_the_background_leaves_a_store_that_refuses_writes():
    runtime, fake = fake_cuda_runtime()
    fake.fail("cudaHostRegister", cudaError_t.cudaErrorMemoryAllocation, nth=2)
    client = EmbeddedPlanClient(segment_bytes=6 * MiB, prefault_threads=1)
    store = PlanTierStore(plan_client=client, transfer=runtime, overlap=False, warmup="background",
                          register_piece_bytes="2MiB")
    try:
        assert store.wait_ready(30) is False
        assert fake.memory.registered == {} and runtime.stats.n_registered == 0
        with pytest.raises(StoreWarmingError, match="piece 1"):
            store.put_skeleton("ab:lat", torch.zeros(4))
        assert store.stats.ready is False and "piece 1" in store.stats.warmup_error
    finally:
        store.close()
        client.close()
        runtime.close()


def test_register_piece_bytes_zero_registers_in_one_call(make_store):
    store, parts = make_store("fake_cuda", segment_bytes=6 * MiB, register_piece_bytes=0)
    regs = parts["fake"].calls_named("cudaHostRegister")
    assert len(regs) == 1 and regs[0].args[1] == 6 * MiB and store.stats.register_pieces == 1
