"""End-to-end benchmark: the A/B/C/D gate (docs/design.md section 5) at lingbot_480p geometry with real
GPU compute per chunk, in one process, for several stores:

- ``nocache``: the runtime with no hooks at all (pure compute), requests P+X and P+Y;
- ``per_tensor``: the per-tensor baseline store (owned pageable CPU copies one tensor at a time);
- ``plan_sync``: the Plan tier (embedded client), writes synchronous;
- ``plan_overlap``: the Plan tier, chunk i's write overlapping chunk i+1's compute (the D2H in
  pieces of 32 MiB, two in flight);
- ``plan_overlap_onebatch``: the same with the D2H as one batch (the runtime's own device-to-host
  copies then wait behind it on the copy engine).

Compute model: the synthetic runtime with ``compute`` GEMMs (conf/e2e.yaml states the FLOPs).
Per request: wall time (generate + flush), restore seconds (on_runtime_created), write seconds
(the on_chunk_finalized hooks, timed after the chunk's GPU work has finished, so compute is not
counted as writing), flush seconds, hit depth, and the gate verdict (frame hashes). One table of
ratios against the no-cache run and the per-tensor baseline, all measured in this run.

    python experiments/e2e/bench_e2e.py [key=value ...]   # conf/e2e.yaml
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import GiB, Progress, TimedHooks, compose, env_info, gib_s, median, plain, write_json  # noqa: E402


def make_gate(cfg_main, sync, timings: dict):
    from cacheseek.workloads.prefix_gate import PrefixGate, RequestResult

    class TimedGate(PrefixGate):
        def _request(self, stack, name, actions, label, *, manager=None, ingest=True):
            hooks = TimedHooks(stack.new_binding(manager, ingest_enabled=ingest), sync)
            rt = stack.runtime_factory.make(actions, hooks=hooks)
            sync()
            t0 = time.perf_counter()
            hashes = rt.generate()
            sync()
            t1 = time.perf_counter()
            stack.store.flush()
            t2 = time.perf_counter()
            timings[name] = dict(restore_s=hooks.restore_s, write_s=hooks.write_s, write_s_per_chunk=hooks.write_s_per_chunk,
                                 flush_s=t2 - t1, generate_s=t1 - t0)
            k = hooks.last_fast_forward
            return RequestResult(name=name, actions=label, hit_depth=k, chunks_computed=self.n - k,
                                 wall_s=t2 - t0, bytes_restored=hooks.bytes_restored,
                                 bytes_written=hooks.bytes_written,
                                 frame_hashes=[h if isinstance(h, str) else h.hex() for h in hashes])

    w = cfg_main.workload
    return TimedGate(total_chunks=w.total_chunks, prefix_chunks=w.prefix_chunks, ring_check=w.ring_check,
                     action_seed=w.action_seed, action_dim=w.action_dim)


def run_nocache(stack, gate, sync) -> dict:
    rows = []
    for name, actions, label in (("A", gate.P + gate.X, "P+X"), ("C", gate.P + gate.Y, "P+Y")):
        rt = stack.runtime_factory.make(actions, hooks=None)
        sync()
        t0 = time.perf_counter()
        hashes = rt.generate()
        sync()
        rows.append(dict(name=name, actions=label, hit_depth=0, chunks_computed=gate.n, wall_s=time.perf_counter() - t0,
                         restore_s=0.0, write_s=0.0, flush_s=0.0, bytes_restored=0, bytes_written=0,
                         frame_hashes=[h.hex() for h in hashes]))
        del rt
    return {"requests": rows, "passed": None}


def same_run_peak(nbytes: int, cuda: bool) -> dict:
    import torch

    if not cuda:
        return {"h2d": None, "d2h": None}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(0x5A)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    out = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)), ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        secs = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                fn()
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        out[name] = gib_s(nbytes, median(secs[1:]))
    return out


def main(argv: list[str]) -> dict:
    import torch

    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack

    cfg = compose(HERE / "conf", "e2e", argv)
    out_dir = Path(cfg.out_dir)
    modes = list(cfg.modes)
    cuda = cfg.device == "cuda"
    common = [
        f"runtime.geometry={cfg.geometry}", f"runtime.device={cfg.device}",
        f"runtime.compute_gemm_dim={cfg.gemm_dim}", f"runtime.compute_gemms={cfg.gemms}",
        "runtime.handout=false",  # the KV restore path (issue 32: a handed-out hit restores no KV)
        f"workload.total_chunks={cfg.total_chunks}", f"workload.prefix_chunks={cfg.prefix_chunks}",
        "workload.ring_check=false", "manager.eviction.enabled=false", *cfg.extra,
    ]
    plan = ["+store=fluxon_plan", f"store.segment_bytes={cfg.segment_bytes}", "store.backing=private"]
    stores = {
        "nocache": [],
        "per_tensor": ["+store=per_tensor"],
        "plan_sync": plan + ["store.overlap=false"],
        "plan_overlap": plan + ["store.overlap=true", f"store.staging_slot_bytes={cfg.staging_slot_bytes}"],
        # the overlapped D2H as one batch: the runtime's own D2H copies queue behind it
        "plan_overlap_onebatch": plan + ["store.overlap=true", f"store.staging_slot_bytes={cfg.staging_slot_bytes}",
                                         "store.write_piece_bytes=0"],
    }

    def sync() -> None:
        if cuda:
            torch.cuda.current_stream().synchronize()  # the producer stream only: side streams keep going

    results: dict = {"config": plain(cfg), "overrides": {m: common + stores[m] for m in modes},
                     "env": env_info(), "modes": {}}
    prog = Progress(len(modes) + 2, "e2e")
    results["peak"] = same_run_peak(int(cfg.peak_bytes), cuda)
    prog.step(f"same-process peak: {results['peak']}")

    for mode in modes:
        overrides = common + stores[mode]
        cfg_main = compose(Path(CONF_DIR), "config", overrides)
        t0 = time.perf_counter()
        stack = build_stack(cfg_main, run_dir=out_dir / "runs" / mode)
        build_s = time.perf_counter() - t0
        if int(cfg.warmup_chunks) and not results.get("warmed"):
            rt = stack.runtime_factory.make([[0.0] * 4] * int(cfg.warmup_chunks), hooks=None)
            t1 = time.perf_counter()
            rt.generate()
            sync()
            results["warmed"] = time.perf_counter() - t1
            prog.note(f"warm-up chunk: {results['warmed']:.2f} s")
            del rt
        timings: dict = {}
        gate = make_gate(cfg_main, sync, timings)
        try:
            if mode == "nocache":
                res = run_nocache(stack, gate, sync)
            else:
                res = gate.run(stack)
                for r in res["requests"]:
                    r.update(timings.get(r["name"], {}))
            stats = getattr(stack.store, "stats", None)
            res["store_stats"] = stats.as_dict() if hasattr(stats, "as_dict") else None
        finally:
            stack.close()
        res["stack_build_s"] = build_s
        res.pop("frame_hashes", None)
        results["modes"][mode] = res
        write_json(out_dir / "results.json", results)
        walls = ", ".join(f"{r['name']} {r['wall_s']:.2f} s (K={r['hit_depth']})" for r in res["requests"])
        prog.step(f"{mode:12s} gate {res.get('passed')}: {walls}; store built in {build_s:.1f} s")
        del stack, gate
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    results["summary"] = summarize(results)
    write_json(out_dir / "results.json", results)
    table = render(results)
    (out_dir / "summary.md").write_text(table + "\n")
    print(table)
    _plot(results, out_dir / "e2e.png")
    prog.step(f"results in {out_dir}")
    return results


def _req(results, mode, name):
    for r in results["modes"].get(mode, {}).get("requests", []):
        if r["name"] == name:
            return r
    return None


def summarize(results: dict) -> dict:
    out: dict = {"rows": [], "ratios": {}}
    base_a = _req(results, "nocache", "A")
    base_c = _req(results, "nocache", "C")
    for mode, res in results["modes"].items():
        row = {"mode": mode, "gate": res.get("passed")}
        for name in "ABCD":
            r = _req(results, mode, name)
            if r is None:
                continue
            row[f"{name}_wall_s"] = r["wall_s"]
            row[f"{name}_restore_s"] = r.get("restore_s", 0.0)
            row[f"{name}_write_s"] = r.get("write_s", 0.0)
            row[f"{name}_flush_s"] = r.get("flush_s", 0.0)
            row[f"{name}_K"] = r["hit_depth"]
        if base_a and "A_wall_s" in row:
            row["A_over_nocache"] = row["A_wall_s"] / base_a["wall_s"]
        if base_c and "C_wall_s" in row:
            row["C_over_nocache_cold"] = row["C_wall_s"] / base_c["wall_s"]
        b = _req(results, mode, "B")
        peak = (results.get("peak") or {}).get("h2d")
        if b and b["hit_depth"] and peak:
            ideal = b["bytes_restored"] / (peak * GiB)
            row["B_restore_over_bytes_per_peak"] = b.get("restore_s", 0.0) / ideal if ideal else None
            row["B_restore_gib_s"] = gib_s(b["bytes_restored"], b.get("restore_s", 0.0))
        out["rows"].append(row)
    by = {r["mode"]: r for r in out["rows"]}
    pt = by.get("per_tensor")
    for mode in ("plan_sync", "plan_overlap", "plan_overlap_onebatch"):
        p = by.get(mode)
        if not p or not pt:
            continue
        out["ratios"][mode] = {
            "B_wall_speedup_vs_per_tensor": pt.get("B_wall_s", 0) / p["B_wall_s"] if p.get("B_wall_s") else None,
            "B_restore_speedup_vs_per_tensor": pt.get("B_restore_s", 0) / p["B_restore_s"] if p.get("B_restore_s") else None,
            "A_write_speedup_vs_per_tensor": pt.get("A_write_s", 0) / p["A_write_s"] if p.get("A_write_s") else None,
            "A_wall_speedup_vs_per_tensor": pt.get("A_wall_s", 0) / p["A_wall_s"] if p.get("A_wall_s") else None,
            "C_wall_speedup_vs_per_tensor": pt.get("C_wall_s", 0) / p["C_wall_s"] if p.get("C_wall_s") else None,
        }
    return out


def render(results: dict) -> str:
    s = results["summary"]
    head = ("| mode | gate | A wall s | A/no-cache | A write s (hooks) | A flush s | B wall s | B restore s "
            "| B restore / (bytes/peak) | C wall s | D wall s |")
    lines = [head, "|" + " --- |" * head.count("|")[:-1] if False else "|" + "---|" * (head.count("|") - 1)]
    for r in s["rows"]:
        def f(k, fmt="{:.3f}"):
            v = r.get(k)
            return "" if v is None else fmt.format(v)
        gate = {True: "PASS", False: "FAIL", None: "n/a"}[r["gate"]]
        lines.append(f"| {r['mode']} | {gate} | {f('A_wall_s', '{:.2f}')} | {f('A_over_nocache')} | {f('A_write_s')} | "
                     f"{f('A_flush_s')} | {f('B_wall_s', '{:.2f}')} | {f('B_restore_s')} | "
                     f"{f('B_restore_over_bytes_per_peak')} | {f('C_wall_s', '{:.2f}')} | {f('D_wall_s', '{:.2f}')} |")
    lines.append("")
    lines.append("| Plan mode | B wall speed-up vs per-tensor | B restore speed-up | A write speed-up | A wall speed-up | C wall speed-up |")
    lines.append("|---|---|---|---|---|---|")
    for mode, q in s["ratios"].items():
        def g(k):
            v = q.get(k)
            return "" if v is None else f"{v:.2f}x"
        lines.append(f"| {mode} | {g('B_wall_speedup_vs_per_tensor')} | {g('B_restore_speedup_vs_per_tensor')} | "
                     f"{g('A_write_speedup_vs_per_tensor')} | {g('A_wall_speedup_vs_per_tensor')} | {g('C_wall_speedup_vs_per_tensor')} |")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    names = "ABCD"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        walls = [(_req(results, mode, n) or {}).get("wall_s", 0) for n in names]
        axes[0].bar([j + i * width for j in range(4)], walls, width, label=mode)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(4)], [f"{n}" for n in names])
    axes[0].set_ylabel("wall s per request")
    axes[0].set_title("A cold P+X, B hit all, C hit prefix + 2 chunks, D cold P+Y")
    axes[0].legend(fontsize=8)
    restore = [(_req(results, m, "B") or {}).get("restore_s", 0) for m in modes]
    write = [(_req(results, m, "A") or {}).get("write_s", 0) for m in modes]
    x = range(len(modes))
    axes[1].bar([j - 0.2 for j in x], restore, 0.4, label="B restore s (3 chunks)")
    axes[1].bar([j + 0.2 for j in x], write, 0.4, label="A write s on the request path (3 chunks)")
    axes[1].set_xticks(list(x), modes, fontsize=8)
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=8)
    axes[1].set_title("cache time on the request path")
    fig.suptitle(f"lingbot_480p A/B/C/D on {results['env'].get('gpu', 'cpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)



if __name__ == "__main__":
    main(sys.argv[1:])
