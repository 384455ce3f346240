"""The HBM tier and the tiered store on a real GPU: the pool is CUDA memory, every HBM copy is
D2D through the real CUDA runtime, restores from HBM and from the Plan tier below equal a cold
ring byte for byte, promotion and demotion move real device and host memory, and the A/B/C/D
gate passes through ``+store=tiered`` on ``runtime.device=cuda``."""

from __future__ import annotations


import pytest
import torch

from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.reuse.exact_prefix.keys import blob_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.stores.hbm import HbmTierStore
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.stores.tiered import TieredStore
from cacheseek.transfer.batch import Direction
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from plan_testkit import NEEDS_CUDA, RecordingTransfer, ingest, restore_target

pytestmark = NEEDS_CUDA

MiB = 1 << 20
ROLLING = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)


@pytest.fixture
def tiered():
    transfer = RecordingTransfer(CudaTransferRuntime())
    hbm = HbmTierStore(capacity_bytes=8 * MiB, transfer=transfer)
    plan = PlanTierStore(plan_client=EmbeddedPlanClient(segment_bytes=8 * MiB, backing="private"),
                         transfer=transfer, overlap=True)
    store = TieredStore(stores=[("hbm", hbm), ("fluxon_plan", plan)], transfer=transfer)
    yield store, hbm, plan, transfer
    store.close()
    hbm.close()
    plan.close()
    plan.plan_client.close()
    transfer.close()


def check(store, nodes, states, latents, kv_size, k) -> None:
    path = nodes[:k]
    window = [n for n in path if n.depth in ROLLING.window_depths(k)]
    target = restore_target(ROLLING, k, kv_size, dtype=torch.bfloat16, device="cuda")
    assert store.read_path(path, window, target) is True
    ring, local_end, _ = states[k - 1]
    for (kt, vt), (kr, vr) in zip(target.kv, ring):
        assert torch.equal(kt[:, :local_end], kr[:, :local_end]) and torch.equal(vt[:, :local_end], vr[:, :local_end])
    for got, want in zip(target.latents, latents):
        assert torch.equal(got.to(want.dtype), want)


def test_hbm_pool_is_cuda_memory_and_restores_are_d2d(tiered):
    store, hbm, plan, transfer = tiered
    assert hbm.device.type == "cuda" and hbm.values_on_device
    nodes, states, latents, kv_size = ingest(store, ROLLING, 5, dtype=torch.bfloat16, device="cuda")
    assert [store.levels_of(n.blob) for n in nodes] == [(0, 1)] * 5
    before = len(transfer.batches)
    for k in range(1, 6):
        check(store, nodes, states, latents, kv_size, k)
    assert {d.direction for b in transfer.batches[before:] for d in b} == {Direction.D2D}


def test_demote_then_restore_from_the_plan_tier_promotes_back(tiered):
    store, hbm, plan, transfer = tiered
    nodes, states, latents, kv_size = ingest(store, ROLLING, 5, dtype=torch.bfloat16, device="cuda")
    for n in reversed(nodes):
        assert store.demote(n.blob, 0)
    assert not any(hbm.contains(blob_keys(nodes[0].blob.locator, 2)))
    check(store, nodes, states, latents, kv_size, 5)  # from the Plan tier (H2D), promoted
    rows = {r["name"]: r for r in store.stats.as_dict()["tiers"]}
    assert rows["fluxon_plan"]["hits"] == 1 and rows["hbm"]["promotions"] == 3
    check(store, nodes, states, latents, kv_size, 5)  # from HBM again
    assert {r["name"]: r for r in store.stats.as_dict()["tiers"]}["hbm"]["hits"] == 1


def test_demotion_without_write_through_copies_device_to_host(tiered):
    store, hbm, plan, transfer = tiered
    store.write_through = False
    nodes, states, latents, kv_size = ingest(store, ROLLING, 3, dtype=torch.bfloat16, device="cuda")
    assert [store.levels_of(n.blob) for n in nodes] == [(0,)] * 3
    for n in reversed(nodes):
        assert store.demote(n.blob, 0)
    assert [store.levels_of(n.blob) for n in nodes] == [(1,)] * 3
    check(store, nodes, states, latents, kv_size, 3)


def test_gate_through_the_cli_task_on_cuda(compose_cfg, tmp_path):
    from cacheseek.cli import run

    cfg = compose_cfg("+store=tiered", "runtime.device=cuda", "store.hbm.capacity_bytes=16777216",
                      "store.fluxon_plan.segment_bytes=16777216", "runtime.local_attn_size=7", "runtime.sink_size=3",
                      "workload.total_chunks=5", "workload.prefix_chunks=2", "workload.ring_check=true")
    results = run(cfg, tmp_path / "run")
    assert results["passed"] is True
    tiers = results["metrics"]["tiers"]
    assert tiers[0]["name"] == "hbm" and tiers[0]["hits"] >= 1
