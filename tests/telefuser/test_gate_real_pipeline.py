"""The A/B/C/D gate and the per-depth ring check on TeleFuser's real LingBot-World-fast loop.

Every ring mode (full length; rolling 7/3 that rolls, 6/0, 5/1 whose sink is not a whole chunk)
on every store (memory, localdisk, the Plan tier): A cold; B restores every chunk and decodes
bit-equal latents; C restores |P| and equals the cold D; before every chunk K the restored
``ring[:local_end]``, both cursors, the cached latents and the RNG state equal a cold run's.
"""

from __future__ import annotations

import pytest

from cacheseek.cli import run

# (local_attn_size, sink_size, total_chunks, prefix_chunks)
RINGS = {
    "full": (-1, 0, 4, 2),
    "rolling_L7_S3": (7, 3, 4, 2),  # rolls at chunk 3: K=1,2 before, K=3 after
    "rolling_L6_S0": (6, 0, 4, 2),  # rolls at chunk 3
    "rolling_L5_S1": (5, 1, 4, 2),  # the sink is one frame of a 3-frame chunk; rolls at chunk 2
}
STORES = {
    "memory": [],
    "localdisk": ["+store=localdisk"],
    "fluxon_plan": ["+store=fluxon_plan", "store.segment_bytes=67108864"],
}


@pytest.mark.parametrize("store", sorted(STORES))
@pytest.mark.parametrize("ring", sorted(RINGS))
def test_gate_on_the_real_pipeline(compose_cfg, tmp_path, ring, store):
    L, S, n, p = RINGS[ring]
    extra = list(STORES[store])
    if store == "localdisk":
        extra.append(f"store.root={tmp_path / 'kv'}")
    cfg = compose_cfg("runtime=telefuser", f"runtime.local_attn_size={L}", f"runtime.sink_size={S}",
                      f"workload.total_chunks={n}", f"workload.prefix_chunks={p}", *extra)
    results = run(cfg, tmp_path / "run")

    reqs = {r["name"]: r for r in results["requests"]}
    assert [reqs[x]["hit_depth"] for x in "ABCD"] == [0, n, p, 0]
    fh = results["frame_hashes"]
    assert fh["B"] == fh["A"] and fh["C"] == fh["D"] and fh["C"][:p] == fh["A"][:p]
    assert fh["C"][p:] != fh["A"][p:]  # Y really differs from X
    rows = results["ring_check"]
    assert [r["K"] for r in rows] == list(range(1, n))
    assert all(r["verdict"] == "ok" and r["diff"] == [] for r in rows), rows
    metrics = results["metrics"]
    assert metrics["hook_failures"] == 0 and metrics["restore_failures"] == 0
    assert results["passed"] is True
