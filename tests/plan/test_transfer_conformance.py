"""The transfer contract, run against every runtime: the host runtime and the CUDA runtime over the
fake cudart (batched and per-copy submission). Device memory is CPU tensors declared per batch."""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from cacheseek.errors import TransferError
from cacheseek.transfer import TRANSFERS, auto_transfer_runtime
from cacheseek.transfer.batch import CopyDescriptor, Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.host_transfer import HostTransferRuntime
from cacheseek.transfer.memory import MemoryRange
from cacheseek.transfer.protocol import TransferRuntime
from plan_testkit import HostBuffer

from fakes.cudart import FakeCudart

H2D, D2H, H2H = Direction.H2D, Direction.D2H, Direction.H2H


class Env:
    """A runtime plus a way to make device memory it accepts."""

    def __init__(self, kind: str) -> None:
        self.fake = None
        if kind == "host":
            self.runtime = HostTransferRuntime()
        else:
            self.fake = FakeCudart(batch_api="13" if kind == "cuda_batch" else None)
            self.runtime = CudaTransferRuntime(cudart=self.fake, current_stream=lambda: 5, tensor_device_type="cpu")
        self._keep: list = []

    def device(self, n: int, fill: int = 0) -> tuple[torch.Tensor, MemoryRange]:
        t = torch.full((n,), fill, dtype=torch.uint8)
        self._keep.append(t)
        if self.fake is not None:
            self.fake.add_device_range(t.data_ptr(), n)
        return t, self.runtime.device_range(t)


@pytest.fixture(params=["host", "cuda_batch", "cuda_loop"])
def env(request) -> Env:
    e = Env(request.param)
    yield e
    e.runtime.close()


def test_is_a_transfer_runtime(env):
    assert isinstance(env.runtime, TransferRuntime)
    assert env.runtime.device_kind in ("cpu", "cuda")


def test_register_is_deduplicated(env):
    host = HostBuffer(4096)
    env.runtime.register([host.mapping(), host.mapping()])
    env.runtime.register([host.mapping()])
    assert env.runtime.stats.n_registered == 1
    assert env.runtime.registered() == [host.mapping()]


def test_registrations_are_counted_per_user(env):
    """Two users of one mapping: the first unregister keeps it (copies still accepted, CUDA still
    registered); the second unregisters it."""
    host = HostBuffer(64)
    env.runtime.register([host.mapping()])  # user A
    env.runtime.register([host.mapping()])  # user B
    assert env.runtime.users(host.mapping()) == 2
    dev, rng = env.device(64)
    env.runtime.unregister([host.mapping()])  # A closes
    assert env.runtime.registered() == [host.mapping()]
    if env.fake is not None:
        assert env.fake.is_registered(host.ptr)
    env.runtime.copy_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], device_ranges=[rng])
    env.runtime.unregister([host.mapping()])  # B closes
    assert env.runtime.registered() == [] and env.runtime.users(host.mapping()) == 0
    if env.fake is not None:
        assert not env.fake.is_registered(host.ptr)
    env.runtime.unregister([host.mapping()])  # unknown now: ignored
    with pytest.raises(TransferError):
        env.runtime.copy_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], device_ranges=[rng])


def test_a_new_generation_is_a_new_registration(env):
    host = HostBuffer(64)
    old = host.mapping()
    new = attrs.evolve(old, generation=old.generation + 1)
    env.runtime.register([old])
    env.runtime.register([new])
    assert env.runtime.users(old) == env.runtime.users(new) == 1
    env.runtime.unregister([old])
    assert env.runtime.registered() == [new]


def test_concurrent_registers_make_one_registration(env):
    import threading

    host = HostBuffer(4096)
    calls = []
    real = env.runtime._register_one
    entered = threading.Event()

    def slow_register_one(mapping):
        calls.append(mapping)
        entered.set()
        time.sleep(0.05)
        return real(mapping)

    env.runtime._register_one = slow_register_one
    threads = [threading.Thread(target=env.runtime.register, args=([host.mapping()],)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and env.runtime.users(host.mapping()) == 8
    for _ in range(7):
        env.runtime.unregister([host.mapping()])
    assert env.runtime.registered() == [host.mapping()]
    env.runtime.unregister([host.mapping()])
    assert env.runtime.registered() == []


def test_d2h_then_h2d_round_trip(env):
    host = HostBuffer(256)
    env.runtime.register([host.mapping()])
    src, src_range = env.device(64, fill=7)
    src[:] = torch.arange(64, dtype=torch.uint8)
    env.runtime.copy_batch([CopyDescriptor(host.ptr + 128, src.data_ptr(), 64, D2H)], device_ranges=[src_range])
    assert host.read(128, 64) == bytes(range(64))
    dst, dst_range = env.device(64)
    env.runtime.copy_batch([CopyDescriptor(dst.data_ptr(), host.ptr + 128, 64, H2D)], device_ranges=[dst_range])
    assert bytes(dst.tolist()) == bytes(range(64))
    stats = env.runtime.stats
    assert (stats.d2h.bytes, stats.h2d.bytes, stats.batches) == (64, 64, 2)
    assert stats.d2h.copies == stats.h2d.copies == 1


def test_h2h_between_mappings(env):
    a, b = HostBuffer(64, fill=3), HostBuffer(64)
    env.runtime.register([a.mapping(), b.mapping()])
    env.runtime.copy_batch([CopyDescriptor(b.ptr, a.ptr, 64, H2H)])
    assert b.read() == bytes([3]) * 64


def test_empty_batch_is_a_no_op(env):
    env.runtime.copy_batch([])
    assert env.runtime.stats.batches == 0


def _assert_nothing_submitted(env, host: HostBuffer, before: bytes):
    assert host.read() == before
    if env.fake is not None:
        assert not env.fake.calls_named("cudaMemcpyAsync") and not env.fake.calls_named("cudaMemcpyBatchAsync")


@pytest.mark.parametrize(
    "case",
    ["src_outside_mapping", "undeclared_device", "readonly_dst", "wrong_direction", "overlapping_dsts", "past_mapping_end"],
)
def test_whole_batch_validated_before_any_submission(env, case):
    host = HostBuffer(256)
    ro = HostBuffer(64)
    env.runtime.register([host.mapping(), ro.mapping(writable=False)])
    dev, dev_range = env.device(64, fill=9)
    good = CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)
    other = HostBuffer(64)
    bad = {
        "src_outside_mapping": CopyDescriptor(dev.data_ptr(), other.ptr, 64, H2D),
        "undeclared_device": CopyDescriptor(host.ptr + 64, other.ptr, 64, D2H),
        "readonly_dst": CopyDescriptor(ro.ptr, dev.data_ptr(), 64, D2H),
        "wrong_direction": CopyDescriptor(host.ptr + 64, dev.data_ptr(), 64, H2D),
        "overlapping_dsts": CopyDescriptor(host.ptr + 32, dev.data_ptr(), 32, D2H),
        "past_mapping_end": CopyDescriptor(host.ptr + 224, dev.data_ptr(), 64, D2H),
    }[case]
    before = host.read()
    with pytest.raises(TransferError, match="nothing of the batch was submitted"):
        env.runtime.copy_batch([good, bad], device_ranges=[dev_range])
    _assert_nothing_submitted(env, host, before)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_descriptor_needs_positive_size(nbytes):
    with pytest.raises(ValueError):
        CopyDescriptor(0x1000, 0x2000, nbytes, D2H)


def test_descriptor_is_immutable():
    d = CopyDescriptor(0x1000, 0x2000, 8, "d2h")
    assert d.direction is D2H
    with pytest.raises(AttributeError):
        d.nbytes = 4  # type: ignore[misc]


def test_unregistered_mapping_no_longer_accepted(env):
    host = HostBuffer(64)
    env.runtime.register([host.mapping()])
    dev, rng = env.device(64)
    env.runtime.unregister([host.mapping()])
    with pytest.raises(TransferError):
        env.runtime.copy_batch([CopyDescriptor(host.ptr, dev.data_ptr(), 64, D2H)], device_ranges=[rng])


def test_device_range_rejects_strided_and_foreign_tensors(env):
    t = torch.zeros(4, 4)
    with pytest.raises(TransferError, match="contiguous"):
        env.runtime.device_range(t.t())
    meta = torch.zeros(4, device="meta")
    with pytest.raises(TransferError, match="tensor on"):
        env.runtime.device_range(meta)


def test_close_is_idempotent_and_use_after_close_raises(env):
    host = HostBuffer(64)
    env.runtime.register([host.mapping()])
    env.runtime.close()
    env.runtime.close()
    assert env.runtime.registered() == []
    with pytest.raises(TransferError, match="after close"):
        env.runtime.register([host.mapping()])


def test_registry_entries():
    assert TRANSFERS.get("host") is HostTransferRuntime
    assert TRANSFERS.get("cuda") is CudaTransferRuntime
    assert isinstance(auto_transfer_runtime("cpu"), HostTransferRuntime)
    assert TRANSFERS.get("auto") is auto_transfer_runtime


def test_import_needs_no_torch():
    import subprocess
    import sys

    code = "import sys, cacheseek.transfer, cacheseek.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
