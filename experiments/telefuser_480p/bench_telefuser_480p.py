"""The A/B/C/D gate on TeleFuser's real-width DiT at 480p, one process per store.

TeleFuser 0.1.0.post3's LingBot-World-fast pipeline with the ``lingbot_world_14b`` preset (40
layers x 40 heads x 128, ffn 13824, text_dim 4096; random bf16 weights built on the GPU), 480x832,
3 chunks, a fork after 2 (``P`` = 2 chunks, ``X``/``Y`` = 1), the full ring. For each store in
``stores`` a child process (``--one STORE``):

1. builds the stack (the DiT, its weights fingerprint, the store with its ``auto`` sizes), timed;
2. runs one warm-up chunk without a cache (CUDA kernels, allocator), not counted;
3. runs the session P+X without a cache (``nocache_before``), the gate (A cold + write, B full hit,
   C 2/3 hit, D cold fork on a fresh trie; no ring check), P+X without a cache again
   (``nocache_after``): the no-cache reference brackets the gate in the same process;
4. with ``profile_b``, a second full hit under cProfile: the profile of B (top functions by
   cumulative time), written beside the results.

The ``nocache`` store runs steps 1-3 without the gate, then (``frames_cache``, with the Wan VAE)
prices keeping each chunk's frames and the decoder's cache beside its KV on the latents of its
last session (`frames_cache.py`; the table's last section). The parent writes one JSON per store as it
finishes (a store that runs out of time leaves the others), then ``results.json`` (machine,
versions, commit, every figure), ``results.md`` (the table: each request's wall and its ratio to
the mean of the bracketing no-cache runs) and prints the table. ``plot_telefuser_480p.py`` draws
the PNG from a results.json.

    python experiments/telefuser_480p/bench_telefuser_480p.py [key=value ...]   # conf/telefuser_480p.yaml
    python experiments/telefuser_480p/bench_telefuser_480p.py device=cpu stores=[nocache,fluxon_plan] \\
        "runtime_overrides=['runtime.n_layers=2','runtime.n_heads=2','runtime.head_dim=14','runtime.ffn_dim=64','runtime.text_dim=48','runtime.height=64','runtime.width=96']"
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from benchlib import REPO, compose, env_info, git_state, write_json  # noqa: E402
from gate_children import child_stack, device_sync, entry, nocache_run, plain, run_children  # noqa: E402

REQUESTS = ("A", "B", "C", "D")


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "telefuser_480p", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "telefuser_480p"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "what": "A/B/C/D gate on TeleFuser's real-width DiT (lingbot_world_14b), one process per store, "
                "no-cache P+X bracketing the gate in the same process",
        "command": " ".join(["python", "experiments/telefuser_480p/bench_telefuser_480p.py", *argv]),
        "config": plain(cfg), "env": {**env_info(), **git_state()},
        "stores": {},
    }
    for store in cfg.stores:
        if store not in cfg.store_overrides:
            raise SystemExit(f"stores: {store!r} has no entry in store_overrides (known: {list(cfg.store_overrides)})")
    t_all = time.perf_counter()
    run_children(Path(__file__), list(cfg.stores), argv, cfg, out_dir, results)
    results["table"] = _table(results)
    write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(_markdown(results))
    try:
        from plot_telefuser_480p import plot, plot_frames_cache

        plot(results, out_dir / "telefuser_480p.png")
        plot_frames_cache(results, out_dir / "frames_cache.png")
    except Exception as exc:  # noqa: BLE001  (the figures are in results.json whatever the plot does)
        print(f"plot failed: {exc!r}", flush=True)
    print(_markdown(results), flush=True)
    print(f"wrote {out_dir / 'results.json'} and results.md ({time.perf_counter() - t_all:.0f} s)", flush=True)
    return results


def run_one(store: str, argv: list[str]) -> None:
    """One store's process (module docstring, steps 1-4); writes ``store_<store>.json``."""
    import cProfile
    import io
    import pstats

    cfg = compose(HERE / "conf", "telefuser_480p", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "telefuser_480p"
    sync = device_sync(cfg.device)
    t0 = time.perf_counter()
    stack, overrides = child_stack(cfg, store, out_dir, store)
    row: dict[str, Any] = {"store": store, "overrides": overrides}
    try:
        factory, gate = stack.runtime_factory, stack.workload
        t1 = time.perf_counter()
        factory.pipeline  # the DiT and its fingerprint (built already when a store sized itself on the device)
        row["build_s"] = {"stack": t1 - t0, "pipeline_after_stack": time.perf_counter() - t1}
        row["notes"], row["runtime"] = list(stack.notes), factory.describe()
        row["weights"] = dict(getattr(factory, "build_timings", {}))
        wait_ready = getattr(stack.store, "wait_ready", None)
        if wait_ready is not None:
            wait_ready(None)
        row["build_s"]["ready"] = time.perf_counter() - t0
        w = row["weights"]
        print(f"  built in {row['build_s']['ready']:.1f} s: {row['runtime']['model']} on {row['runtime']['device']}; "
              f"DiT {w.get('parameters', 0) / 1e9:.2f} B parameters, pipeline in {w.get('pipeline_s', 0):.2f} s, weights "
              f"fingerprint {w.get('fingerprint_s', 0):.3f} s", flush=True)

        last: list = []

        def nocache(actions: list, label: str) -> float:
            """Timed as the gate times a request (`PrefixGate._request`)."""
            wall, runtime = nocache_run(factory, actions, label, sync)
            last[:] = [runtime]
            return wall

        px = gate.P + gate.X
        nocache(px[:1], "warm-up (1 chunk, no cache)")
        row["nocache_before_s"] = nocache(px, "no cache P+X (before)")
        if store != "nocache":
            res = gate.run(stack)
            row["passed"] = res["passed"]
            row["verdicts"] = res["verdicts"]
            row["requests"] = {r["name"]: {k: r[k] for k in ("wall_s", "hit_depth", "bytes_restored", "bytes_written")
                                           if k in r} for r in res["requests"]}
            for name, r in row["requests"].items():
                print(f"  {name}: {r['wall_s']:.3f} s, hit K={r['hit_depth']}", flush=True)
            print(f"  gate {'PASS' if res['passed'] else 'FAIL'} {res['verdicts']}", flush=True)
        row["nocache_after_s"] = nocache(px, "no cache P+X (after)")
        if store == "nocache" and cfg.frames_cache and factory.parts["vae"] == "wan":
            import frames_cache

            m = frames_cache.measure(factory, last[0], sync)
            m["savings"] = frames_cache.savings(m, kv_bytes_per_chunk=factory.geometry.chunk_kv_nbytes(),
                                                hit=len(gate.P))
            row["frames_cache"] = m
            print(f"  frames cache: decode {sum(m['decode_s']):.3f} s + tensor2video {sum(m['tensor2video_s']):.3f} s "
                  f"over {m['chunks']} chunks; decoder cache {max(m['cache_bytes']) / 2**30:.2f} GiB, resume bit-exact "
                  f"{m['resume_bit_exact']}; a full hit would save {m['savings']['full_hit_saves_s']:.3f} s", flush=True)
        if store != "nocache" and cfg.profile_b:
            prof = cProfile.Profile()
            sync()
            start = time.perf_counter()
            prof.enable()
            again = gate._request(stack, "B2", px, "P+X")
            sync()
            prof.disable()
            row["b_profiled"] = {"wall_s": time.perf_counter() - start, "hit_depth": again.hit_depth}
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            (out_dir / f"profile_B_{store}.txt").write_text(text.getvalue())
            row["b_profile_top"] = _profile_rows(prof, 25)
        if store != "nocache":  # a third full hit with its hooks timed: CacheSeek's own time
            from hook_timers import own_time, timed_hooks

            with timed_hooks() as totals:
                again = gate._request(stack, "B3", px, "P+X")
            row["b_hooks"] = {"wall_s": again.wall_s, "hit_depth": again.hit_depth, **totals,
                              "cacheseek_own_s": own_time(totals)}
            print("  its parts (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in totals.items()), flush=True)
            print(f"  B again with its hooks timed: {again.wall_s:.3f} s, hooks {own_time(totals) + totals['copy_wait']:.3f} s"
                  f" of which the copy wait {totals['copy_wait']:.3f} s: CacheSeek's own "
                  f"{own_time(totals) * 1e3:.1f} ms", flush=True)
        row["metrics"] = stack.metrics.as_dict()
    finally:
        stack.close()
    write_json(out_dir / f"store_{store}.json", row)


def _profile_rows(prof: Any, n: int) -> list[dict]:
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, func) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(((k, v) for k, v in stats.items()), key=lambda kv: kv[1][3], reverse=True)[:n]
    return [{"function": f"{Path(f).name}:{line}({func})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
            for (f, line, func), (cc, nc, tt, ct, _) in rows]


def _table(results: dict) -> list[dict]:
    """One row per store: the bracketing no-cache mean and each request with its ratio to it."""
    rows = []
    for store, r in results["stores"].items():
        before, after = r.get("nocache_before_s"), r.get("nocache_after_s")
        base = (before + after) / 2 if before is not None and after is not None else before
        row = {"store": store, "nocache_before_s": before, "nocache_after_s": after, "nocache_mean_s": base,
               "passed": r.get("passed"), "returncode": r.get("returncode"),
               "build_s": (r.get("build_s") or {}).get("ready"),
               "b_profiled_s": (r.get("b_profiled") or {}).get("wall_s"), "skipped": r.get("skipped"),
               "weights_fingerprint_s": (r.get("weights") or {}).get("fingerprint_s"),
               "dit_build_s": (r.get("weights") or {}).get("pipeline_s")}
        for name in REQUESTS:
            req = (r.get("requests") or {}).get(name)
            row[f"{name}_s"] = req["wall_s"] if req else None
            row[f"{name}_ratio"] = req["wall_s"] / base if req and base else None
            row[f"{name}_k"] = req["hit_depth"] if req else None
        rows.append(row)
    return rows


def _markdown(results: dict) -> str:
    e = results["env"]
    lines = [f"# telefuser_480p: {e.get('gpu', 'no GPU')}, torch {e.get('torch')}, git {e.get('git_commit')}"
             f"{' (dirty)' if e.get('git_dirty') else ''}, {e.get('time')}", "",
             "| store | no cache P+X (before / after) | A cold + write | B full hit | C 2/3 hit | D cold fork | gate "
             "| start s (DiT, fingerprint) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in results.get("table") or _table(results):
        def cell(name: str) -> str:
            s, q = row[f"{name}_s"], row[f"{name}_ratio"]
            return "-" if s is None else f"{s:.3f} s ({q:.3f}x)" if q else f"{s:.3f} s"
        nc = "-" if row["nocache_before_s"] is None else \
            f"{row['nocache_before_s']:.3f} / {row['nocache_after_s']:.3f} s" if row["nocache_after_s"] else \
            f"{row['nocache_before_s']:.3f} s"
        gate = "-" if row["passed"] is None else ("PASS" if row["passed"] else "FAIL")
        if row.get("skipped"):
            gate = "skipped (time)"
        if row["returncode"] not in (0, None):
            gate += f" (rc {row['returncode']})"
        build = "-" if row["build_s"] is None else \
            f"{row['build_s']:.1f} ({row['dit_build_s'] or 0:.2f}, {row['weights_fingerprint_s'] or 0:.3f})"
        lines.append(f"| {row['store']} | {nc} | {cell('A')} | {cell('B')} | {cell('C')} | {cell('D')} | {gate} | {build} |")
    lines += ["", "Ratios: wall over the mean of the two no-cache P+X runs of the same process."]
    for store, r in results["stores"].items():
        h = r.get("b_hooks")
        if h:
            lines.append(f"- {store}: a full hit with its hooks timed (B3, {h['wall_s']:.3f} s, K={h['hit_depth']}): "
                         f"CacheSeek's own time {h['cacheseek_own_s'] * 1e3:.1f} ms (on_runtime_created "
                         f"{h['on_runtime_created']:.3f} s, chunk seams {h['on_chunk_control'] + h['on_chunk_finalized']:.3f} s, "
                         f"less the copy wait {h['copy_wait']:.3f} s)")
    lines += _frames_cache_lines(results)
    for store, r in results["stores"].items():
        top = r.get("b_profile_top")
        if top:
            lines += ["", f"## Profile of B (a second full hit, cProfile), {store}: "
                          f"{r['b_profiled']['wall_s']:.3f} s profiled", "",
                      "| function | calls | cumulative s | own s |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| `{t['function']}` | {t['calls']} | {t['cumtime_s']:.3f} | {t['tottime_s']:.3f} |" for t in top[:15]]
    return "\n".join(lines) + "\n"


def _frames_cache_lines(results: dict) -> list[str]:
    """The ``frames_cache`` section: measured parts, and B and C of each store less what keeping
    frames and the decoder cache would save (`frames_cache.savings`)."""
    m = (results["stores"].get("nocache") or {}).get("frames_cache")
    if not m:
        return []
    sv, gib = m["savings"], 2 ** 30
    lines = ["", "## Keeping frames and the decoder cache beside the KV (Wan VAE, measured in the nocache process)", "",
             "| chunk | decode s | tensor2video s | frames MiB | hand-out s | decoder cache GiB | to host s | from host s "
             "| HBM copy s | resume bit-exact |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for k in range(m["chunks"]):
        exact = m["resume_bit_exact"][k - 1] if 0 < k <= len(m["resume_bit_exact"]) else "-"
        lines.append(f"| {k} | {m['decode_s'][k]:.3f} | {m['tensor2video_s'][k]:.3f} | {m['frames_bytes'][k] / 2**20:.1f} "
                     f"| {m['frames_handout_s'][k]:.4f} | {m['cache_bytes'][k] / gib:.2f} | {m['cache_to_host_s'][k]:.3f} "
                     f"| {m['cache_from_host_s'][k]:.3f} | {m['cache_d2d_s'][k]:.4f} | {exact} |")
    lines += ["", f"Replayed decode equals the session's frames: {m['replay_equals_session']}; per session TeleFuser "
                  f"also encodes the prompt ({m.get('encode_prompt_s', 0):.3f} s) and the condition video "
                  f"({m.get('encode_condition_s', 0):.3f} s), hit or not.",
              f"A full hit of {m['chunks']} chunks would save {sv['full_hit_saves_s']:.3f} s; a hit of {sv['partial_hit']} "
              f"then compute {sv['partial_hit_saves_s']:.3f} s (decoder cache from host; "
              f"{sv['partial_hit_saves_hbm_s']:.3f} s from HBM). Store bytes added per chunk: up to "
              f"{max(sv['store_bytes_added_per_chunk']) / gib:.2f} GiB with the decoder cache at every chunk "
              f"({sv['store_bytes_added_ratio']:.1%} of a chunk's KV), frames alone {sv['frames_only_bytes_ratio']:.2%}.", "",
              "| store | B now | B without its VAE work | C now | C without its prefix's VAE work |", "| --- | ---: | ---: | ---: | ---: |"]
    for row in results.get("table") or _table(results):
        if row["B_s"] is not None and row["C_s"] is not None:
            base = row["nocache_mean_s"]
            b, c = row["B_s"] - sv["full_hit_saves_s"], row["C_s"] - sv["partial_hit_saves_s"]
            lines.append(f"| {row['store']} | {row['B_s']:.3f} s ({row['B_ratio']:.3f}x) | {b:.3f} s ({b / base:.3f}x) "
                         f"| {row['C_s']:.3f} s ({row['C_ratio']:.3f}x) | {c:.3f} s ({c / base:.3f}x) |")
    lines += ["", "Projected (the right-hand columns): the measured walls less the measured VAE work a stored copy "
                  "would replace; not run as a restore path."]
    return lines


if __name__ == "__main__":
    entry(main, run_one)
