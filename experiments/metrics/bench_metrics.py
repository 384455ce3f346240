"""What the metrics cost and what the endpoint reports (issue 34).

1. The hot path: each recording call a restore or a live chunk makes (``add``,
   ``record_live_hit``, ``record_transfer``, ``observe_chunk``), timed over ``calls`` calls in 5
   batches (median per call), summed into the recording cost of one restored live chunk.
2. A live-session run (``workload=interactive`` on ``store``, ``geometry``, ``device``) with the
   Prometheus endpoint on a port the OS picks: scraped over loopback HTTP after every session
   (the scrape's wall), then once at the end. From the final scrape: hits against the chunks the
   workload restored (they must be equal), restore bytes and seconds per tier and the bandwidth
   they give against ``link_peak_gibps``, and the per-chunk wall restored vs computed. The ratio
   of one restored chunk's recording cost to its median wall is measured in the same run.

    python experiments/metrics/bench_metrics.py [key=value ...]      # conf/metrics.yaml
"""

from __future__ import annotations

import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import GiB, Progress, compose, env_info, git_state, median, write_json  # noqa: E402


def per_call_us(calls: int) -> dict[str, float]:
    from cacheseek.metrics import CacheMetrics

    m = CacheMetrics()
    ops = {
        "add": lambda: m.add(live_lookups=1),
        "record_live_hit": lambda: m.record_live_hit(3, "memory"),
        "record_transfer": lambda: m.record_transfer("restore", "memory", 3_833_856_000, 0.0712),
        "observe_chunk": lambda: m.observe_chunk(0.0712, restored=True),
        "nothing": lambda: None,  # the loop and the call itself: subtracted from the others
    }
    out = {}
    for name, op in ops.items():
        batches = []
        for _ in range(5):
            n = max(1, calls // 5)
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            batches.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = median(batches)
    base = out.pop("nothing")
    return {k: max(0.0, v - base) for k, v in out.items()}


def scrape(url: str) -> tuple[dict, float]:
    from prometheus_client.parser import text_string_to_metric_families

    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, time.perf_counter() - t0


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def live_run(cfg, run_dir: Path, progress: Progress) -> dict:
    from cacheseek.cli import CONF_DIR
    from cacheseek.metrics_server import MetricsServer
    from cacheseek.orchestrator import build_stack

    overrides = ["workload=interactive", f"+store={cfg.store}", *cfg.store_overrides,
                 f"runtime.geometry={cfg.geometry}", f"runtime.device={cfg.device}", *cfg.runtime_overrides,
                 f"workload.sessions={cfg.sessions}", f"workload.depth={cfg.depth}",
                 f"workload.branching={cfg.branching}"]
    stack = build_stack(compose(Path(CONF_DIR), "config", overrides), run_dir=run_dir)
    scrape_s: list[float] = []
    with MetricsServer(stack.metrics, port=0) as server:
        def after(row: dict) -> None:
            _, dt = scrape(server.url)
            scrape_s.append(dt)
            progress.note(f"session {row['name']}: {row['hit_depth']} restored; scrape {1e3 * dt:.2f} ms")

        try:
            res = stack.workload.run(stack, on_session=after)
            stack.store.flush()
            final, _ = scrape(server.url)
            m = stack.metrics.as_dict()
        finally:
            stack.close()
    f = res["interactive"]
    tiers = sorted({dict(ls)["tier"] for (n, ls) in final if n == "cacheseek_transfer_bytes_sum"})
    bw = {}
    for tier in tiers:
        nbytes = total(final, "cacheseek_transfer_bytes_sum", direction="restore", tier=tier)
        secs = total(final, "cacheseek_transfer_seconds_sum", direction="restore", tier=tier)
        count = total(final, "cacheseek_transfer_seconds_count", direction="restore", tier=tier)
        if count:
            bw[tier] = {"restores": int(count), "bytes": int(nbytes), "seconds": secs,
                        "gib_s": nbytes / secs / GiB if secs else None,
                        "of_link_peak": nbytes / secs / GiB / cfg.link_peak_gibps if secs else None}
    hits = total(final, "cacheseek_hits_total")
    return {"passed": res["passed"], "endpoint": server.url, "sessions": f["sessions"],
            "chunks_restored": f["chunks_restored"], "endpoint_hits": hits,
            "endpoint_lookups": total(final, "cacheseek_lookups_total"), "results_lookups": m["lookups"],
            "consistent": hits == f["chunks_restored"] == m["hits"] and m["restore_bytes"] == sum(
                b["bytes"] for b in bw.values()),
            "restore_by_tier": bw, "scrape_ms_median": 1e3 * median(scrape_s), "scrapes": len(scrape_s),
            "restored_chunk_s_median": f["restored_chunk_s"]["median"],
            "computed_chunk_s_median": f["computed_chunk_s"]["median"],
            "ttff_restored_s_median": f["ttff_restored_s"]["median"],
            "ttff_computed_s_median": f["ttff_computed_s"]["median"]}


def write_md(path: Path, data: dict) -> None:
    c, r = data["per_call_us"], data["run"]
    lines = [f"# metrics: hot-path cost and the endpoint on a live-session run ({data['env']['time']})", "",
             f"commit {data['git'].get('git_commit')}{' (dirty)' if data['git'].get('git_dirty') else ''}; "
             f"{data['env'].get('gpu') or 'CPU'}, {data['env']['cpus']} CPUs, Python {data['env']['python']}, "
             f"torch {data['env'].get('torch')}; {data['config']}", "",
             "| recording call | us per call |", "| --- | --- |"]
    lines += [f"| `{k}` | {v:.2f} |" for k, v in c.items()]
    lines += ["", f"One restored live chunk records `add` + `record_transfer` + `record_live_hit` + `observe_chunk`: "
              f"**{data['chunk_record_us']:.2f} us**, {100 * data['record_over_restored_chunk']:.4f}% of its median "
              f"wall ({1e3 * r['restored_chunk_s_median']:.3f} ms, same run).", "",
              f"Live-session run: PASS={r['passed']}, {r['sessions']} sessions, {r['chunks_restored']} chunks restored; "
              f"endpoint hits {r['endpoint_hits']:.0f}, lookups {r['endpoint_lookups']:.0f} (results.json "
              f"{r['results_lookups']}); consistent: {r['consistent']}; {r['scrapes']} scrapes during the run, "
              f"median {r['scrape_ms_median']:.2f} ms.", "",
              "| tier | restores | GiB | seconds | GiB/s | of link peak |", "| --- | --- | --- | --- | --- | --- |"]
    for tier, b in r["restore_by_tier"].items():
        peak = "-" if b["of_link_peak"] is None else f"{100 * b['of_link_peak']:.1f}%"
        gib_s = "-" if b["gib_s"] is None else f"{b['gib_s']:.3f}"
        lines.append(f"| {tier} | {b['restores']} | {b['bytes'] / GiB:.4f} | {b['seconds']:.4f} | {gib_s} | {peak} |")
    lines += ["", f"Per-chunk wall median: restored {1e3 * r['restored_chunk_s_median']:.3f} ms, computed "
              f"{1e3 * (r['computed_chunk_s_median'] or 0):.3f} ms; time to first frame median: restored "
              f"{1e3 * (r['ttff_restored_s_median'] or 0):.3f} ms, computed {1e3 * (r['ttff_computed_s_median'] or 0):.3f} ms."]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, data: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    c = data["per_call_us"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(c), list(c.values()), color="tab:blue")
    ax.set(xlabel="microseconds per call", title=f"recording cost (restored chunk: {1e3 * data['run']['restored_chunk_s_median']:.2f} ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    cfg = compose(HERE / "conf", "metrics", argv)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(2, "metrics")
    calls = per_call_us(int(cfg.calls))
    progress.step("per call: " + ", ".join(f"{k} {v:.2f} us" for k, v in calls.items()))
    run = live_run(cfg, out / "run", progress)
    progress.step(f"live run: {run['chunks_restored']} chunks restored, endpoint hits {run['endpoint_hits']:.0f}, "
                  f"consistent {run['consistent']}")
    chunk_us = calls["add"] + calls["record_transfer"] + calls["record_live_hit"] + calls["observe_chunk"]
    data = {"env": env_info(), "git": git_state(), "config": " ".join(argv) or "defaults", "per_call_us": calls,
            "chunk_record_us": chunk_us,
            "record_over_restored_chunk": chunk_us * 1e-6 / run["restored_chunk_s_median"], "run": run}
    write_json(out / "results.json", data)
    write_md(out / "results.md", data)
    plot(out / "metrics.png", data)
    print((out / "results.md").read_text())
    return 0 if run["passed"] and run["consistent"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
