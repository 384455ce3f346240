"""The benchmarks under experiments/ run end to end on the CPU (tiny sizes, host runtime): their
configs compose, their progress, JSON results and plots are produced. Figures need the H200."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from repo_scripts import load_script

REPO = Path(__file__).resolve().parent.parent


def load(name: str):
    return load_script(f"experiments/{name}/bench_{name}.py", f"bench_{name}")


def test_transfer_benchmark_smoke(tmp_path):
    res = load("transfer").main([
        "device=cpu", "reps=1", "peak_bytes=4194304", "segment_bytes=67108864", "backing=shared",
        "chunk.n_layers=2", "chunk.chunk_tokens=12", "chunk.heads=2", "chunk.head_dim=8", "chunk.latent_shape=[1,4,3,2,2]",
        "rolled.n_layers=2", "rolled.heads=2", "rolled.head_dim=8", "rolled.depth=5",
        "small.sizes=[65536]", "small.total_bytes=1048576", f"out_dir={tmp_path}",
    ])
    assert {r["section"] for r in res["rows"]} == {"peak", "plan", "rolled", "small"}
    assert all(r.get("verified", True) for r in res["rows"])
    assert json.loads((tmp_path / "results.json").read_text())["targets"]
    assert (tmp_path / "transfer.png").stat().st_size > 0


def test_registration_benchmark_smoke(tmp_path):
    res = load("registration").main([
        "device=cpu", "sizes_gib=[0.03125]", "cold_sizes_gib=[0.03125]", "prefault_threads=2", f"out_dir={tmp_path}",
    ])
    assert [r["mode"] for r in res["rows"]] == ["hugepages", "warmed", "cold", "hugepages"]
    assert all(r["time_to_ready_s"] > 0 for r in res["rows"]) and (tmp_path / "registration.png").exists()


@pytest.mark.slow
def test_e2e_benchmark_smoke(tmp_path):
    res = load("e2e").main([
        "device=cpu", "geometry=tiny", "gemm_dim=0", "segment_bytes=16777216", "staging_slot_bytes=0",
        "total_chunks=3", "prefix_chunks=1", f"out_dir={tmp_path}",
    ])
    assert all(res["modes"][m]["passed"] for m in res["modes"] if m != "nocache")
    assert "| plan_overlap |" in (tmp_path / "summary.md").read_text()


def test_action_keys_benchmark_smoke(tmp_path):
    res = load("action_keys").main(["geometry=tiny", "old_runs=1", "old_runs_bf16=1", "new_runs=2",
                                    "tiny_runs=2", f"out_dir={tmp_path}"])
    assert res["all_same_integers"] and all(r["keys_stable_across_runs"] for r in res["cases"])
    assert (tmp_path / "action_keys.png").stat().st_size > 0


@pytest.mark.slow
def test_hbm_tier_benchmark_smoke(tmp_path):
    res = load("hbm_tier").main([
        "device=cpu", "reps=1", "peak_bytes=1048576", "full_hit.geometry=tiny", "cold_a.geometry=tiny",
        "cold_a.gemm_dim=0", "cold_a.reps=1", "mixed.geometry=tiny", "mixed.gemm_dim=0", "mixed.sessions=4",
        "mixed.layouts=[nocache,hbm,hbm+plan]", f"out_dir={tmp_path}",
    ])
    assert res["peak"]["verified"] and res["full_hit"]["verified"]
    assert res["full_hit"]["hits"] == {"hbm": 3, "fluxon_plan": 3} and res["full_hit"]["promotions"] == 3
    assert res["cold_a"]["frames_equal"] and res["cold_a"]["gate"]["passed"]
    assert all(x["frames_ok"] for x in res["mixed"]["layouts"].values())
    assert set(res["targets"]) == {"full_hit_hbm_at_least_80pct_of_d2d_peak", "full_hit_hbm_at_least_20x_plan",
                                   "cold_a_within_3pct_of_nocache"}
    assert "| hbm+plan |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "hbm_tier.png").stat().st_size > 0


def test_copy_kernel_benchmark_smoke(tmp_path):
    res = load("copy_kernel").main([
        "device=cpu", "reps=1", "peak_bytes=1048576", "total_bytes=1048576",
        "cases=[[d2d,65536,4],[h2d,131072,3],[d2d,4096,0]]", f"out_dir={tmp_path}",
    ])
    assert [r["copies"] for r in res["rows"]] == [4, 3, 256]
    assert all(r["kernel_ok"] for r in res["rows"])  # the fake kernel ran the packed tables
    assert "| d2d | 256 x 4 KiB |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "copy_kernel.png").stat().st_size > 0


def test_write_polls_benchmark_smoke(tmp_path):
    res = load("write_polls").main([
        "chunk_bytes=100663296", "copy_gib_s=50", "piece_bytes=[33554432]", "poll_s=[0.0002,0.001]",
        "launch_ops=2000", "reps=1", f"out_dir={tmp_path}",
    ])
    assert [(r["piece_mib"], r["poll_ms"]) for r in res["rows"]] == [(32, 0.2), (32, 1.0)]
    assert all(r["wakes_per_chunk"] >= 3 and 0 <= r["engine_idle"] < 1 and r["slowdown"] > 0 for r in res["rows"])
    assert "| 32 MiB (product) | 0.2 ms |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "write_polls.png").stat().st_size > 0


@pytest.mark.slow
def test_warmup_benchmark_and_timeline_smoke(tmp_path, capsys):
    args = ["device=cpu", "geometry=tiny", "segment_bytes=67108864", "reps=1", "warmup_chunks=0",
            "register_piece_bytes=16777216", f"out_dir={tmp_path}"]
    res = load("warmup").main(args)
    runs = {r["mode"]: r for r in res["runs"]}
    assert set(runs) == {"nocache", "foreground", "background", "background_onecall"}
    assert runs["background"]["third_hit_depth"] == 2 and runs["background"]["register_pieces"] == 4
    assert (tmp_path / "warmup.png").stat().st_size > 0
    timeline = load_script("experiments/warmup/timeline.py", "warmup_timeline")
    timeline.main(["background", *args])
    out = capsys.readouterr().out
    # the warm-up waits for the first session from its first step: nothing registers before the
    # binding's hook returned
    lines = [line for line in out.splitlines() if " ms  " in line]
    hook, registration = (next(i for i, line in enumerate(lines) if what in line)
                          for what in ("the binding's hook ends", "registration in pieces begins"))
    assert hook < registration


@pytest.mark.slow
@pytest.mark.telefuser
def test_telefuser_480p_benchmark_smoke(tmp_path):
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    tiny = ["runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14", "runtime.ffn_dim=32",
            "runtime.text_dim=16", "runtime.text_layers=1", "runtime.height=32", "runtime.width=32"]
    res = load("telefuser_480p").main(["device=cpu", "stores=[nocache,fluxon_plan]", f"out_dir={tmp_path}",
                                       "store_timeout_s=600", "budget_s=1500",
                                       "runtime_overrides=[" + ",".join(f"'{o}'" for o in tiny) + "]"])
    plan = res["stores"]["fluxon_plan"]
    assert plan["returncode"] == 0 and plan["passed"] and plan["b_profiled"]["hit_depth"] == 3
    assert res["stores"]["nocache"]["returncode"] == 0 and "requests" not in res["stores"]["nocache"]
    row = next(r for r in res["table"] if r["store"] == "fluxon_plan")
    assert row["B_k"] == 3 and row["B_ratio"] > 0 and (tmp_path / "telefuser_480p.png").stat().st_size > 0
    assert "| fluxon_plan |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.telefuser
def test_session_reuse_benchmark_smoke(tmp_path):
    """Issue 32's bench on TeleFuser's real pipeline, tiny and with its stand-in parts: B hands
    out every chunk's frames, C materializes its prefix, the sweep diverges after k served."""
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    tiny = ["runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14", "runtime.ffn_dim=32", "runtime.text_dim=16",
            "runtime.height=32", "runtime.width=32", "runtime.vae=stand_in", "runtime.text_encoder=stand_in"]
    res = load("session_reuse").main([
        "device=cpu", "stores=[fluxon_plan]", f"out_dir={tmp_path}", "sweep_k=[1,2]", "live_sessions=2", "write_pairs=2", "write_profile=true",
        "store_timeout_s=600", "budget_s=700",
        "store_overrides.fluxon_plan=['+store=fluxon_plan','store.backing=private','store.segment_bytes=4MiB']",
        "runtime_overrides=[" + ",".join(f"'{o}'" for o in tiny) + "]"])
    assert set(res["stores"]) == {"fluxon_plan.dec2", "fluxon_plan.dec0"}  # decoder state stored, rebuilt
    off = res["stores"]["fluxon_plan.dec0"]
    assert off["returncode"] == 0 and off["passed"] and "live" not in off and off["sweep"]["rows"]
    plan = res["stores"]["fluxon_plan.dec2"]
    assert plan["returncode"] == 0 and plan["passed"]
    b, c = plan["requests"]["B"], plan["requests"]["C"]
    assert (b["frames_served"], b["chunks_materialized"], c["frames_served"], c["chunks_materialized"]) == (3, 0, 2, 2)
    assert plan["live"]["frames_equal"] and plan["live"]["served"] == [3, 3]
    pairs = plan["write_pairs"]["rows"]  # cold without and with writing, new actions, alternating order
    assert [r["first"] for r in pairs] == ["cold", "write"] and all(r["cold_s"] > 0 and r["write_s"] > 0 for r in pairs)
    assert {p.name for p in (tmp_path / "writes_fluxon_plan.dec2").iterdir()} == {
        f"{kind}_by_{key}.txt" for kind in ("cold", "write") for key in ("device", "cpu")} | {"gaps.md", "gaps.json"}
    assert plan["b_fresh_worker"]["encodes_loaded"] == 2  # a fresh worker's keep: both encodes from the store
    assert [r["k"] for r in plan["sweep"]["rows"]] == [1, 2] and all(r["frames_served"] == r["k"] for r in plan["sweep"]["rows"])
    assert "| fluxon_plan |" in (tmp_path / "results.md").read_text() and (tmp_path / "session_reuse.png").exists()


@pytest.mark.slow
@pytest.mark.telefuser
def test_session_reuse_live_profile_smoke(tmp_path):
    """The restored live chunk's profile on TeleFuser's real pipeline, tiny, both stores: every
    following chunk served, their frames equal, each sub-step timed, the reads measured."""
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    tiny = ["runtime.n_layers=1", "runtime.n_heads=1", "runtime.head_dim=14", "runtime.ffn_dim=32", "runtime.text_dim=16",
            "runtime.height=32", "runtime.width=32", "runtime.vae=stand_in", "runtime.text_encoder=stand_in"]
    module = load_script("experiments/session_reuse/profile_live.py", "profile_live")
    res = module.main([
        "device=cpu", "stores=[hbm,fluxon_plan]", f"out_dir={tmp_path}", "live_sessions=2",
        "store_overrides.fluxon_plan=['+store=fluxon_plan','store.backing=private','store.segment_bytes=4MiB']",
        "runtime_overrides=[" + ",".join(f"'{o}'" for o in tiny) + "]"])
    for store in ("hbm", "fluxon_plan"):
        r = res["stores"][store]
        assert r["returncode"] == 0 and r["plain"]["served"] == [3, 3] and r["plain"]["frames_equal"]
        assert r["steps"]["steps_ms"]["frames_read"] > 0 and r["reads"]["copy_out_ms"] >= 0
        assert (tmp_path / f"profile_{store}.txt").read_text().startswith("== CacheSeek's")
    assert "| hbm |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_shared_index_workers_benchmark_smoke(tmp_path):
    module = load_script("experiments/shared_index/bench_workers.py", "bench_workers")
    res = module.main(['interactive=["workload.sessions=4"]', "stress=null", "workers=[1]", "restart_after=2",
                       "restart_workers=[1]", "cost_reps=1", "ops_reps=3", f"out_dir={tmp_path}", f"runs_dir={tmp_path / 'runs'}"])
    assert [r["label"] for r in res["runs"]] == [
        "interactive-memory-1", "interactive-localdisk-1-index", "interactive-localdisk-1-noindex",
        "interactive-restart-1-index", "interactive-restart-1-noindex"]
    assert all(r["passed"] for r in res["runs"])
    (restart_on, restart_off) = res["summary"]["restart"]
    assert restart_on["second_half_restored"] >= restart_off["second_half_restored"]
    assert "| interactive | localdisk | 1 | on |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "hit_rate.png").stat().st_size > 0
    assert res["ops"]["localdisk"]["find_8_hits"]["p50_ms"] > 0


def test_codecs_benchmark_smoke(tmp_path):
    res = load("codecs").main(["device=cpu", "geometry=tiny", "reps=1", "sources=[synthetic,randn]",
                               f"root={tmp_path / 'root'}", f"out_dir={tmp_path / 'out'}"])
    assert set(res["ratios"]) == {"synthetic", "randn"}
    assert res["speed"]["lossless"]["bit_exact"] is True
    for tier in ("memory", "localdisk", "localdisk_cold", "plan_model", "hbm_model"):
        assert res["restore"][tier]["none"]["bit_exact"] and res["restore"][tier]["lossless"]["bit_exact"]
        assert res["restore"][tier]["int4"]["kv_psnr_db"] is not None
    assert set(res["targets"]) >= {"lossless_localdisk_1.2x_at_ratio_1.25", "lossless_plan_model_not_slower"}
    assert "| localdisk |" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "codecs.png").stat().st_size > 0

def test_root_open_measurement_smoke(tmp_path):
    """experiments/root_open/measure.py (issue 33 item 10) on a root of 300 chunks: every step
    timed, the first chunk's record found, nothing an orphan, the table written."""
    import subprocess

    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(REPO / "experiments" / "root_open" / "measure.py"), "--chunks", "300",
                           "--dir", str(tmp_path), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunks"] == 300 and row["files"] == 900 and row["orphans"] == 0
    assert all(row[k] > 0 for k in ("open_s", "bare_listing_s", "first_lookup_s", "usage_scan_s", "orphan_scan_s"))
    assert "| 300 | 900 |" in out.with_suffix(".md").read_text()


def test_trace_gaps_attributes_idle_time_to_the_launching_thread():
    """session_reuse's trace analysis: the model stream (most kernel time) is busy 3 ms of a 9 ms
    span; its 2 ms gap opened while the launching thread synchronized, its 4 ms gap lies under a
    CacheSeek frame of that thread (the innermost of two), a kernel on another stream is ignored."""
    gaps = load_script("experiments/session_reuse/trace_gaps.py", "trace_gaps")

    def ev(cat, ts, dur, name="k", tid=1, **args):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "tid": tid, "args": args}

    trace = {"traceEvents": [
        ev("kernel", 0, 1000, stream=7, correlation=1), ev("cuda_runtime", -10, 5, "cudaLaunchKernel", correlation=1),
        ev("kernel", 3000, 1000, stream=7, correlation=2), ev("cuda_runtime", 2990, 5, "cudaLaunchKernel", correlation=2),
        ev("kernel", 8000, 1000, stream=7, correlation=3), ev("cuda_runtime", 7990, 5, "cudaLaunchKernel", correlation=3),
        ev("kernel", 5000, 2500, stream=9, correlation=4), ev("cuda_runtime", 4990, 5, "cudaLaunchKernel", tid=2, correlation=4),
        ev("cuda_runtime", 900, 1500, "cudaStreamSynchronize"),
        ev("python_function", 3900, 4050, "/x/cacheseek/reuse/exact_prefix/manager.py(200): ingest"),
        ev("python_function", 3950, 3900, "cacheseek/stores/plan_tier/write.py(206): put_async"),
        ev("python_function", 3950, 4000, "/x/experiments/session_reuse/bench_session_reuse.py(1): main"),
    ]}
    r = gaps.analyse(trace, gap_us=500)
    assert r["stream"] == 7 and r["busy_s"] == pytest.approx(3e-3) and r["span_s"] == pytest.approx(9e-3)
    assert r["gaps"] == 2 and r["by_host_call"] == {"-": pytest.approx(4e-3), "cudaStreamSynchronize": pytest.approx(2e-3)}
    assert r["by_frame"] == {"stores/plan_tier/write.py: put_async": pytest.approx(4e-3), "-": pytest.approx(2e-3)}
    quiet = gaps.analyse({"traceEvents": [ev("kernel", 0, 1000, stream=7), ev("kernel", 1100, 1000, stream=7)]})
    delta = gaps.compare(quiet, r)
    assert quiet["gaps"] == 0 and delta["gap_s"] == pytest.approx(6e-3) and delta["by_frame"]["stores/plan_tier/write.py: put_async"] == pytest.approx(4e-3)
    assert "put_async" in gaps.markdown({"cold": quiet, "write": r}, delta)
