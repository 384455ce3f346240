"""The ``interactive`` workload: live sessions streaming one action per chunk along a Zipf-popular
action tree restore the cached chunks of their path mid-session and compute the rest; every
session's frames equal a cold run of its actions. The verdict can fail: a store that hands back
one wrong byte makes the run FAIL."""

from __future__ import annotations

import json

import pytest

from cacheseek.cli import run
from cacheseek.registry import WORKLOADS
from cacheseek.workloads.interactive import InteractiveWorkload

from prodkit import OffByOneStore

RING = ["runtime.local_attn_size=7", "runtime.sink_size=3"]


def test_interactive_is_registered_with_its_yaml():
    assert WORKLOADS.get("interactive") is InteractiveWorkload


@pytest.mark.parametrize("store", ["memory", "fluxon_plan", "localdisk"])
def test_live_sessions_restore_their_cached_path_and_match_a_cold_run(compose_cfg, tmp_path, store):
    extra = {"localdisk": [f"store.root={tmp_path / 'kv'}"], "fluxon_plan": [], "memory": []}[store]
    results = run(compose_cfg("workload=interactive", f"+store={store}", *extra, *RING), tmp_path)
    f = results["interactive"]
    assert results["passed"] and f["mismatches"] == 0 and f["errors"] == []
    assert all(r["verdict"] == "ok" for r in results["requests"]) and f["sessions"] == 12
    m = results["metrics"]
    assert m["live_hits"] == f["chunks_restored"] > 0 and m["live_restore_failures"] == 0
    assert sum(m["live_hits_by_chunk"].values()) == m["live_hits"] == m["hits"]  # nothing planned: every hit is live
    assert m["lookups"] == m["live_lookups"] == f["chunks_total"] and m["prefix_lookups"] == 0  # a live restore is a lookup
    assert f["chunks_restored"] == sum(r["hit_depth"] for r in results["requests"])
    # the first session computes; the same path again restores every chunk
    assert results["requests"][0]["hit_depth"] == 0
    assert (tmp_path / "interactive.png").exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["interactive"]["live_hits_by_chunk"] == {str(k): v for k, v in m["live_hits_by_chunk"].items()}


def test_interactive_fails_when_a_restored_chunk_is_wrong(compose_cfg, tmp_path):
    results = run(compose_cfg("workload=interactive", *RING), tmp_path, store=OffByOneStore())
    assert not results["passed"] and results["interactive"]["mismatches"] > 0


@pytest.mark.telefuser
def test_interactive_on_telefusers_real_pipeline(compose_cfg, tmp_path):
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    results = run(compose_cfg("workload=interactive", "runtime=telefuser", "workload.sessions=6", *RING), tmp_path)
    assert results["passed"] and results["interactive"]["chunks_restored"] > 0
    assert results["metrics"]["hook_failures"] == 0 and results["metrics"]["chunks_unkeyed"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("store", ["memory", "fluxon_plan", "hbm", "tiered"])
def test_live_sessions_on_a_gpu(compose_cfg, tmp_path, store):
    """On CUDA: the ring, the staging buffers and the controls on the device; the Plan tier's H2D
    and the HBM tier's D2D restores of one chunk; CUDA controls keyed off the request path."""
    import importlib.util

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("needs CUDA and cuda-bindings")
    extra = {"tiered": ["store.tiers=[hbm,fluxon_plan]"], "hbm": ["store.capacity_bytes=16777216"]}.get(store, [])
    results = run(compose_cfg("workload=interactive", f"+store={store}", *extra, "runtime.device=cuda", *RING),
                  tmp_path)
    assert results["passed"] and results["interactive"]["chunks_restored"] > 0
    assert results["metrics"]["live_restore_failures"] == 0 and results["metrics"]["hook_failures"] == 0
