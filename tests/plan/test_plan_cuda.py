"""The Plan data path on a real GPU: registration of real segments (incl. a read-only /dev/shm
mapping), and KV plus latent round trips through the Plan tier with the real CUDA runtime."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile

import pytest
import torch

from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.kv.ring import RingGeometry
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.batch import CopyDescriptor, Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.memory import HostMapping
from plan_testkit import NEEDS_CUDA, assert_restores_match, ingest, restore_target

pytestmark = NEEDS_CUDA

MiB = 1 << 20


@pytest.fixture
def runtime():
    rt = CudaTransferRuntime()
    yield rt
    rt.close()


def last_error_is_clear():
    from cuda.bindings import runtime as cudart

    return cudart.cudaGetLastError()[0] == cudart.cudaError_t.cudaSuccess


@pytest.mark.parametrize("backing", ["shared", "private", "shm"])
def test_register_real_segment_and_round_trip(runtime, backing):
    client = EmbeddedPlanClient(segment_bytes=64 * MiB, backing=backing)
    mappings = [HostMapping(m.ptr, m.length, m.generation, m.writable) for m in client.wait_local_segments_ready()]
    runtime.register(mappings)
    runtime.register(mappings)
    assert runtime.stats.n_registered == 1 and last_error_is_clear()
    seg = mappings[0]
    src = torch.arange(MiB, dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    n = src.numel() * 4
    runtime.copy_batch([CopyDescriptor(seg.ptr, src.data_ptr(), n, Direction.D2H)], device_ranges=[runtime.device_range(src)])
    runtime.copy_batch([CopyDescriptor(dst.data_ptr(), seg.ptr, n, Direction.H2D)], device_ranges=[runtime.device_range(dst)])
    assert torch.equal(src, dst)
    runtime.unregister(mappings)
    client.close()


def test_readonly_shm_mapping_registers_read_only(runtime):
    import numpy as np

    fd, path = tempfile.mkstemp(dir="/dev/shm")
    try:
        payload = np.arange(4 * MiB // 4, dtype=np.int32)
        os.write(fd, payload.tobytes())
        mm = mmap.mmap(fd, 4 * MiB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        mapping = HostMapping(int(view.ctypes.data), 4 * MiB, 1, writable=False)
        runtime.register([mapping])
        assert last_error_is_clear()
        dst = torch.zeros(MiB, dtype=torch.int32, device="cuda")
        runtime.copy_batch(
            [CopyDescriptor(dst.data_ptr(), mapping.ptr, 4 * MiB, Direction.H2D)], device_ranges=[runtime.device_range(dst)]
        )
        assert torch.equal(dst.cpu(), torch.from_numpy(payload))
        runtime.unregister([mapping])
        del view
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_and_latents_round_trip_through_the_plan_tier(side_stream, dtype):
    geom = RingGeometry(chunk_size=3, frame_tokens=4, local_attn_size=7, sink_size=3)
    store = PlanTierStore(segment_bytes=64 * MiB, device="cuda")  # overlapped writes (the CUDA default)
    assert isinstance(store.transfer, CudaTransferRuntime) and store.overlap
    ring_kw = dict(n_layers=3, heads=4, dim=16, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        nodes, states, latents, kv_size = ingest(store, geom, 5, **ring_kw)
        for k in (2, 3, 5):
            target = restore_target(geom, k, kv_size, **ring_kw)
            window = [nodes[d] for d in geom.window_depths(k)]
            assert store.read_path(nodes[:k], window, target)
            cold, local_end, _ = states[k - 1]
            for (rk, rv), (ck, cv) in zip(target.kv, cold):
                assert torch.equal(rk[:, :local_end], ck[:, :local_end])
                assert torch.equal(rv[:, :local_end], cv[:, :local_end])
            for got, want in zip(target.latents, latents[:k]):
                assert torch.equal(got, want)
    stats = store.stats
    assert stats.read_hits == 3 and stats.plans_committed > 0
    assert store.plan_client.live_handles() == (0, 0)
    store.free(nodes[0].blob)
    store.close()


def test_gate_sized_chunk_round_trip_bandwidth():
    """One chunk of 8 layers of 4680-token K/V at 40x128 bf16 (48 MB values): printed figures."""
    import time

    layers, tokens, heads, dim = 8, 4680, 40, 128
    store = PlanTierStore(segment_bytes=1 << 30, device="cuda", overlap=False)  # put_async returns committed
    ring = [tuple(torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)) for _ in range(layers)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    handle = store.put_async("bw:kv", ring, tier=Tier.FLUXON_DRAM)
    put_s = time.perf_counter() - t0
    out = [tuple(torch.empty_like(t) for t in pair) for pair in ring]
    t0 = time.perf_counter()
    for layer in range(layers):
        out[layer] = store.get_layer(handle, layer, like=ring[layer])
    get_s = time.perf_counter() - t0
    assert all(torch.equal(a, b) for pa, pb in zip(ring, out) for a, b in zip(pa, pb))
    gib = handle.nbytes / 2**30
    print(f"\nPlan tier put {gib:.2f} GiB in {put_s:.3f} s ({gib / put_s:.1f} GiB/s), "
          f"per-layer get {gib / get_s:.1f} GiB/s; stats {store.stats.as_dict()}")
    store.close()


def test_overlapped_write_survives_ring_overwrite_on_cuda():
    """The snapshot is taken on the producer stream before put_async returns; the D2H runs on the
    write stream while the producer keeps computing and overwrites the ring."""
    store = PlanTierStore(segment_bytes=256 * MiB, device="cuda", overlap=True)
    assert store.overlap
    ring = [tuple(torch.randn(1, 256, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)) for _ in range(4)]
    want = [tuple(t.clone() for t in pair) for pair in ring]
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(30):  # keep the producer stream busy: the snapshot is queued behind this
        x = torch.tanh(x @ x)
    handle = store.put_async("gov:kv", ring, tier=Tier.FLUXON_DRAM)
    for k, v in ring:  # the runtime writes the next chunk at once
        k.fill_(0)
        v.fill_(0)
    store.flush()
    assert handle.ready and handle.error is None
    for i, pair in enumerate(want):
        got = store.get_layer(handle, i, like=pair)
        assert torch.equal(got[0], pair[0]) and torch.equal(got[1], pair[1])
    stats = store.stats
    assert stats.puts == 1 and stats.pending_writes == 0 and stats.snapshot_bytes == handle.nbytes
    assert store.transfer.batch_api
    store.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_gate_on_cuda_with_the_plan_tier(compose_cfg, tmp_path, overlap):
    from cacheseek.cli import run

    cfg = compose_cfg("runtime.device=cuda", "runtime.geometry=small", "+store=fluxon_plan",
                      f"store.overlap={str(overlap).lower()}", "store.segment_bytes=268435456")
    results = run(cfg, tmp_path)
    assert results["passed"]
    assert results["store_stats"]["overlap"] is overlap and results["store_stats"]["put_failures"] == 0


@pytest.mark.parametrize("use_batch_api", [None, False])
def test_segment_registered_in_pieces_copies_over_the_joints(use_batch_api):
    """Each piece its own cudaHostRegister; copies spanning pieces are cut and land intact."""
    runtime = CudaTransferRuntime(use_batch_api=use_batch_api)
    client = EmbeddedPlanClient(segment_bytes=64 * MiB, backing="private")
    try:
        (seg,) = client.map_local_segments()
        mapping = HostMapping(seg.ptr, seg.length, seg.generation, seg.writable)
        runtime.register_in_pieces(mapping, 8 * MiB, before_piece=lambda p: client.fault_local_range(p.ptr, p.length))
        assert last_error_is_clear() and runtime.stats.registered_pieces == 8 and runtime.stats.n_registered == 1
        host = torch.frombuffer((ctypes.c_uint8 * seg.length).from_address(seg.ptr), dtype=torch.uint8)
        host.copy_(torch.randint(0, 256, (seg.length,), dtype=torch.uint8))
        n = 20 * MiB + 123  # from 1 MiB before the first joint (8 MiB), over three joints
        dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
        runtime.copy_batch([CopyDescriptor(dev.data_ptr(), seg.ptr + 7 * MiB, n, Direction.H2D)],
                           device_ranges=[runtime.device_range(dev)])
        assert torch.equal(dev.cpu(), host[7 * MiB: 7 * MiB + n])
        assert runtime.stats.h2d.copies == 4
        runtime.copy_batch([CopyDescriptor(seg.ptr + 31 * MiB + 5, dev.data_ptr(), n, Direction.D2H)],
                           device_ranges=[runtime.device_range(dev)])
        assert torch.equal(host[31 * MiB + 5: 31 * MiB + 5 + n], dev.cpu())
        assert last_error_is_clear()
        del host
        runtime.unregister([mapping])
        assert runtime.stats.registered_pieces == 0 and last_error_is_clear()
    finally:
        runtime.close()
        client.close()


@pytest.mark.parametrize("warmup", ["foreground", "background"])
def test_plan_tier_in_pieces_round_trips_on_cuda(warmup):
    geom = RingGeometry(chunk_size=3, frame_tokens=4, local_attn_size=7, sink_size=3)
    store = PlanTierStore(segment_bytes=32 * MiB, device="cuda", register_piece_bytes="2MiB", warmup=warmup)
    assert store.wait_ready(60) and store.stats.register_pieces == 16
    ring_kw = dict(n_layers=3, heads=32, dim=128, dtype=torch.bfloat16, device="cuda")  # 96 KiB values
    nodes, states, latents, kv_size = ingest(store, geom, 5, **ring_kw)
    assert_restores_match(store, geom, nodes, states, kv_size, (3, 5), **ring_kw)
    store.close()
