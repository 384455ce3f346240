"""Registration benchmark: time to ready of a fresh Plan segment, as `PlanTierStore` warm-up does
it, with stage timers, for several sizes and three modes:

- ``cold``: an anonymous MAP_SHARED segment, no pre-fault: ``cudaHostRegister`` faults every page;
- ``warmed``: the same segment pre-faulted by libc ``madvise(MADV_POPULATE_WRITE)`` from several
  threads, then registered;
- ``hugepages``: an anonymous MAP_PRIVATE segment advised MADV_HUGEPAGE (2 MiB pages where THP is
  ``madvise``), pre-faulted from several threads, then registered.

Figures are seconds and s/GiB per stage (map, fault, register) and in total.

    python experiments/registration/bench_registration.py [key=value ...]   # conf/registration.yaml
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import GiB, Progress, compose, env_info, meminfo, plain, write_json  # noqa: E402

MODES = {
    "cold": dict(backing="shared", hugepages=False, prefault=False),
    "warmed": dict(backing="shared", hugepages=False, prefault=True),
    "hugepages": dict(backing="private", hugepages=True, prefault=True),
}


def measure(size: int, mode: str, threads: int, cuda: bool) -> dict:
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.stores.plan_tier import PlanTierStore

    opts = MODES[mode]
    if cuda:
        from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

        runtime = CudaTransferRuntime()
    else:
        from cacheseek.transfer.host_transfer import HostTransferRuntime

        runtime = HostTransferRuntime()
    mem_before = meminfo()
    client = EmbeddedPlanClient(segment_bytes=size, prefault_threads=threads, backing=opts["backing"],
                                hugepages=opts["hugepages"], prefault=opts["prefault"])
    t0 = time.perf_counter()
    store = PlanTierStore(plan_client=client, transfer=runtime, overlap=False)
    ready = time.perf_counter() - t0
    s = store.stats
    mem_after = meminfo()
    t1 = time.perf_counter()
    store.close()
    client.close()
    runtime.close()
    teardown = time.perf_counter() - t1
    gib = size / GiB
    return dict(
        size_gib=gib, mode=mode, time_to_ready_s=ready, s_per_gib=ready / gib,
        map_s=s.map_seconds, fault_s=s.fault_seconds, register_s=s.register_seconds,
        fault_s_per_gib=s.fault_seconds / gib, register_s_per_gib=s.register_seconds / gib,
        fault_method=s.fault_method, fault_threads=s.fault_threads, huge_page_bytes=s.huge_page_bytes,
        huge_fraction=(s.huge_page_bytes / size) if s.huge_page_bytes >= 0 else None,
        warmup_s=s.warmup_seconds, teardown_s=teardown, mem_before=mem_before, mem_after=mem_after,
        mappings=list(s.mappings),
    )


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "registration", argv)
    cuda = cfg.device == "cuda"
    if cuda:
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")  # the CUDA context first, outside every timing
    out_dir = Path(cfg.out_dir)
    plan = [(float(g), m) for g in cfg.sizes_gib for m in cfg.modes
            if m != "cold" or float(g) in [float(x) for x in cfg.cold_sizes_gib]]
    if cfg.repeat_first and plan:
        plan.append(plan[0])
    results: dict = {"config": plain(cfg), "env": env_info(), "rows": []}
    prog = Progress(len(plan), "registration")
    for size_gib, mode in plan:
        gc.collect()
        r = measure(int(size_gib * GiB), mode, int(cfg.prefault_threads), cuda)
        r["repeat"] = any(x["mode"] == mode and x["size_gib"] == r["size_gib"] for x in results["rows"])
        results["rows"].append(r)
        write_json(out_dir / "results.json", results)
        huge = f", {100 * r['huge_fraction']:.0f}% in 2 MiB pages" if r["huge_fraction"] is not None else ""
        prog.step(f"{size_gib:5g} GiB {mode:9s} ready in {r['time_to_ready_s']:6.2f} s = {r['s_per_gib']:.3f} s/GiB "
                  f"(map {r['map_s']:.2f}, fault {r['fault_s']:.2f} [{r['fault_method']} x{r['fault_threads']}], "
                  f"register {r['register_s']:.2f}{huge}; teardown {r['teardown_s']:.2f} s)")
    results["target_64gib_warmup_s_per_gib"] = min(
        (r["s_per_gib"] for r in results["rows"] if r["size_gib"] == 64 and r["mode"] != "cold"), default=None)
    write_json(out_dir / "results.json", results)
    _plot(results, out_dir / "registration.png")
    print(f"results in {out_dir}")
    return results


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [f"{r['size_gib']:g} GiB {r['mode']}{' (again)' if r.get('repeat') else ''}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for key, color in (("map_s", "#999999"), ("fault_s", "#e08a1e"), ("register_s", "#2b7bba")):
        vals = [r[key] / r["size_gib"] for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=key.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i] + 0.005, f"{r['s_per_gib']:.3f}\n({r['time_to_ready_s']:.1f} s)", ha="center", fontsize=7)
    ax.axhline(0.15, color="k", ls="--", lw=0.8, label="target 0.15 s/GiB")
    ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("s/GiB to ready (stacked stages)")
    ax.set_title(f"Plan segment warm-up on {results['env'].get('gpu', 'cpu')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)



if __name__ == "__main__":
    main(sys.argv[1:])
