"""The HBM tier: the Plan tier's mechanism over a device-memory pool (CPU tensors here, on the host
runtime and on the CUDA runtime over the fake cudart): every copy D2D, nothing registered, the
ring restored byte for byte, the pool's capacity enforced, values copied between Plan-style stores
in one batch with publication last."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError, PlanError, StoreFullError
from cacheseek.plan.device import DevicePlanClient, device_pool_bytes
from cacheseek.reuse.exact_prefix.keys import blob_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.hbm import HbmTierStore
from cacheseek.transfer.batch import Direction
from plan_testkit import ingest, restore_target

FULL = RingGeometry(chunk_size=3, frame_tokens=2)
ROLLING = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)


def test_pool_size_in_bytes_or_as_a_fraction_of_free_memory():
    assert device_pool_bytes(4096, 0.0, torch.device("cpu")) == 4096
    frac = device_pool_bytes(0, 0.001, torch.device("cpu"))
    assert 0 < frac
    with pytest.raises(ConfigError, match="store.capacity_fraction"):
        device_pool_bytes(4096, 0.5, torch.device("cpu"))  # both given
    with pytest.raises(ConfigError, match="store.capacity_bytes"):
        device_pool_bytes(0, 0.0, torch.device("cpu"))  # neither
    with pytest.raises(ConfigError, match="store.capacity_fraction"):
        device_pool_bytes(0, 1.5, torch.device("cpu"))
    with pytest.raises(ConfigError, match="store.capacity_bytes"):
        device_pool_bytes(-1, 0.0, torch.device("cpu"))


def test_the_pool_is_a_device_range_never_registered(levels, transfer_kind):
    (hbm,), parts = levels(transfer_kind, ["hbm"], tiered=False)
    seg = hbm.plan_client.wait_local_segments_ready()
    assert [s.on_device for s in seg] == [True]
    assert hbm.values_on_device and hbm.transfer.registered() == []
    assert isinstance(hbm.plan_client, DevicePlanClient) and hbm.device == torch.device("cpu")


@pytest.mark.parametrize("geom", [FULL, ROLLING], ids=["full", "rolling"])
def test_restore_from_hbm_equals_a_cold_ring_and_every_copy_is_d2d(levels, transfer_kind, geom):
    (hbm,), parts = levels(transfer_kind, ["hbm"], tiered=False)
    n = 5
    nodes, states, latents, kv_size = ingest(hbm, geom, n)
    assert all(node.blob.ready and node.blob.tier is Tier.FLUXON_DRAM for node in nodes)
    for k in range(1, n + 1):
        path = nodes[:k]
        window = [nd for nd in path if nd.depth in geom.window_depths(k)]
        target = restore_target(geom, k, kv_size)
        assert hbm.read_path(path, window, target) is True
        ring, local_end, _ = states[k - 1]
        for (k_t, v_t), (k_ref, v_ref) in zip(target.kv, ring):
            assert torch.equal(k_t[:, :local_end], k_ref[:, :local_end])
            assert torch.equal(v_t[:, :local_end], v_ref[:, :local_end])
        for got, want in zip(target.latents, latents):
            assert torch.equal(got, want)
    directions = {d.direction for batch in parts["transfer"].batches for d in batch}
    assert directions == {Direction.D2D}
    assert hbm.plan_client.live_handles() == (0, 0)


def test_the_pool_is_bounded_and_free_gives_room_back(levels):
    (hbm,), _ = levels("host", ["hbm"], hbm_bytes=4096, tiered=False)
    payload = [(torch.ones(1, 6, 2, 4), torch.ones(1, 6, 2, 4))] * 2  # 4 values of 192 B
    handles = []
    with pytest.raises(StoreFullError):
        for i in range(100):
            handles.append(hbm.put_async(f"{i:02x}:kv", payload, tier=Tier.HBM_STAGING))
    u = hbm.usage()
    assert u.capacity_bytes == 4096 and u.used_bytes <= 4096 and len(handles) >= 4
    hbm.free(handles[0])
    assert hbm.put_async("ff:kv", payload, tier=Tier.HBM_STAGING).ready


def test_raw_reads_of_device_values_come_back_as_bytes(levels):
    (hbm,), _ = levels("host", ["hbm"], tiered=False)
    k, v = torch.arange(48, dtype=torch.float32).reshape(1, 6, 2, 4), torch.full((1, 6, 2, 4), 7.0)
    handle = hbm.put_async("aa:kv", [(k, v)], tier=Tier.HBM_STAGING)
    hbm.put_skeleton("aa:lat", torch.full((1, 4, 3, 2, 2), 3.0))
    raw_k, raw_v = hbm.get_layer(handle, 0)
    assert raw_k == k.numpy().tobytes() and raw_v == v.numpy().tobytes()
    assert hbm.get_skeleton("aa:lat") == torch.full((1, 4, 3, 2, 2), 3.0).numpy().tobytes()


@pytest.mark.parametrize("direction", ["promote", "demote"])
def test_values_move_between_plan_stores_in_one_batch(levels, transfer_kind, direction):
    (hbm, plan), parts = levels(transfer_kind, ["hbm", "fluxon_plan"], tiered=False)
    src, dst = (plan, hbm) if direction == "promote" else (hbm, plan)
    nodes, states, latents, kv_size = ingest(src, FULL, 2)
    keys = blob_keys(nodes[1].blob.locator, 2) + [nodes[1].skeleton.latent_locator]
    before = len(parts["transfer"].batches)
    moved = dst.copy_values_from(src, keys)
    assert moved == nodes[1].blob.nbytes + latents[1].numel() * 4
    batches = parts["transfer"].batches[before:]
    assert len(batches) == 1
    want = Direction.H2D if direction == "promote" else Direction.D2H
    assert {d.direction for d in batches[0]} == {want}
    target = restore_target(FULL, 2, kv_size)
    # the copy alone cannot serve depth 2 (node 0 is not there): a miss, then the whole path
    assert dst.read_path(nodes, nodes, target) is False
    dst.copy_values_from(src, blob_keys(nodes[0].blob.locator, 2) + [nodes[0].skeleton.latent_locator])
    assert dst.read_path(nodes, nodes, target) is True
    ring, local_end, _ = states[1]
    assert all(torch.equal(a[:, :local_end], b[:, :local_end]) for pa, pb in zip(target.kv, ring) for a, b in zip(pa, pb))


def test_a_copy_is_all_or_nothing(levels):
    (hbm, plan), parts = levels("host", ["hbm", "fluxon_plan"], tiered=False)
    nodes, *_ = ingest(plan, FULL, 1)
    keys = blob_keys(nodes[0].blob.locator, 2)
    used = hbm.usage().used_bytes
    assert hbm.copy_values_from(plan, keys + ["missing:lat"]) is None
    assert hbm.usage().used_bytes == used and hbm.contains(keys) == [False] * len(keys)
    parts["hbm_faults"].arm("commit_status")
    with pytest.raises(PlanError):
        hbm.copy_values_from(plan, keys)
    assert hbm.contains(keys) == [False] * len(keys) and hbm.usage().used_bytes == used
    assert hbm.plan_client.live_handles() == (0, 0) and parts["plan_client"].live_handles() == (0, 0)


def test_hbm_store_composes_from_hydra(compose_cfg, tmp_path):
    from cacheseek.orchestrator import build_stack

    cfg = compose_cfg("+store=hbm", "store.capacity_bytes=0", "store.capacity_fraction=0.001")
    stack = build_stack(cfg, run_dir=tmp_path)
    try:
        assert isinstance(stack.store, HbmTierStore)
        assert stack.store.usage().capacity_bytes > 0
        assert stack.store.transfer is stack.transfer
    finally:
        stack.close()
    with pytest.raises(Exception, match="capcity"):
        compose_cfg("+store=hbm", "store.capcity_bytes=1")
