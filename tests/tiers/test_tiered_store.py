"""The tiered store: write-through, a full top tier skipped, hits served by the nearest tier and
promoted (from the ring or from the tier below), demotion (with and without a copy below, and
when the tier below fails: nothing lost), free across tiers, blobs known only from a snapshot,
and the manager's per-tier demotion passes (leaf-first within a tier) with metrics per tier."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from cacheseek.errors import StoreError, WriteNotCompleteError
from cacheseek.reuse.exact_prefix.keys import blob_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.reuse.exact_prefix.types import BlobHandle, Skeleton, Tier, TrieNode
from cacheseek.stores.tiered import TieredHandle, TieredStore
from cacheseek.transfer.batch import Direction
from plan_testkit import ingest, latent_levels, restore_target

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "production"))
from prodkit import cold_hashes, new_manager, run_session  # noqa: E402

FULL = RingGeometry(chunk_size=3, frame_tokens=2)
ROLLING = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)
CHUNK = 4 * 256  # tiny test chunk: 2 layers x K,V of 192 B, in 256 B blocks
LATENT = 256


def window(geom, nodes, k):
    return nodes[:k], [n for n in nodes[:k] if n.depth in geom.window_depths(k)]


def restore(store, geom, nodes, states, latents, kv_size, k) -> bool:
    path, win = window(geom, nodes, k)
    target = restore_target(geom, k, kv_size)
    if not store.read_path(path, win, target):
        return False
    ring, local_end, _ = states[k - 1]
    for (kt, vt), (kr, vr) in zip(target.kv, ring):
        assert torch.equal(kt[:, :local_end], kr[:, :local_end]) and torch.equal(vt[:, :local_end], vr[:, :local_end])
    for got, want in zip(target.latents, latents):
        assert torch.equal(got, want)
    return True


def tier_row(store, name):
    return next(r for r in store.stats.as_dict()["tiers"] if r["name"] == name)


def test_write_through_lands_in_every_tier(levels, transfer_kind):
    store, parts = levels(transfer_kind)
    nodes, *_ = ingest(store, FULL, 3)
    for n in nodes:
        assert isinstance(n.blob, TieredHandle) and n.blob.ready
        assert store.levels_of(n.blob) == (0, 1)
        assert n.blob.tier is Tier.HBM_STAGING and n.blob.tiers == (Tier.HBM_STAGING, Tier.FLUXON_DRAM)
        keys = blob_keys(n.blob.locator, 2)
        assert all(parts["hbm"].contains(keys)) and all(parts["fluxon_plan"].contains(keys))
        assert latent_levels(store, n.skeleton.latent_locator) == (0, 1)
    assert [u.blobs for u in store.tier_usages()] == [3, 3]
    assert [u.usage.used_bytes for u in store.tier_usages()] == [3 * (CHUNK + LATENT)] * 2


def test_without_write_through_only_the_first_tier_takes_the_kv(levels):
    store, parts = levels("host", write_through=False)
    nodes, *_ = ingest(store, FULL, 2)
    assert [store.levels_of(n.blob) for n in nodes] == [(0,), (0,)]
    assert parts["fluxon_plan"].contains(blob_keys(nodes[0].blob.locator, 2)) == [False] * 4


def test_a_full_top_tier_is_skipped_and_the_write_lands_below(levels):
    store, parts = levels("host", hbm_bytes=2048)
    nodes, states, latents, kv_size = ingest(store, FULL, 2)
    assert store.levels_of(nodes[0].blob) == (0, 1) and store.levels_of(nodes[1].blob) == (1,)
    assert nodes[1].blob.ready and nodes[1].blob.tier is Tier.FLUXON_DRAM
    assert tier_row(store, "hbm")["full_skips"] == 1
    assert latent_levels(store, nodes[1].skeleton.latent_locator) == (1,)  # HBM keeps no latent of it
    assert restore(store, FULL, nodes, states, latents, kv_size, 2)  # from the Plan tier
    assert tier_row(store, "fluxon_plan")["hits"] == 1


def test_a_hit_from_the_tier_below_is_promoted_from_the_ring(levels, transfer_kind):
    store, parts = levels(transfer_kind)
    nodes, states, latents, kv_size = ingest(store, FULL, 3)
    for n in reversed(nodes):
        assert store.demote(n.blob, 0) is True
    assert [store.levels_of(n.blob) for n in nodes] == [(1,)] * 3
    assert parts["hbm"].usage().used_bytes == 0  # a demoted chunk's latent leaves the tier with it
    assert [latent_levels(store, n.skeleton.latent_locator) for n in nodes] == [(1,)] * 3
    rec = parts["transfer"]
    before = len(rec.batches)
    assert restore(store, FULL, nodes, states, latents, kv_size, 3)
    served = {d.direction for b in rec.batches[before : before + 1] for d in b}  # a read is one batch
    promoted = {d.direction for b in rec.batches[before + 1 :] for d in b}
    assert served == {Direction.H2D} and promoted == {Direction.D2D}  # one read of the Plan tier only
    assert [store.levels_of(n.blob) for n in nodes] == [(0, 1)] * 3
    hbm = tier_row(store, "hbm")
    assert (hbm["promotions"], hbm["promotions_from_ring"], tier_row(store, "fluxon_plan")["hits"]) == (3, 3, 1)
    before = len(rec.batches)
    assert restore(store, FULL, nodes, states, latents, kv_size, 3)
    assert tier_row(store, "hbm")["hits"] == 1
    assert {d.direction for b in rec.batches[before:] for d in b} == {Direction.D2D}


def test_chunks_partly_in_a_rolled_ring_are_promoted_from_the_tier_below(levels, transfer_kind):
    store, parts = levels(transfer_kind)
    nodes, states, latents, kv_size = ingest(store, ROLLING, 4)
    for n in reversed(nodes):
        store.demote(n.blob, 0)
    assert restore(store, ROLLING, nodes, states, latents, kv_size, 4)  # window: chunks 0, 2 (1 frame), 3
    hbm = tier_row(store, "hbm")
    assert (hbm["promotions_from_ring"], hbm["promotions_from_tier"]) == (2, 1)
    assert store.levels_of(nodes[1].blob) == (1,)  # not in the window: not promoted
    assert restore(store, ROLLING, nodes, states, latents, kv_size, 4)
    assert tier_row(store, "hbm")["hits"] == 1


def test_a_generic_tier_below_serves_and_promotes(levels):
    store, parts = levels("host", ("hbm", "memory"))
    nodes, states, latents, kv_size = ingest(store, ROLLING, 5)
    assert store.levels_of(nodes[0].blob) == (0, 1)
    for n in reversed(nodes):
        store.demote(n.blob, 0)
    assert restore(store, ROLLING, nodes, states, latents, kv_size, 5)
    assert tier_row(store, "memory")["hits"] == 1 and tier_row(store, "hbm")["promotions"] == 3
    assert restore(store, ROLLING, nodes, states, latents, kv_size, 5)
    assert tier_row(store, "hbm")["hits"] == 1


def test_demotion_writes_a_copy_below_when_there_is_none(levels, transfer_kind):
    store, parts = levels(transfer_kind, write_through=False)
    nodes, states, latents, kv_size = ingest(store, FULL, 2)
    assert store.demote(nodes[1].blob, 0) is True
    assert store.levels_of(nodes[1].blob) == (1,) and nodes[1].blob.tier is Tier.FLUXON_DRAM
    assert all(parts["fluxon_plan"].contains(blob_keys(nodes[1].blob.locator, 2)))
    assert not any(parts["hbm"].contains(blob_keys(nodes[1].blob.locator, 2)))
    assert tier_row(store, "fluxon_plan")["demoted_in"] == 1
    assert store.demote(nodes[0].blob, 0) is True
    assert restore(store, FULL, nodes, states, latents, kv_size, 2)


def test_demotion_loses_nothing_when_the_tier_below_fails(levels, transfer_kind):
    store, parts = levels(transfer_kind, write_through=False)
    nodes, states, latents, kv_size = ingest(store, FULL, 2)
    parts["plan_faults"].arm("put_start", times=5)
    assert store.demote(nodes[1].blob, 0) is False
    assert store.levels_of(nodes[1].blob) == (0,) and nodes[1].blob.ready
    assert all(parts["hbm"].contains(blob_keys(nodes[1].blob.locator, 2)))
    assert tier_row(store, "hbm")["demotion_failures"] == 1
    assert parts["plan_client"].live_handles() == (0, 0) and parts["plan_client"].usage().n_values == 2  # latents only
    assert restore(store, FULL, nodes, states, latents, kv_size, 2)
    assert store.demote(nodes[1].blob, 1) is False  # not held there


def test_the_last_tier_only_copy_is_not_demoted(levels):
    store, _ = levels("host")
    nodes, *_ = ingest(store, FULL, 1)
    assert store.demote(nodes[0].blob, 0) is True
    assert store.demote(nodes[0].blob, 1) is False and store.levels_of(nodes[0].blob) == (1,)


def test_a_failed_write_through_leaves_the_copy_above(levels):
    store, parts = levels("host")
    parts["plan_faults"].arm("commit_status", nth=2)  # the latent's commit goes through, the KV's fails
    nodes, states, latents, kv_size = ingest(store, FULL, 1)
    assert nodes[0].blob.ready and store.levels_of(nodes[0].blob) == (0,)
    assert tier_row(store, "fluxon_plan")["write_failures"] == 1
    assert not any(parts["fluxon_plan"].contains(blob_keys(nodes[0].blob.locator, 2)))
    assert restore(store, FULL, nodes, states, latents, kv_size, 1)


def test_every_tier_refusing_a_write_raises_and_records_nothing(levels):
    store, parts = levels("host")
    parts["plan_faults"].arm("put_start")
    parts["hbm_faults"].arm("put_start")
    payload = [(torch.ones(1, 6, 2, 4), torch.ones(1, 6, 2, 4))] * 2
    with pytest.raises(StoreError, match="every tier refused"):
        store.put_async("ab:kv", payload, tier=Tier.HBM_STAGING)
    assert store.tier_usages()[0].blobs == 0 and store.contains(blob_keys("ab:kv", 2)) == [False] * 4


def test_free_removes_every_copy_and_a_failed_level_keeps_its_own(levels):
    store, parts = levels("host")
    nodes, *_ = ingest(store, FULL, 2)
    store.free(nodes[0].blob)
    assert store.contains(blob_keys(nodes[0].blob.locator, 2)) == [False] * 4
    parts["plan_faults"].arm("remove")
    with pytest.raises(StoreError):
        store.free(nodes[1].blob)
    assert store.levels_of(nodes[1].blob) == (1,)  # the HBM copy is gone, the Plan one kept
    store.free(nodes[1].blob)
    assert store.levels_of(nodes[1].blob) == () and store.tier_usages()[1].blobs == 0


def test_free_refuses_a_write_in_flight(levels):
    store, _ = levels("host")
    handle = BlobHandle(Tier.CPU, "cd:kv", 8, 1)
    with pytest.raises(WriteNotCompleteError):
        store.free(handle)


def test_blobs_known_from_a_snapshot_are_located_in_their_tiers(levels):
    store, parts = levels("host")
    nodes, states, latents, kv_size = ingest(store, FULL, 2)
    store.demote(nodes[1].blob, 0)
    fresh = TieredStore(stores=[("hbm", parts["hbm"]), ("fluxon_plan", parts["fluxon_plan"])],
                        transfer=parts["transfer"])
    plain = []
    parent = None
    for n in nodes:  # what load_snapshot builds: plain ready handles
        h = BlobHandle(Tier.DISK, n.blob.locator, n.blob.nbytes, n.blob.n_layers, ready=True)
        parent = TrieNode(n.node_key, n.action, n.depth, parent, skeleton=Skeleton(n.skeleton.latent_locator), blob=h)
        plain.append(parent)
    assert fresh.levels_of(plain[0].blob) == (0, 1) and fresh.levels_of(plain[1].blob) == (1,)
    assert plain[0].blob.tier is Tier.HBM_STAGING
    assert restore(fresh, FULL, plain, states, latents, kv_size, 2)
    assert tier_row(fresh, "fluxon_plan")["hits"] == 1 and fresh.levels_of(plain[1].blob) == (0, 1)


def test_the_manager_demotes_leaf_first_within_the_top_tier(levels):
    # room for 3 chunks and their latents in HBM (4096 B); 5 chunks of one session
    store, parts = levels("host", hbm_bytes=4096, plan_bytes=1 << 20)
    mgr = new_manager(store)
    _, _, hashes = run_session(mgr)
    assert hashes == cold_hashes()
    chain = sorted((n for ns in mgr.forest.namespaces() for n in ns.iter_nodes()), key=lambda n: n.depth)
    held = [store.levels_of(n.blob) for n in chain]
    assert all(1 in h for h in held)  # every chunk kept below
    in_hbm = [n.depth for n, h in zip(chain, held) if 0 in h]
    assert in_hbm == list(range(len(in_hbm))) and 0 < len(in_hbm) < 5  # a prefix, deepest demoted
    u = store.tier_usages()[0].usage
    assert u.used_bytes <= mgr.eviction.high_watermark * u.capacity_bytes
    m = mgr.metrics.as_dict()
    assert m["demotions"] >= 1 and m["demotion_passes"] >= 1 and m["evictions"] == 0
    assert [t["name"] for t in m["tiers"]] == ["hbm", "fluxon_plan"]
    assert m["tiers"][0]["capacity_bytes"] == 4096 and m["tiers"][0]["blobs"] == len(in_hbm)
    b, _, hashes = run_session(mgr)  # a full hit: from the Plan tier (HBM lacks the window), promoted
    assert b.last_fast_forward == 5 and hashes == cold_hashes()
    assert tier_row(store, "fluxon_plan")["hits"] == 1


def test_the_gate_through_the_cli_task(compose_cfg, tmp_path):
    from cacheseek.cli import run

    cfg = compose_cfg("+store=tiered", "store.tiers=[hbm,fluxon_plan,localdisk]",
                      "store.hbm.capacity_bytes=65536", "store.fluxon_plan.segment_bytes=1048576",
                      "runtime.local_attn_size=7", "runtime.sink_size=3", "workload.total_chunks=5",
                      "workload.prefix_chunks=2", "workload.ring_check=true")
    results = run(cfg, tmp_path / "run")
    assert results["passed"] is True and results["store"] == "tiered"
    assert [r["hit_depth"] for r in results["requests"]] == [0, 5, 2, 0]
    tiers = results["metrics"]["tiers"]
    assert [t["name"] for t in tiers] == ["hbm", "fluxon_plan", "localdisk"]
    assert tiers[0]["hits"] >= 1 and all(t["blobs"] == tiers[0]["blobs"] for t in tiers)
    assert (tmp_path / "run" / "kvstore" / "localdisk").is_dir()


def test_unknown_or_repeated_tiers_are_config_errors(compose_cfg, tmp_path):
    from cacheseek.errors import ConfigError
    from cacheseek.orchestrator import build_stack

    for tiers, field in (("[hbm,nope]", "store.tiers"), ("[hbm,hbm]", "store.tiers"), ("[]", "store.tiers")):
        with pytest.raises(ConfigError, match=field):
            build_stack(compose_cfg("+store=tiered", f"store.tiers={tiers}"), run_dir=tmp_path)


def test_the_storage_format_is_the_levels_when_they_agree(levels):
    same, _ = levels("host")
    assert same.storage_format == "cacheseek.plan.raw.v1"
    mixed, _ = levels("host", ("hbm", "memory"))
    assert mixed.storage_format == "cacheseek.tiered.v1[hbm=cacheseek.plan.raw.v1,memory=cacheseek.tier.objects.v1]"
