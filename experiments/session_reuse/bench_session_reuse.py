"""Whole-session reuse on TeleFuser's real pipeline at LingBot-World 14B's size (issue 32).

A restored chunk hands out its stored frames; KV, latents and the decoder's state move into the
runtime only where the session computes. One child process per store in ``stores`` (``--one
STORE``), each on TeleFuser 0.1.0.post3's pipeline with the ``lingbot_world_14b`` preset (random
bf16 weights on the GPU, real Wan VAE and umT5), 480x832:

1. builds the stack; one warm-up chunk without a cache;
2. P+X without a cache (``nocache_before``), the gate (A cold + write, B full hit, C 2/3 hit, D cold
   fork; no ring check), P+X without a cache again (``nocache_after``): each request's ratio is
   against the mean of the two, timed as the gate times a request;
3. B again with each stage timed (synchronized; ``b_stages``): TeleFuser's prompt and condition
   encodes in ``create_runtime``, CacheSeek's creation hook, each chunk's frames read and hand-out;
4. the time to the first frame of a planned session whose chunks are all cached (creation and its
   chunk 0);
5. live sessions streamed one action per chunk: one that computes a path, then ``live_sessions``
   that follow it: each chunk's seconds (chunk 0's with the session's creation: the time to the
   first frame), their frames checked equal to the first's;
6. (``sweep_stores``) a session of ``max(sweep_k) + 2`` chunks computed and written, then for each
   k a session sharing its first k chunks: the seconds of its first computed chunk (the served
   prefix restored, the decoder's state rebuilt by decoding the k served latents, then the chunk)
   against the same chunk of a run without a cache, and the decoder's state priced both ways:
   rebuilt (the replay's seconds, measured) or stored (its bytes after chunk k, its copy from pinned
   host memory and from device memory);
7. the bytes stored beyond the KV (frames) against the KV's, from the metrics.

The parent writes ``store_<store>.json`` per store, ``results.json`` (machine, versions, commit,
every figure), ``results.md`` (the tables) and ``session_reuse.png``.

    python experiments/session_reuse/bench_session_reuse.py [key=value ...]   # conf/session_reuse.yaml
    python experiments/session_reuse/bench_session_reuse.py device=cpu stores=[fluxon_plan] sweep_k=[1,2] \\
        "store_overrides.fluxon_plan=['+store=fluxon_plan','store.backing=private']" \\
        "runtime_overrides=['runtime.n_layers=1','runtime.n_heads=1','runtime.head_dim=14','runtime.ffn_dim=32','runtime.text_dim=16','runtime.text_layers=1','runtime.height=32','runtime.width=32']"
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from benchlib import REPO, compose, env_info, git_state, write_json  # noqa: E402

REQUESTS = ("A", "B", "C", "D")
TARGETS = {"B_ratio": 0.03, "C_ratio": 0.40, "live_restored_ms": 15.0, "ttff_ms": 60.0, "first_computed_ratio": 1.3,
           "A_over": 0.02, "bytes_beyond_kv": 0.15}


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "session_reuse"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "what": "whole-session reuse (issue 32) on TeleFuser's real pipeline at lingbot_world_14b, one process per "
                "store, no-cache P+X bracketing the requests in the same process",
        "command": " ".join(["python", "experiments/session_reuse/bench_session_reuse.py", *argv]),
        "config": _plain(cfg), "env": {**env_info(), **git_state()}, "targets": TARGETS, "stores": {},
    }
    t_all = time.perf_counter()
    for i, store in enumerate(cfg.stores, 1):
        left = float(cfg.budget_s) - (time.perf_counter() - t_all)
        if left < float(cfg.min_store_s):
            results["stores"][store] = {"skipped": f"{left:.0f} s of budget_s {cfg.budget_s} left"}
            continue
        print(f"[{i}/{len(cfg.stores)}] {store} ({time.perf_counter() - t_all:.0f} s in)", flush=True)
        one = out_dir / f"store_{store}.json"
        one.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", store, *argv]
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=min(float(cfg.store_timeout_s), left), cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row = json.loads(one.read_text()) if one.exists() else {}
        row.update(returncode=rc, process_wall_s=time.perf_counter() - t0)
        results["stores"][store] = row
        write_json(out_dir / "results.json", results)
    results["summary"] = {s: _summary(r) for s, r in results["stores"].items() if "requests" in r}
    write_json(out_dir / "results.json", results)
    text = _markdown(results)
    (out_dir / "results.md").write_text(text)
    try:
        _plot(results, out_dir / "session_reuse.png")
    except Exception as exc:  # noqa: BLE001 - the figures are in results.json whatever the plot does
        print(f"plot failed: {exc!r}", flush=True)
    print(text, flush=True)
    print(f"wrote {out_dir / 'results.json'} ({time.perf_counter() - t_all:.0f} s)", flush=True)
    return results


# -- one store's process ---------------------------------------------------------------------------

def run_one(store: str, argv: list[str]) -> None:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack
    from stages import stage_timers

    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "session_reuse"
    overrides = ["+experiment=lingbot_world_14b", f"runtime.device={cfg.device}", "workload.ring_check=false",
                 *cfg.store_overrides[store], *cfg.runtime_overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hcfg = hydra_compose(config_name="config", overrides=overrides)
    row: dict[str, Any] = {"store": store, "overrides": overrides}
    sync = _sync(cfg.device)
    if str(cfg.device) == "cpu" and cfg.cpu_threads:
        import torch

        torch.set_num_threads(int(cfg.cpu_threads))
    t0 = time.perf_counter()
    stack = build_stack(hcfg, run_dir=out_dir / f"run_{store}", note=lambda line: print(f"  {line}", flush=True))
    try:
        factory, gate = stack.runtime_factory, stack.workload
        factory.pipeline
        wait_ready = getattr(stack.store, "wait_ready", None)
        if wait_ready is not None:
            wait_ready(None)
        row["build_s"] = time.perf_counter() - t0
        row["runtime"] = factory.describe()
        print(f"  built in {row['build_s']:.1f} s: {row['runtime']['model']}", flush=True)
        px = gate.P + gate.X

        def nocache(actions: list, label: str) -> float:
            runtime = factory.make(actions, hooks=None)
            sync()
            start = time.perf_counter()
            runtime.generate()
            sync()
            wall = time.perf_counter() - start
            print(f"  {label}: {wall:.3f} s", flush=True)
            return wall

        nocache(px[:1], "warm-up (1 chunk, no cache)")
        row["nocache_before_s"] = nocache(px, "no cache P+X (before)")
        res = gate.run(stack)
        row["passed"], row["verdicts"] = res["passed"], res["verdicts"]
        row["requests"] = {r["name"]: {k: r[k] for k in ("wall_s", "hit_depth", "bytes_restored", "bytes_written",
                                                         "frames_served", "chunks_materialized", "verdict")}
                           for r in res["requests"]}
        for name, r in row["requests"].items():
            print(f"  {name}: {r['wall_s']:.3f} s, K={r['hit_depth']}, frames served {r['frames_served']}, "
                  f"materialized {r['chunks_materialized']}, {r['verdict']}", flush=True)
        print(f"  gate {'PASS' if res['passed'] else 'FAIL'} {res['verdicts']}", flush=True)

        with stage_timers(sync) as stages:  # B again, each stage synchronized
            again = gate._request(stack, "B2", px, "P+X")
        row["b_stages"] = {"wall_s": again.wall_s, "hit_depth": again.hit_depth, **stages}
        print("  B stages (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in stages.items()), flush=True)

        binding = stack.new_binding()
        session = factory.make(px, hooks=binding)
        sync()
        start = time.perf_counter()
        session.generate(stop_after=1)
        sync()
        row["ttff_planned_s"] = time.perf_counter() - start
        row["ttff_planned_served"] = binding.frames_served
        session.generate()
        print(f"  time to first frame, planned session on a cached path: {row['ttff_planned_s'] * 1e3:.1f} ms", flush=True)

        row["live"] = _live(stack, factory, px, int(cfg.live_sessions), sync)
        lv = row["live"]
        print(f"  live: restored chunk median {lv['restored_median_s'] * 1e3:.1f} ms, computed {lv['computed_median_s'] * 1e3:.1f}"
              f" ms, time to first frame median {lv['ttff_median_s'] * 1e3:.1f} ms, frames equal {lv['frames_equal']}", flush=True)
        if store in cfg.sweep_stores:
            row["sweep"] = _sweep(stack, factory, list(cfg.sweep_k), bool(cfg.sweep_nocache_ref), sync)
        row["nocache_after_s"] = nocache(px, "no cache P+X (after)")
        m = stack.metrics.as_dict()
        row["metrics"] = m
        row["bytes_beyond_kv"] = m["frames_write_bytes"] / m["write_bytes"] if m["write_bytes"] else None
    finally:
        stack.close()
    write_json(out_dir / f"store_{store}.json", row)


def _chunks(session: Any, n: int, sync: Any) -> list[float]:
    """Each chunk's seconds (chunk 0's with the session's creation)."""
    times = []
    for i in range(n):
        sync()
        start = time.perf_counter()
        session.generate(stop_after=i + 1)
        sync()
        times.append(time.perf_counter() - start)
    return times


def _live(stack: Any, factory: Any, actions: list, sessions: int, sync: Any) -> dict:
    manager = stack.new_manager()
    first = stack.new_binding(manager)
    s = factory.make(actions, hooks=first, streamed=True)
    computed = _chunks(s, len(actions), sync)
    reference = list(s.frame_hashes)
    first.close()
    restored, ttff, equal, served = [], [], True, []
    for _ in range(sessions):
        b = stack.new_binding(manager)
        s = factory.make(actions, hooks=b, streamed=True)
        times = _chunks(s, len(actions), sync)
        ttff.append(times[0])
        restored += times[1:]
        equal = equal and s.frame_hashes == reference
        served.append(b.frames_served)
        b.close()
    return {"computed_s": computed, "restored_s": restored, "ttff_s": ttff, "frames_equal": equal, "served": served,
            "computed_median_s": statistics.median(computed[1:] or computed),
            "restored_median_s": statistics.median(restored) if restored else None,
            "ttff_median_s": statistics.median(ttff) if ttff else None}


def _sweep(stack: Any, factory: Any, ks: list[int], nocache_ref: bool, sync: Any) -> dict:
    """The first computed chunk after k served chunks, against the same chunk of a cold run."""
    import random

    import torch

    from stages import stage_timers

    n = max(ks) + 2  # chunk k is never the last: its decode keeps the decoder's state (the last clears it)
    rng = random.Random(32)
    z = [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(n)]
    manager = stack.new_manager()
    writer = stack.new_binding(manager)
    cold_written = _chunks(factory.make(z, hooks=writer), n, sync)
    stack.store.flush()
    cold = _chunks(factory.make(z, hooks=None), n, sync) if nocache_ref else cold_written
    print(f"  sweep: {n} chunks cold {sum(cold):.2f} s (written {sum(cold_written):.2f} s)", flush=True)
    rows = []
    vae = factory.pipeline.vae
    for k in ks:
        actions = z[:k] + [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(n - k)]
        b = stack.new_binding(manager, ingest_enabled=False)
        s = factory.make(actions, hooks=b)
        served = _chunks(s, k, sync)
        with stage_timers(sync) as st:
            sync()
            start = time.perf_counter()
            s.generate(stop_after=k + 1)
            sync()
            first = time.perf_counter() - start
        cache = [t for t in getattr(vae, "_feat_cache", None) or [] if isinstance(t, torch.Tensor)]
        stored = _decoder_state_copies(cache, sync)
        rows.append({"k": k, "served_s": served, "first_computed_s": first, "cold_chunk_s": cold[k],
                     "ratio": first / cold[k], "frames_served": b.frames_served,
                     "chunks_materialized": b.chunks_materialized, "replay_s": st.get("decoder_replay", 0.0),
                     "materialize_s": st.get("materialize", 0.0), **stored})
        print(f"  k={k}: first computed chunk {first:.3f} s vs cold {cold[k]:.3f} s ({first / cold[k]:.3f}x); decoder "
              f"rebuilt in {rows[-1]['replay_s']:.3f} s, stored would be {stored['decoder_state_bytes'] / 2**30:.2f} GiB "
              f"({stored['decoder_state_from_host_s'] * 1e3:.1f} ms from host)", flush=True)
        b.close()
    return {"chunks": n, "cold_s": cold, "cold_written_s": cold_written, "rows": rows}


def _decoder_state_copies(tensors: list, sync: Any) -> dict:
    """The decoder state's bytes and its copies: from pinned host memory (a host tier's restore)
    and device to device (an HBM tier's)."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors:
        return {"decoder_state_bytes": 0, "decoder_state_from_host_s": 0.0, "decoder_state_d2d_s": 0.0}
    cuda = tensors[0].is_cuda
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t)
    back = [torch.empty_like(t) for t in tensors]
    sync()
    start = time.perf_counter()
    for b, h in zip(back, host):
        b.copy_(h, non_blocking=True)
    sync()
    from_host = time.perf_counter() - start
    start = time.perf_counter()
    for b, t in zip(back, tensors):
        b.copy_(t)
    sync()
    return {"decoder_state_bytes": nbytes, "decoder_state_from_host_s": from_host,
            "decoder_state_d2d_s": time.perf_counter() - start}


# -- results --------------------------------------------------------------------------------------

def _summary(r: dict) -> dict:
    base = (r["nocache_before_s"] + r["nocache_after_s"]) / 2 if r.get("nocache_after_s") else r.get("nocache_before_s")
    out: dict[str, Any] = {"nocache_mean_s": base, "passed": r.get("passed")}
    for name in REQUESTS:
        req = (r.get("requests") or {}).get(name)
        out[f"{name}_s"] = req["wall_s"] if req else None
        out[f"{name}_ratio"] = req["wall_s"] / base if req and base else None
    lv = r.get("live") or {}
    out["live_restored_ms"] = 1e3 * lv["restored_median_s"] if lv.get("restored_median_s") is not None else None
    out["live_ttff_ms"] = 1e3 * lv["ttff_median_s"] if lv.get("ttff_median_s") is not None else None
    out["ttff_planned_ms"] = 1e3 * r["ttff_planned_s"] if r.get("ttff_planned_s") is not None else None
    sw = (r.get("sweep") or {}).get("rows") or []
    out["first_computed_ratio_max"] = max((x["ratio"] for x in sw if x["k"] <= 8), default=None)
    out["bytes_beyond_kv"] = r.get("bytes_beyond_kv")
    return out


def _markdown(results: dict) -> str:
    e = results["env"]
    lines = [f"# session_reuse: {e.get('gpu', 'no GPU')}, torch {e.get('torch')}, git {e.get('git_commit')}"
             f"{' (dirty)' if e.get('git_dirty') else ''}, {e.get('time')}", "",
             "| store | no cache P+X | A cold + write | B full hit | C 2/3 hit | D cold fork | live restored chunk "
             "(median) | time to first frame: planned / live | first computed after k<=8 (worst) | bytes beyond KV | gate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for store, s in results.get("summary", {}).items():
        def cell(name: str) -> str:
            v, q = s[f"{name}_s"], s[f"{name}_ratio"]
            return "-" if v is None else f"{v:.3f} s ({q:.3f}x)"

        def ms(v: Any) -> str:
            return "-" if v is None else f"{v:.1f} ms"

        fc = "-" if s["first_computed_ratio_max"] is None else f"{s['first_computed_ratio_max']:.3f}x"
        bb = "-" if s["bytes_beyond_kv"] is None else f"{s['bytes_beyond_kv']:.2%}"
        lines.append(f"| {store} | {s['nocache_mean_s']:.3f} s | {cell('A')} | {cell('B')} | {cell('C')} | {cell('D')} | "
                     f"{ms(s['live_restored_ms'])} | {ms(s['ttff_planned_ms'])} / {ms(s['live_ttff_ms'])} | {fc} | {bb} | "
                     f"{'PASS' if s['passed'] else 'FAIL'} |")
    t = results["targets"]
    lines += ["", f"Targets: B <= {t['B_ratio']}x, C <= {t['C_ratio']}x, a restored live chunk <= {t['live_restored_ms']} ms, "
                  f"time to first frame <= {t['ttff_ms']} ms, first computed chunk after k <= 8 restored <= "
                  f"{t['first_computed_ratio']}x a cold chunk, A within {t['A_over']:.0%} of no cache, bytes beyond the "
                  f"KV <= {t['bytes_beyond_kv']:.0%}. Ratios: wall over the mean of the two no-cache P+X runs of the same process."]
    for store, r in results["stores"].items():
        st = r.get("b_stages")
        if st:
            lines += ["", f"## B, stage by stage ({store}, B again with each stage synchronized: {st['wall_s']:.3f} s)", "",
                      "| stage | ms |", "| --- | ---: |"]
            named = {k: v for k, v in st.items() if k not in ("wall_s", "hit_depth")}
            for k, v in named.items():
                lines.append(f"| {k} | {v * 1e3:.1f} |")
            inside = sum(v for k, v in named.items() if k in ("create_runtime", "chunk_seam"))
            lines.append(f"| rest (the session object, the flush, Python) | {(st['wall_s'] - inside) * 1e3:.1f} |")
        sw = r.get("sweep")
        if sw:
            lines += ["", f"## Divergence after k served chunks ({store}; a session of {sw['chunks']} chunks) and the "
                          "decoder's state: rebuilt (default) or stored", "",
                      "| k | first computed chunk s | cold chunk k s | ratio | materialize s | decoder rebuilt s "
                      "| stored: GiB per resume point | stored: from host ms | stored: HBM copy ms |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for x in sw["rows"]:
                lines.append(f"| {x['k']} | {x['first_computed_s']:.3f} | {x['cold_chunk_s']:.3f} | {x['ratio']:.3f} | "
                             f"{x['materialize_s']:.3f} | {x['replay_s']:.3f} | {x['decoder_state_bytes'] / 2**30:.2f} | "
                             f"{x['decoder_state_from_host_s'] * 1e3:.1f} | {x['decoder_state_d2d_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results.get("summary") or {}
    if not summary:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(summary)
    for i, req in enumerate(REQUESTS):
        axes[0].bar([j + 0.2 * i for j in range(len(names))], [summary[n][f"{req}_ratio"] or 0 for n in names],
                    width=0.2, label=req)
    axes[0].set_xticks([j + 0.3 for j in range(len(names))], names)
    axes[0].set_ylabel("wall / no cache")
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].legend()
    axes[0].set_title("A/B/C/D against no cache")
    for store, r in results["stores"].items():
        sw = (r.get("sweep") or {}).get("rows")
        if sw:
            axes[1].plot([x["k"] for x in sw], [x["ratio"] for x in sw], "o-", label=f"{store}: first computed / cold")
    axes[1].axhline(TARGETS["first_computed_ratio"], color="red", lw=0.5, ls="--", label="target")
    axes[1].set_xlabel("chunks served before the divergence (k)")
    axes[1].legend()
    axes[1].set_title("first computed chunk after k served")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _sync(device: str) -> Any:
    import torch

    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def _plain(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        run_one(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])
