"""The gate report keeps its verdicts apart: a cache that stored nothing reads as that in one line
(not as a frame mismatch), a depth the ring check never restored is one line, diffs are capped; a
sweep row names what ran."""

from __future__ import annotations

from cacheseek.report import MAX_DIFFS, gate_verdicts, nothing_cached, request_table
from cacheseek.sweep import what_ran


def _req(name, hit, want, frames="ok", vs=""):
    return {"name": name, "actions": "P+X", "hit_depth": hit, "expect_k": want, "chunks_computed": 4 - hit,
            "depth": "ok" if hit == want else "MISS", "frames": frames, "frames_vs": vs, "wall_s": 0.1,
            "bytes_restored": 0, "bytes_written": 0, "verdict": "ok", "expect": ""}


def _results(requests, ring, **metrics):
    m = {"writes": 0, "dropped_writes": 0, "failed_writes": 0, "store_used_bytes": 0,
         "store_capacity_bytes": 256 << 20}
    m.update(metrics)
    return {"requests": requests, "ring_check": ring, "metrics": m}


def test_a_cache_that_stored_nothing_is_one_line_and_the_frames_still_pass():
    reqs = [_req("A", 0, 0), _req("B", 0, 4, vs="== A"), _req("C", 0, 2, vs="== D"), _req("D", 0, 0, vs="[:P] == A")]
    ring = [{"K": k, "hit_depth": 0, "verdict": "not restored", "diff": []} for k in (1, 2, 3)]
    lines = gate_verdicts(_results(reqs, ring, dropped_writes=9, failed_writes=18))
    assert lines[0].startswith("hit depth:    FAIL: B hit 0 (want 4), C hit 0 (want 2); nothing was cached: "
                               "9 writes dropped, 18 failed")
    assert lines[1].startswith("frame hashes: ok")
    assert lines[2] == "ring check:   FAIL (0/3 resume depths equal a cold run)"
    assert len(lines) == 4 and lines[3].startswith("  K=1, K=2, K=3: never restored (hit 0), nothing to compare")
    assert "differs" not in "\n".join(lines)


def test_long_diff_lists_are_capped_and_counted():
    diff = [f"layer {i} k[:, :local_end] differs" for i in range(40)]
    ring = [{"K": 1, "hit_depth": 1, "verdict": "ok", "diff": []}, {"K": 2, "hit_depth": 2, "verdict": "MISMATCH", "diff": diff}]
    reqs = [_req("A", 0, 0), _req("B", 4, 4, frames="MISMATCH", vs="== A")]
    lines = gate_verdicts(_results(reqs, ring, writes=6))
    assert lines[0] == "hit depth:    ok (A 0, B 4)"
    assert lines[1] == "frame hashes: FAIL: B == A does not hold"
    assert lines[2] == "ring check:   FAIL (1/2 resume depths equal a cold run)"
    assert lines[3].startswith("  K=2: 40 differences from a cold run: layer 0 k")
    assert lines[3].count("differs") == MAX_DIFFS and lines[3].endswith(f"... {40 - MAX_DIFFS} more")


def test_nothing_cached_only_when_writes_were_tried_and_none_stored():
    assert nothing_cached({"writes": 0, "dropped_writes": 0, "failed_writes": 0}) is None
    assert nothing_cached({"writes": 3, "dropped_writes": 2, "failed_writes": 0}) is None
    assert "2 writes dropped" in nothing_cached({"writes": 0, "dropped_writes": 2, "failed_writes": 0})


def test_the_gate_table_has_a_depth_and_a_frames_column():
    header = request_table([_req("A", 0, 0), _req("B", 0, 4, vs="== A")]).splitlines()[0].split()
    assert header[:5] == ["req", "actions", "hit", "K", "want"] and "depth" in header and header[-1] == "frames"


def test_the_sweep_row_names_what_ran():
    telefuser = {"runtime": {"runtime": "telefuser", "layout": "released", "telefuser": "0.1.0.post3",
                             "model": "2x2x12 64x64", "device": "cpu"}, "layout": "bshd"}
    assert what_ran(telefuser) == {"runtime": "telefuser 0.1.0.post3 released", "layout": "bshd",
                                   "geometry": "2x2x12 64x64", "device": "cpu"}
    synthetic = {"runtime": {"runtime": "synthetic", "geometry": "tiny", "device": "cpu"}, "layout": "bshd"}
    assert what_ran(synthetic) == {"runtime": "synthetic", "layout": "bshd", "geometry": "tiny", "device": "cpu"}
    older = {"config": {"runtime": {"geometry": "small"}}}  # a results.json from before the runtime was named
    assert what_ran(older)["geometry"] == "small"
