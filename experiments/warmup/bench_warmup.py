"""Time from start to the first request served: no cache, the Plan tier warmed in the
foreground (the constructor maps, pre-faults and registers the segment) and in the background
(``store.warmup=background``: the store answers misses while it warms), issue 14. The segment is
faulted and registered in pieces of ``register_piece_bytes`` (``store.register_piece_bytes``);
a mode suffixed ``_onecall`` (``background_onecall``, ``foreground_onecall``) registers it in one
``cudaHostRegister`` call instead, for the comparison in one run.

Per mode and run, in a fresh stack: ``start_to_request_s`` from before the stack is built to the
first request's ``on_runtime_created`` returning (the restore attempt done: the request is being
served), ``first_request_s`` to the end of that whole request, ``store_build_s``; for the
background store also ``ready_s`` (start to warm) and what it did meanwhile (reads served as
misses, writes dropped). Then, once warm, the same request again (it writes) and a third (it
must hit every chunk): the store works after a background warm-up. Ratios against no cache,
measured in this run.

    python experiments/warmup/bench_warmup.py [key=value ...]   # conf/warmup.yaml
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import Progress, compose, env_info, median, write_json  # noqa: E402

ACTIONS = [[0.25, -0.5, 0.0, 1.0], [0.5, 0.25, -0.25, 0.0], [-0.5, 0.0, 0.75, 0.25], [0.0, 0.5, 0.5, -0.75]]


class FirstServed:
    """The binding, with the time its ``on_runtime_created`` returned (the request is served)."""

    def __init__(self, binding) -> None:
        self.binding = binding
        self.served_at = None
        self.hook_s = 0.0

    def on_runtime_created(self, runtime, session_config) -> None:
        t0 = time.perf_counter()
        self.binding.on_runtime_created(runtime, session_config)
        self.served_at = time.perf_counter()
        self.hook_s = self.served_at - t0

    def __getattr__(self, name):
        return getattr(self.binding, name)


def one_run(cfg, mode: str, run_dir: Path, sync) -> dict:
    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack

    overrides = [f"runtime.geometry={cfg.geometry}", f"runtime.device={cfg.device}",
                 "manager.eviction.enabled=false"]
    if mode != "nocache":
        warmup, _, variant = mode.partition("_")
        pieces = 0 if variant == "onecall" else cfg.register_piece_bytes
        overrides += ["+store=fluxon_plan", f"store.segment_bytes={cfg.segment_bytes}", "store.backing=private",
                      f"store.warmup={warmup}", f"store.device={cfg.device}", f"store.register_piece_bytes={pieces}"]
    actions = ACTIONS[: int(cfg.total_chunks)]
    cfg_main = compose(Path(CONF_DIR), "config", overrides)
    t0 = time.perf_counter()
    stack = build_stack(cfg_main, run_dir=run_dir)
    built = time.perf_counter()
    out: dict = {"mode": mode, "store_build_s": built - t0}
    try:
        hooks = None if mode == "nocache" else FirstServed(stack.new_binding())
        rt = stack.runtime_factory.make(actions, hooks=hooks)
        started = time.perf_counter()
        rt.generate()
        sync()
        done = time.perf_counter()
        served = hooks.served_at if hooks is not None else started
        hook_s = hooks.hook_s if hooks is not None else 0.0  # the binding's keys and lookup, not the store
        out.update(start_to_request_s=served - t0, first_request_s=done - t0, binding_hook_s=hook_s,
                   start_to_request_without_hook_s=served - t0 - hook_s,
                   first_hit_depth=getattr(hooks, "last_fast_forward", 0) if hooks else 0)
        if mode != "nocache":
            store = stack.store
            ready = store.wait_ready(600)
            out["ready_s"] = (store.stats.warmup_seconds if warmup == "background" else built - t0)
            out["ready"] = ready
            st = store.stats
            out.update(reads_while_warming=st.reads_while_warming, writes_while_warming=st.writes_while_warming,
                       register_s=st.register_seconds, register_pieces=st.register_pieces,
                       segment_ready_s=st.segment_ready_seconds)
            for name in ("second", "third"):  # once warm: the same request writes, then hits
                b = stack.new_binding()
                r2 = stack.runtime_factory.make(actions, hooks=b)
                r2.generate()
                sync()
                stack.store.flush()
                out[f"{name}_hit_depth"] = b.last_fast_forward
    finally:
        stack.close()
    return out


def main(argv: list[str]) -> dict:
    import torch

    cfg = compose(HERE / "conf", "warmup", argv)
    out_dir = Path(cfg.out_dir)
    cuda = cfg.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    modes, reps = list(cfg.modes), int(cfg.reps)
    results: dict = {"config": {k: cfg[k] for k in cfg}, "env": env_info(), "runs": []}
    prog = Progress(len(modes) * reps + 2, "warmup")
    if int(cfg.warmup_chunks):  # CUDA context and kernels, outside every timed run
        one_run(cfg, "nocache", out_dir / "runs" / "warm", sync)
        prog.step("untimed warm-up run")
    for rep in range(reps):
        for mode in modes:  # interleaved, so that drift hits every mode alike
            r = one_run(cfg, mode, out_dir / "runs" / f"{mode}{rep}", sync)
            r["rep"] = rep
            results["runs"].append(r)
            write_json(out_dir / "results.json", results)
            prog.step(f"{mode:10s} start->request {r['start_to_request_s']:.3f} s, first request "
                      f"{r['first_request_s']:.2f} s, ready {r.get('ready_s', 0):.2f} s, "
                      f"hits {r.get('second_hit_depth', '-')}/{r.get('third_hit_depth', '-')}")
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    summary = {}
    for mode in modes:
        rows = [r for r in results["runs"] if r["mode"] == mode]
        summary[mode] = {k: median([r[k] for r in rows]) for k in
                         ("start_to_request_s", "start_to_request_without_hook_s", "binding_hook_s",
                          "first_request_s", "store_build_s", "ready_s", "register_s", "register_pieces")
                         if k in rows[0]}
        summary[mode]["third_hit_depth"] = min((r.get("third_hit_depth", 0) for r in rows), default=0)
    base = summary.get("nocache", {}).get("start_to_request_s")
    for mode, s in summary.items():
        s["start_to_request_over_nocache"] = s["start_to_request_s"] / base if base else None
        s["without_hook_over_nocache"] = s["start_to_request_without_hook_s"] / base if base else None
    results["summary"] = summary
    bg = summary.get("background")
    results["targets"] = {
        "background_in_pieces_before_one_call": None if not bg or "background_onecall" not in summary else
            bg["start_to_request_s"] <= summary["background_onecall"]["start_to_request_s"],
        "background_start_to_request_within_5pct_of_nocache":
            None if not bg or not base else bg["start_to_request_s"] <= 1.05 * base,
        "background_without_the_binding_hook_within_5pct_of_nocache":
            None if not bg or not base else bg["start_to_request_without_hook_s"] <= 1.05 * base,
        "background_hits_once_warm": None if not bg else bg["third_hit_depth"] == int(cfg.total_chunks),
    }
    write_json(out_dir / "results.json", results)
    lines = ["| mode | start -> first request served s | / no cache | binding hook s | without the hook / no cache "
             "| first request done s | store built s | ready s | register s (pieces) | hit once warm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        lines.append(f"| {mode} | {s['start_to_request_s']:.3f} | {s['start_to_request_over_nocache']:.3f} | "
                     f"{s['binding_hook_s']:.3f} | {s['without_hook_over_nocache']:.3f} | "
                     f"{s['first_request_s']:.3f} | {s['store_build_s']:.3f} | {s.get('ready_s', 0):.2f} | "
                     f"{s.get('register_s', 0):.3f} ({s.get('register_pieces', 0):.0f}) | "
                     f"{s['third_hit_depth'] if mode != 'nocache' else '-'} |")
    table = "\n".join(lines)
    (out_dir / "summary.md").write_text(table + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in results["targets"].items()) + "\n")
    print(table)
    print(results["targets"])
    _plot(summary, out_dir / "warmup.png")
    prog.step(f"results in {out_dir}")
    return results


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(summary)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(modes, [summary[m]["start_to_request_s"] for m in modes], label="start -> first request served")
    ready = [summary[m].get("ready_s", 0) for m in modes]
    ax.scatter(modes, ready, color="tab:red", zorder=3, label="store ready")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


if __name__ == "__main__":
    main(sys.argv[1:])
