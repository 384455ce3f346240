"""Hit rate against the number of workers, with the shared index and without it, in one run.

Every case is one ``tools/workers.py`` run: N worker processes started at once (a start barrier
once each has its cold references) on one LocalDisk root, session ``i`` on worker ``i % N``, each
checking every session's frames against its own cold run. Cases:

- ``interactive`` (live sessions, one action per chunk; ``workload.sessions=48``: 192 chunks, 50
  distinct prefixes, at most 142 restorable) and ``stress`` (whole planned sessions on 3 threads
  a worker, unbounded store) at 1, 2 and 4 workers, index on and off (``--no-index``: each
  worker finds only what its own trie holds, the behaviour before the shared index); one process
  on the in-memory store for reference;
- the restart case: the workers exit after session ``restart_after - 1`` and a fresh set runs the
  rest; its second half's chunks restored against the same sessions' without a restart, and how
  fast a restarted worker is warm (its first session: chunks restored, seconds);
- the added cost per cold chunk: one process with the index on and off, ``cost_reps`` times:
  the median time of a computed chunk (the same 50 chunks computed either way), and the record
  probes a computed chunk pays (``records.probe_p50_ms`` / ``probe_p99_ms`` from the metrics);
- the record operations themselves (``ops``), in this process, per store (memory, LocalDisk with
  its default durable commit), ``ops_reps`` times each, p50/p99: a probe of one key (hit, miss)
  and of 8, a claim, a publication, a claim's release, and what the index adds to one cold chunk
  (the sequence a computed live chunk runs: its probe, the claim, the re-check, the ingest's
  probe, the record, the release) next to writing that chunk's values (tiny geometry: 4 KV
  values and the latent), interleaved rep by rep.

Ratios are against one process on LocalDisk measured in the same run. Writes ``results.json``,
``results.md`` and ``hit_rate.png`` to ``out_dir``; each run's work folder (root, logs) goes
under ``runs_dir``. A progress line per run.

    python experiments/shared_index/bench_workers.py [key=value ...]   # conf/bench_workers.yaml
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import REPO, Progress, compose, env_info, write_json  # noqa: E402

WORKERS = REPO / "tools" / "workers.py"


def run_tool(label: str, runs_dir: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """One tools/workers.py run in its own fresh work folder: its results.json, plus the wall time."""
    workdir = runs_dir / label
    shutil.rmtree(workdir, ignore_errors=True)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(WORKERS), "--workdir", str(workdir),
                          "--worker-timeout", str(timeout_s), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=2 * timeout_s + 120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - t0
    path = workdir / "results.json"
    if not path.exists():
        raise RuntimeError(f"{label}: tools/workers.py exited {out.returncode} without results:\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = json.loads(path.read_text())
    res["wall_s"] = round(wall, 2)
    res["returncode"] = out.returncode
    return res


def figures(label: str, workload: str, store: str, workers: int, index: bool, res: dict[str, Any],
            restart_after: Optional[int], half: int) -> dict[str, Any]:
    """What the tables need from one run's results."""
    procs = res["processes"]
    metrics = [p["metrics"] for p in procs]
    records = [m.get("records") or {} for m in metrics]
    computed = res["all"]["chunks_total"] - res["all"]["chunks_restored"]
    p50s = [r["probe_p50_ms"] for r in records if r.get("probe_p50_ms") is not None]
    p99s = [r["probe_p99_ms"] for r in records if r.get("probe_p99_ms") is not None]
    row = {
        "label": label, "workload": workload, "store": store, "workers": workers, "index": index,
        "restart_after": restart_after, "passed": res["passed"], "mismatches": res["mismatches"],
        "failures": len(res["failures"]), "chunks_restored": res["all"]["chunks_restored"],
        "chunks_total": res["all"]["chunks_total"], "hit_rate": res["all"]["hit_rate"], "wall_s": res["wall_s"],
        "chunks_computed": computed,
        "adopted": sum(m["index_adopted"] for m in metrics),
        "published": sum(r.get("published", 0) for r in records),
        "already_there": sum(r.get("already_there", 0) for r in records),
        "claims": sum(m["index_claims"] for m in metrics), "waits": sum(m["index_waits"] for m in metrics),
        "wait_adopted": sum(m["index_wait_adopted"] for m in metrics),
        "wait_s": round(sum(m["index_wait_seconds"] for m in metrics), 4),
        "record_probes": sum(r.get("probes", 0) for r in records),
        "probe_p50_ms": statistics.median(p50s) if p50s else None, "probe_p99_ms": max(p99s) if p99s else None,
        "writes": sum(m["writes"] for m in metrics),
    }
    if workload == "interactive":
        medians = [p["figures"]["computed_chunk_s"]["median"] for p in procs
                   if p["figures"]["computed_chunk_s"]["median"] is not None]
        row["computed_chunk_ms"] = 1e3 * statistics.median(medians) if medians else None
        cold = [p["figures"]["cold_chunk_s"]["median"] for p in procs if p["figures"]["cold_chunk_s"]["median"]]
        row["cold_chunk_ms"] = 1e3 * statistics.median(cold) if cold else None
    if restart_after is not None:
        row["after_restart"] = res["after_restart"]
        row["restarted_first_sessions"] = res["restarted_first_sessions"]
    else:  # the sessions a restart case runs after its restart, for comparison
        row["second_half_restored"] = sum(r["hit_depth"] for r in res["sessions"] if r["session"] >= half)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    cfg = compose(HERE / "conf", "bench_workers", argv)
    out_dir, runs_dir = REPO / cfg.out_dir, REPO / cfg.runs_dir
    timeout = float(cfg.worker_timeout)
    extra = list(cfg.extra)
    loads = {name: list(cfg[name]) for name in ("interactive", "stress") if cfg[name] is not None}  # null: skipped
    plan: list[tuple[str, str, str, int, bool, Optional[int], list[str]]] = []
    for workload, overrides in loads.items():
        plan.append((f"{workload}-memory-1", workload, "memory", 1, True, None, overrides))
        for n in cfg.workers:
            for index in (True, False):
                plan.append((f"{workload}-localdisk-{n}-{'index' if index else 'noindex'}", workload, "localdisk",
                             n, index, None, overrides))
    for n in cfg.restart_workers if "interactive" in loads else ():
        for index in (True, False):
            plan.append((f"interactive-restart-{n}-{'index' if index else 'noindex'}", "interactive", "localdisk",
                         n, index, int(cfg.restart_after), loads["interactive"]))
    for rep in range(1, int(cfg.cost_reps) if "interactive" in loads else 0):
        for index in (True, False):
            plan.append((f"cost-{rep}-{'index' if index else 'noindex'}", "interactive", "localdisk", 1, index, None,
                         loads["interactive"]))
    progress = Progress(len(plan), "shared_index")
    env = env_info()
    env["git_commit_full"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()
    env["git_dirty"] = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                           capture_output=True, text=True).stdout.strip())
    env["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    progress.note(f"record operations, {cfg.ops_reps} reps per store")
    op_costs = ops(int(cfg.ops_reps), runs_dir / "ops")
    rows = []
    for label, workload, store, n, index, restart, overrides in plan:
        args = ["--workers", str(n), "--store", store, "--workload", workload]
        args += [] if index else ["--no-index"]
        args += [] if restart is None else ["--restart-after", str(restart)]
        res = run_tool(label, runs_dir, args + overrides + extra, timeout)
        row = figures(label, workload, store, n, index, res, restart, int(cfg.restart_after))
        rows.append(row)
        progress.step(f"{label}: {row['chunks_restored']} of {row['chunks_total']} restored "
                      f"({100 * row['hit_rate']:.1f}%), {'PASS' if row['passed'] else 'FAIL'}, {row['wall_s']:.0f} s")
    env["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    results = {"config": {k: (list(v) if not isinstance(v, (str, int, float, type(None))) else v) for k, v in cfg.items()},
               "env": env, "runs": rows, "ops": op_costs, "summary": summarize(rows)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(table(results))
    plot(results, out_dir / "hit_rate.png")
    print(table(results))
    return results


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]


def ops(reps: int, root: Path) -> dict[str, Any]:
    """Each record operation timed ``reps`` times per store (ms, p50 and p99): see the module
    docstring. Fresh keys for every rep (a miss stays a miss, a claim is new)."""
    import torch

    from cacheseek.kv.handles import Tier
    from cacheseek.kv.locators import kv_locator, latent_locator
    from cacheseek.kv.records import ChunkRecord
    from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
    from cacheseek.stores.localdisk import LocalDiskTierStore
    from cacheseek.stores.memory import InMemoryTierStore

    g = SyntheticRuntimeFactory(geometry="tiny").geometry
    value = torch.zeros(g.chunk_kv_nbytes(2) // (4 * g.n_layers), dtype=torch.bfloat16)  # one K (or V) of a layer
    latent = torch.zeros(g.latent_nbytes(2) // 2, dtype=torch.bfloat16)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)  # a store makes its root, never the folders above it
    out: dict[str, Any] = {}
    for name, store in (("memory", InMemoryTierStore()), ("localdisk", LocalDiskTierStore(root / "kv"))):
        r, t = store.records, {k: [] for k in ("find_miss", "find_hit", "find_8_hits", "find_8_misses", "claim",
                                               "publish", "drop_claim", "index_per_cold_chunk", "chunk_values_write")}
        parent = os.urandom(32)
        hits = []
        for i in range(reps):
            key = os.urandom(32)
            record = ChunkRecord(node_key=key, parent_key=parent, root_hash=parent, depth=1, n_layers=g.n_layers,
                                 nbytes=g.chunk_kv_nbytes(2))
            t0 = time.perf_counter()  # the values of a chunk, as the ingest writes them
            store.put_skeleton(latent_locator(key), latent)
            store.put_async(kv_locator(key), [(value, value)] * g.n_layers, tier=Tier.DISK)
            t1 = time.perf_counter()  # what the index adds to that cold chunk
            r.find([key])
            r.claim(key)
            r.find([key])
            r.find([key])
            r.publish(record)
            r.drop_claim(key)
            t2 = time.perf_counter()
            t["chunk_values_write"].append(t1 - t0)
            t["index_per_cold_chunk"].append(t2 - t1)
            hits.append(key)
            miss = [os.urandom(32) for _ in range(8)]
            for op, fn in (("find_miss", lambda: r.find(miss[:1])), ("find_hit", lambda: r.find([key])),
                           ("find_8_hits", lambda: r.find(hits[-8:])), ("find_8_misses", lambda: r.find(miss))):
                t0 = time.perf_counter()
                fn()
                t[op].append(time.perf_counter() - t0)
            other = os.urandom(32)
            for op, fn in (("claim", lambda: r.claim(other)), ("drop_claim", lambda: r.drop_claim(other)),
                           ("publish", lambda: r.publish(attrs_evolve(record, node_key=other)))):
                t0 = time.perf_counter()
                fn()
                t[op].append(time.perf_counter() - t0)
        store.close()
        out[name] = {op: {"p50_ms": _p(xs, 0.5), "p99_ms": _p(xs, 0.99)} for op, xs in t.items()}
        out[name]["index_over_values_write_p50"] = (out[name]["index_per_cold_chunk"]["p50_ms"]
                                                    / out[name]["chunk_values_write"]["p50_ms"])
    shutil.rmtree(root, ignore_errors=True)
    return out


def attrs_evolve(record: Any, **changes: Any) -> Any:
    import attrs

    return attrs.evolve(record, **changes)


def _row(rows: list[dict], **match: Any) -> Optional[dict]:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and not r["label"].startswith("cost-")]
    return found[0] if found else None


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The headline figures: hit rates against the 1-process baseline, the restart, the cost."""
    out: dict[str, Any] = {"hit_rate": {}, "restart": [], "cost": {}}
    for workload in ("interactive", "stress"):
        base = _row(rows, workload=workload, store="localdisk", workers=1, index=True, restart_after=None)
        for r in rows:
            if r["workload"] == workload and r["restart_after"] is None and not r["label"].startswith("cost-"):
                r["vs_one_process"] = r["hit_rate"] / base["hit_rate"] if base and base["hit_rate"] else None
                r["points_below_one_process"] = round(100 * (base["hit_rate"] - r["hit_rate"]), 2) if base else None
        out["hit_rate"][workload] = {r["label"]: {"hit_rate": r["hit_rate"], "vs_one_process": r.get("vs_one_process"),
                                                  "points_below_one_process": r.get("points_below_one_process")}
                                     for r in rows if r["workload"] == workload and r["restart_after"] is None
                                     and not r["label"].startswith("cost-")}
    for r in rows:
        if r["restart_after"] is None:
            continue
        same = _row(rows, workload="interactive", store="localdisk", workers=r["workers"], index=r["index"],
                    restart_after=None)
        firsts = r["restarted_first_sessions"]
        out["restart"].append({
            "workers": r["workers"], "index": r["index"],
            "second_half_restored": r["after_restart"]["chunks_restored"],
            "second_half_chunks": r["after_restart"]["chunks_total"],
            "no_restart_second_half_restored": same["second_half_restored"] if same else None,
            "vs_no_restart": (r["after_restart"]["chunks_restored"] / same["second_half_restored"]
                              if same and same["second_half_restored"] else None),
            "first_session_restored": sum(f["chunks_restored"] for f in firsts),
            "first_session_chunks": sum(f["chunks"] for f in firsts),
            "first_session_s": statistics.median(f["seconds"] for f in firsts) if firsts else None,
            "process_start_to_first_session_end_s": statistics.median(f["process_start_to_end_s"] for f in firsts)
            if firsts else None,
        })
    pairs = [(r, _cost_pair(rows, r)) for r in rows if r["workload"] == "interactive" and r["workers"] == 1
             and r["store"] == "localdisk" and r["index"] and r["restart_after"] is None]
    on = [r["computed_chunk_ms"] for r, _ in pairs if r.get("computed_chunk_ms")]
    off = [o["computed_chunk_ms"] for _, o in pairs if o and o.get("computed_chunk_ms")]
    idx = [r for r, _ in pairs]
    out["cost"] = {
        "runs": len(pairs),
        "computed_chunk_ms_index": statistics.median(on) if on else None,
        "computed_chunk_ms_no_index": statistics.median(off) if off else None,
        "added_ms_per_computed_chunk": (statistics.median(on) - statistics.median(off)) if on and off else None,
        "cold_chunk_ms": statistics.median(r["cold_chunk_ms"] for r in idx if r.get("cold_chunk_ms")) if idx else None,
        "record_probes_per_computed_chunk": statistics.median(r["record_probes"] / max(1, r["chunks_computed"])
                                                              for r in idx) if idx else None,
        "probe_p50_ms": statistics.median(r["probe_p50_ms"] for r in idx if r["probe_p50_ms"] is not None) if idx else None,
        "probe_p99_ms": max((r["probe_p99_ms"] for r in idx if r["probe_p99_ms"] is not None), default=None),
    }
    c = out["cost"]
    if c["record_probes_per_computed_chunk"] is not None and c["probe_p50_ms"] is not None:
        c["probe_ms_per_computed_chunk_p50"] = c["record_probes_per_computed_chunk"] * c["probe_p50_ms"]
    return out


def _cost_pair(rows: list[dict], on: dict) -> Optional[dict]:
    """The index-off run measured right after ``on`` (the same rep)."""
    i = rows.index(on)
    return next((r for r in rows[i + 1:] if r["workers"] == 1 and r["store"] == "localdisk" and not r["index"]
                 and r["restart_after"] is None and r["workload"] == "interactive"), None)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: dict[str, Any]) -> str:
    env, s, rows = results["env"], results["summary"], results["runs"]
    lines = [
        "# Hit rate and workers: results",
        "",
        f"Commit {env['git_commit_full']}{' (dirty tree)' if env['git_dirty'] else ''}; {env['platform']}, "
        f"{env['cpus']} CPUs, Python {env['python']}, torch {env.get('torch')}; load average "
        f"{' '.join(env['loadavg_start'])} at the start, {' '.join(env['loadavg_end'])} at the end; {env['time']}.",
        "",
        "| workload | store | workers | index | restored of chunks | hit rate | x 1 process | points below | "
        "adopted | claims | waits (adopted) | probe p50 / p99 ms | PASS | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["restart_after"] is not None or r["label"].startswith("cost-"):
            continue
        lines.append(f"| {r['workload']} | {r['store']} | {r['workers']} | {'on' if r['index'] else 'off'} | "
                     f"{r['chunks_restored']} of {r['chunks_total']} | {_pct(r['hit_rate'])} | "
                     f"{_x(r.get('vs_one_process'))} | {_x(r.get('points_below_one_process'), 1)} | {r['adopted']} | "
                     f"{r['claims']} | {r['waits']} ({r['wait_adopted']}) | "
                     f"{_x(r['probe_p50_ms'])} / {_x(r['probe_p99_ms'])} | {'PASS' if r['passed'] else 'FAIL'} | "
                     f"{r['wall_s']:.0f} |")
    half = results["config"]["restart_after"]
    lines += ["", f"Restart after session {half - 1} (a fresh set of workers, empty tries, runs sessions {half}.. "
                  "of the interactive workload; the same sessions' figure without the restart, same index setting):",
              "",
              "| workers | index | second half restored | without the restart | x no restart | "
              "restarted workers' first sessions: restored of chunks | first session s (median) | "
              "process start to its end s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["restart"]:
        lines.append(f"| {r['workers']} | {'on' if r['index'] else 'off'} | {r['second_half_restored']} of "
                     f"{r['second_half_chunks']} | {r['no_restart_second_half_restored']} | {_x(r['vs_no_restart'])} | "
                     f"{r['first_session_restored']} of {r['first_session_chunks']} | {_x(r['first_session_s'])} | "
                     f"{_x(r['process_start_to_first_session_end_s'], 2)} |")
    c = s["cost"]
    lines += ["", f"Added cost per cold chunk (one process, LocalDisk, {c['runs']} runs with the index on and off, "
                  "medians): ", "",
              f"- a computed chunk: {_x(c['computed_chunk_ms_index'])} ms with the index, "
              f"{_x(c['computed_chunk_ms_no_index'])} ms without: {_x(c['added_ms_per_computed_chunk'])} ms added "
              f"(a cold chunk with no cache at all: {_x(c['cold_chunk_ms'])} ms);",
              f"- record probes per computed chunk: {_x(c['record_probes_per_computed_chunk'], 2)} "
              f"(every probe of the run, hits' included, over the chunks computed), p50 {_x(c['probe_p50_ms'])} ms, "
              f"p99 {_x(c['probe_p99_ms'])} ms: about {_x(c.get('probe_ms_per_computed_chunk_p50'))} ms of probes "
              "per computed chunk.", ""]
    o = results.get("ops")
    if o:
        names = [("find_miss", "probe, 1 key, miss"), ("find_hit", "probe, 1 key, hit"),
                 ("find_8_hits", "probe, 8 keys, hits"), ("find_8_misses", "probe, 8 keys, misses"),
                 ("claim", "claim"), ("publish", "record (publication)"), ("drop_claim", "claim release"),
                 ("index_per_cold_chunk", "all the index adds to one cold chunk"),
                 ("chunk_values_write", "that chunk's values (tiny: 4 KV values, latent)")]
        lines += [f"Record operations in one process ({results['config']['ops_reps']} reps each, ms):", "",
                  "| operation | " + " | ".join(f"{k} p50 | {k} p99" for k in o) + " |",
                  "| --- | " + " | ".join("--- | ---" for _ in o) + " |"]
        for op, label in names:
            lines.append(f"| {label} | " + " | ".join(f"{_x(o[k][op]['p50_ms'])} | {_x(o[k][op]['p99_ms'])}" for k in o)
                         + " |")
        lines += ["", "Index over the chunk's values write (p50): " + ", ".join(
            f"{k} {_x(o[k]['index_over_values_write_p50'], 2)}x" for k in o) + ".", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return
    rows = [r for r in results["runs"] if r["restart_after"] is None and not r["label"].startswith("cost-")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, workload in zip(axes[:2], ("interactive", "stress")):
        if not any(r["workload"] == workload for r in rows):
            ax.set_axis_off()
            continue
        for index, style in ((True, "o-"), (False, "s--")):
            pts = sorted((r["workers"], 100 * r["hit_rate"]) for r in rows
                         if r["workload"] == workload and r["store"] == "localdisk" and r["index"] == index)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"LocalDisk, index {'on' if index else 'off'}")
        mem = [100 * r["hit_rate"] for r in rows if r["workload"] == workload and r["store"] == "memory"]
        if mem:
            ax.axhline(mem[0], color="gray", lw=0.8, ls=":", label="1 process, memory")
        ax.set(xlabel="worker processes (started at once)", ylabel="chunks restored (%)", title=workload,
               xticks=sorted({r["workers"] for r in rows}), ylim=(0, None))
        ax.legend(fontsize=8)
    ax = axes[2]
    rs = results["summary"]["restart"]
    labels = [f"{r['workers']}w {'on' if r['index'] else 'off'}" for r in rs]
    xs = range(len(rs))
    ax.bar([x - 0.2 for x in xs], [r["no_restart_second_half_restored"] or 0 for r in rs], 0.4, label="no restart")
    half = results["config"]["restart_after"]
    ax.bar([x + 0.2 for x in xs], [r["second_half_restored"] for r in rs], 0.4, label="restart")
    ax.set(xticks=list(xs), xticklabels=labels, ylabel=f"chunks restored, sessions {half}..",
           title="restart (interactive, LocalDisk)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
