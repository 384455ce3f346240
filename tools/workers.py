"""One cache, many live workers: N worker processes run one workload's sessions at once on ONE
shared store, as a service runs one worker per GPU. No snapshot is exchanged: a worker finds what
the others wrote by its key in the store's chunk records (the shared index, issue 31).

    python tools/workers.py --workers N [--store memory|localdisk|fluxon_plan|fluxon]
                            [--workload interactive|stress] [--restart-after S] [--no-index]
                            [--workdir DIR] [HYDRA_OVERRIDE ...]
    python tools/workers.py --store fluxon_plan --cluster-name NAME --share-mem-path PATH ...
    python tools/workers.py --store fluxon_plan --start-service ...    # a private Fluxon service

The coordinator (this command) composes the config (``workload=interactive`` by default, so
``workload.sessions=48`` and any other override of ``python -m cacheseek`` can follow), splits
the plan's sessions over the workers (session ``i`` on worker ``i % N``) and starts the N worker
processes at once. Each worker builds its own stack on the shared store with an empty trie,
computes cold references of its sessions' paths itself (no cache), waits for the other workers
(a bounded barrier, so their sessions start together), then runs its sessions through the
workload's own session loop (``workload.run(stack, sessions=...)``): ``interactive`` streams one
action per chunk (TeleFuser's service streams one action per chunk), ``stress`` runs whole
sessions on its thread pool. Each worker reports, per session, the chunks restored and whether
the frames equal its cold run.

Metrics: ``metrics.port=P`` gives worker k a Prometheus endpoint on ``127.0.0.1:P+k`` (a restarted
generation reuses the ports), ``metrics.port=0`` one the OS picks for each; each worker writes its
URL to ``worker-gGwK.metrics`` in the work folder as soon as it serves, and into its result
(``metrics_endpoint``); ``metrics.hold_s=S`` keeps each worker's endpoint up S seconds after its
sessions (SIGTERM to the worker ends the wait; the hold counts against ``--worker-timeout``). One
endpoint per process: Prometheus scrapes each.

``--restart-after S``: the workers exit after their share of sessions ``0..S-1``, and a fresh set
of N processes (empty tries) runs the rest: what a restart costs. ``--no-index`` sets
``manager.shared_index.enabled=false``: each worker finds only what its own trie holds (the
behaviour before the shared index).

Stores (``--store``): ``localdisk`` (default; one root shared by every worker, ``store.root``
defaults to ``kvstore`` in the work folder), ``memory`` (each process's own: nothing is shared
between processes, the baseline of N separate caches), ``fluxon_plan`` (the Plan tier with
``store.client=fluxon``) and ``fluxon`` (the generic per-layer tier) on a running Fluxon service
(``--cluster-name``, ``--share-mem-path``) or a private one (``--start-service``; its master and
owner advertise a non-loopback address: run the command inside a private network namespace,
``tools/netns-run.sh``, which ``--start-service`` checks before it creates anything).

It prints one row per session and per worker, the chunks restored of all (and of the sessions
after the restart), and PASS (exit 0) when every session's frames equal the cold run and no
worker failed, else FAIL (exit 1); a usage, config or attach error is one ``error:`` line (exit
2). ``results.json``, each worker's log and result, and the coordinator's log (``workers.log``)
go to ``--workdir``: by default a new run folder ``outputs/workers/DATE/TIME`` beside Hydra's,
created only once the invocation is accepted. Every wait is bounded: a worker that does not
finish within ``--worker-timeout`` is killed and the run fails. Each worker's torch gets an equal
share of the CPU cores (``OMP_NUM_THREADS``, unless set), as each would get its own GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("cacheseek.workers")
SCRIPT = str(Path(__file__).resolve())
REPO = str(Path(__file__).resolve().parents[1])

STORES = ("localdisk", "memory", "fluxon_plan", "fluxon")
FLUXON_STORES = ("fluxon_plan", "fluxon")
WORKLOADS = ("interactive", "stress")
POLL_S = 0.05


def store_overrides(store: str, cluster_name: str, share_mem_path: str, op_timeout_s: float) -> list[str]:
    """The Hydra overrides that attach a Fluxon ``store`` to a Fluxon cluster."""
    if store == "fluxon_plan":
        opts = {"cluster_name": cluster_name, "share_mem_path": share_mem_path, "op_timeout_s": op_timeout_s}
        return ["+store=fluxon_plan", "store.client=fluxon"] + [
            f"+store.client_options.{k}={v}" for k, v in opts.items()]
    if store == "fluxon":
        return ["+store=fluxon", f"store.cluster_name={cluster_name}", f"store.share_mem_path={share_mem_path}",
                f"store.op_timeout_s={op_timeout_s}"]
    raise ValueError(f"unknown store {store!r}: use one of {', '.join(FLUXON_STORES)}")


def shares(n_sessions: int, workers: int, restart_after: Optional[int] = None) -> list[list[list[int]]]:
    """The sessions each worker runs, per generation: ``[generation][worker] -> indices``.
    Session ``i`` runs on worker ``i % workers``; with ``restart_after`` S, generation 0 runs
    sessions ``0..S-1`` and a fresh generation the rest."""
    cuts = [0, n_sessions] if restart_after is None else [0, restart_after, n_sessions]
    return [[[i for i in range(lo, hi) if i % workers == k] for k in range(workers)]
            for lo, hi in zip(cuts, cuts[1:])]


# -- a worker -----------------------------------------------------------------------------------


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR
    from cacheseek.errors import ConfigError
    from cacheseek.hydra_errors import config_error_from_hydra
    from cacheseek.registry import import_backends

    import_backends()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad override: one ConfigError naming it
        found = config_error_from_hydra(exc)
        if found is None:
            raise
        raise found from None
    finally:
        GlobalHydra.instance().clear()


def _workload(cfg: Any) -> Any:
    """The configured workload: one whose ``run`` takes a subset of its sessions."""
    from cacheseek.errors import ConfigError
    from cacheseek.orchestrator import instantiate
    from cacheseek.workloads.interactive import InteractiveWorkload
    from cacheseek.workloads.stress import StressWorkload

    wl = instantiate(cfg.workload)
    if not isinstance(wl, (InteractiveWorkload, StressWorkload)):
        raise ConfigError("workload", f"tools/workers.py runs {' or '.join(WORKLOADS)}, not {cfg.workload._target_}",
                          "--workload interactive (the default) or --workload stress")
    return wl


def plan_size(overrides: list[str]) -> int:
    """How many sessions the configured workload's plan has (a bad override, a bad ``metrics``
    section included, raises here, as one `ConfigError`, before any worker starts)."""
    from cacheseek.metrics_server import MetricsConfig

    cfg = _compose(overrides)
    MetricsConfig.from_conf(cfg.get("metrics"))
    return len(_workload(cfg).tree.plan)


def wait_for_all(ready_dir: Path, me: int, n: int, timeout_s: float) -> bool:
    """The start barrier: mark worker ``me`` ready in ``ready_dir`` and wait (at most
    ``timeout_s``) until all ``n`` are; whether they all were (else this one starts anyway)."""
    (ready_dir / f"w{me}").touch()
    deadline = time.monotonic() + timeout_s
    while True:
        count = sum(1 for p in ready_dir.iterdir() if p.name.startswith("w"))
        if count >= n:
            return True
        if time.monotonic() > deadline:
            log.warning("start barrier: %d of %d workers ready after %.0f s; starting anyway", count, n, timeout_s)
            return False
        time.sleep(POLL_S / 2)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One worker: its stack on the shared store (empty trie), its sessions through the
    workload's loop; writes its result (rows, figures, metrics) to ``args.out``."""
    from cacheseek.metrics_server import MetricsConfig, MetricsServer
    from cacheseek.orchestrator import build_stack

    t0 = time.monotonic()
    sessions = [int(s) for s in args.sessions.split(",") if s]
    out, progress = Path(args.out), Path(args.out).with_suffix(".progress")
    cfg = _compose(list(args.overrides))
    wl = _workload(cfg)
    metrics_cfg = MetricsConfig.from_conf(cfg.get("metrics")).with_port_offset(args.worker)
    stack = build_stack(cfg, run_dir=Path(args.workdir), workload=wl)
    marks: dict[str, float] = {"built_s": time.monotonic() - t0}
    result: dict[str, Any] = {"worker": args.worker, "generation": args.generation, "host": socket.gethostname(),
                              "pid": os.getpid(),
                              "store": stack.store_name, "store_class": type(stack.store).__name__,
                              "sessions": sessions, "metrics_endpoint": None}
    server = None
    if metrics_cfg.port is not None:  # one endpoint per worker process: port P+k, or one the OS picks
        try:
            server = MetricsServer(stack.metrics, host=metrics_cfg.host, port=metrics_cfg.port).start()
        except BaseException:
            stack.close()
            raise
        result["metrics_endpoint"] = server.url
        out.with_suffix(".metrics").write_text(server.url + "\n")  # where to scrape it while it runs

    def on_ready() -> None:
        marks["references_s"] = time.monotonic() - t0 - marks["built_s"]
        result["barrier_complete"] = wait_for_all(Path(args.ready_dir), args.worker, args.workers,
                                                  args.barrier_timeout)
        marks["live_at"] = time.monotonic()

    def on_session(row: dict[str, Any]) -> None:
        row["finished_s"] = round(time.monotonic() - marks["live_at"], 4)  # since the live sessions began
        with open(progress, "a") as f:
            f.write(f"{row['name']}\n")

    try:
        try:
            res = wl.run(stack, sessions, on_ready=on_ready, on_session=on_session)
            stack.store.flush()
            result["metrics"] = stack.metrics.as_dict()
        finally:
            stack.close()
        figures = res[res["workload"]]
        figures.pop("timeline", None)
        result.update(workload=res["workload"], rows=res["requests"], figures=figures, summary=res["summary"],
                      errors=list(figures.get("errors", [])), built_s=round(marks["built_s"], 3),
                      references_s=round(marks.get("references_s", 0.0), 3),
                      live_s=round(time.monotonic() - marks.get("live_at", t0), 3))
        out.write_text(json.dumps(result, indent=2, default=str))
        if server is not None:
            server.hold(metrics_cfg.hold_s)  # a last scrape of this worker's final counters
    finally:
        if server is not None:
            server.close()
    return result


# -- the coordinator ----------------------------------------------------------------------------


class WorkerFailed(RuntimeError):
    def __init__(self, name: str, what: str, logf: Path) -> None:
        self.name = name
        tail = ""
        try:
            lines = [ln for ln in logf.read_text(errors="replace").splitlines()
                     if not ln.startswith(("|", "0 [W]", "1 [W]", "2 [W]"))]
            tail = "\n".join("    " + ln[:300] for ln in lines[-15:])
        except OSError:
            pass
        super().__init__(f"worker {name} {what} (log {logf}):\n{tail}")


def _worker_env(workers: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    return env


class Local:
    """Where the workers run: here (a `run_generation` launcher). Workers on other hosts take
    another with the same three methods (tools/multi_host_demo.py's `OnHosts`): the command
    line that runs a worker, a path as the worker sees it, its environment."""

    def argv(self, worker: int, cmd: list[str]) -> list[str]:
        return cmd

    def path(self, path: Path) -> str:
        return str(path)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        return env


def run_generation(gen: int, share: list[list[int]], overrides: list[str], workdir: Path, *,
                   worker_timeout: float = 600.0, barrier_timeout: float = 120.0, progress: Any = None,
                   launcher: Any = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Start one worker process per share at once (``launcher``: where, default `Local`); wait,
    at most ``worker_timeout``, for all. Their results and the failures (one message each; a
    worker past the bound is killed)."""
    launcher = launcher or Local()
    ready = workdir / f"ready-g{gen}"
    ready.mkdir(parents=True, exist_ok=True)
    for p in ready.iterdir():
        p.unlink()
    env = launcher.env(_worker_env(len(share)))
    procs = []
    for k, sessions in enumerate(share):
        name = f"g{gen}w{k}"
        out, logf = workdir / f"worker-{name}.json", workdir / f"worker-{name}.log"
        for stale in (out, out.with_suffix(".progress"), out.with_suffix(".metrics")):
            stale.unlink(missing_ok=True)
        cmd = [sys.executable, SCRIPT, "--worker", str(k), "--generation", str(gen), "--workers", str(len(share)),
               "--sessions", ",".join(map(str, sessions)), "--out", launcher.path(out),
               "--ready-dir", launcher.path(ready), "--workdir", launcher.path(workdir / f"run-{name}"),
               "--barrier-timeout", str(barrier_timeout), *overrides]
        f = open(logf, "wb")
        procs.append((name, out, logf, f, subprocess.Popen(launcher.argv(k, cmd), stdout=f, stderr=subprocess.STDOUT,
                                                           env=env, cwd=REPO)))
    t0 = time.monotonic()
    deadline = t0 + worker_timeout
    shown = 0
    try:
        while any(p.poll() is None for *_, p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            if progress is not None:
                done = sum(_lines(out.with_suffix(".progress")) for _, out, *_ in procs)
                if done > shown:
                    progress.update(done - shown)
                    shown = done
                progress.refresh()
    finally:
        late = [p for *_, p in procs if p.poll() is None]
        for p in late:
            p.kill()
        for *_, p in procs:
            p.wait()
        for *_, f, _ in procs:
            f.close()
    results, failures = [], []
    for name, out, logf, _, p in procs:
        if any(p is q for q in late):
            failures.append(str(WorkerFailed(name, f"did not finish within {worker_timeout:.0f} s (killed)", logf)))
        elif p.returncode != 0 or not out.exists():
            failures.append(str(WorkerFailed(name, f"exited with status {p.returncode}", logf)))
        else:
            res = json.loads(out.read_text())
            res["process_wall_s"] = round(time.monotonic() - t0, 2)
            results.append(res)
    return results, failures


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def summarize(processes: list[dict[str, Any]], n_sessions: int, restart_after: Optional[int]) -> dict[str, Any]:
    """The run's figures from the workers' results: every session's row (with its worker), the
    chunks restored of all, and of the sessions after a restart."""
    rows = sorted(({**r, "worker": p["worker"], "generation": p["generation"]} for p in processes for r in p["rows"]),
                  key=lambda r: r["session"])

    def part(sel: list[dict[str, Any]]) -> dict[str, Any]:
        restored = sum(r["hit_depth"] for r in sel)
        total = sum(r["hit_depth"] + r["chunks_computed"] for r in sel)
        return {"sessions": len(sel), "chunks_restored": restored, "chunks_total": total,
                "hit_rate": restored / total if total else None}

    out = {"all": part(rows), "rows": rows,
           "mismatches": sum(r["verdict"] != "ok" for r in rows),
           "errors": [e for p in processes for e in p["errors"]],
           "missing_sessions": sorted(set(range(n_sessions)) - {r["session"] for r in rows})}
    if restart_after is not None:
        out["before_restart"] = part([r for r in rows if r["session"] < restart_after])
        out["after_restart"] = part([r for r in rows if r["session"] >= restart_after])
        out["restarted_first_sessions"] = [_first_session(p) for p in processes if p["generation"] == 1 and p["rows"]]
    return out


def _first_session(p: dict[str, Any]) -> dict[str, Any]:
    """How warm a (restarted) worker is: its first session's chunks restored and seconds, and
    the time from its process start to the end of that session."""
    r = min(p["rows"], key=lambda r: r["finished_s"])
    return {"worker": p["worker"], "session": r["session"], "chunks_restored": r["hit_depth"],
            "chunks": r["hit_depth"] + r["chunks_computed"], "seconds": round(r["wall_s"], 4),
            "process_start_to_end_s": round(p["built_s"] + p["references_s"] + r["finished_s"], 3)}


def _pct(part: dict[str, Any]) -> str:
    rate = part["hit_rate"]
    return f"{part['chunks_restored']} of {part['chunks_total']}" + ("" if rate is None else f" ({100 * rate:.1f}%)")


def table(summary: dict[str, Any], processes: list[dict[str, Any]]) -> str:
    lines = ["session  worker  actions          restored  computed  frames",
             "-------  ------  ---------------  --------  --------  --------"]
    for r in summary["rows"]:
        lines.append(f"{r['name']:<7}  g{r['generation']}w{r['worker']:<3}  {r['actions']:<15}  {r['hit_depth']:<8}  "
                     f"{r['chunks_computed']:<8}  {'ok' if r['verdict'] == 'ok' else 'MISMATCH'}")
    lines += ["", "worker  pid      sessions  restored        adopted  probes  probe p50 ms  live s",
              "------  -------  --------  --------------  -------  ------  ------------  ------"]
    for p in sorted(processes, key=lambda p: (p["generation"], p["worker"])):
        m = p["metrics"]
        restored = sum(r["hit_depth"] for r in p["rows"])
        total = restored + sum(r["chunks_computed"] for r in p["rows"])
        p50 = (m.get("records") or {}).get("probe_p50_ms")
        lines.append(f"g{p['generation']}w{p['worker']:<3}  {p['pid']:<7}  {len(p['rows']):<8}  "
                     f"{f'{restored} of {total}':<14}  {m['index_adopted']:<7}  {m['index_probes']:<6}  "
                     f"{'-' if p50 is None else f'{p50:.3f}':<12}  {p['live_s']:.2f}")
    return "\n".join(lines)


def default_workdir() -> Path:
    """A new run folder ``outputs/workers/DATE/TIME`` (under the current folder, like Hydra's)."""
    return Path("outputs") / "workers" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def _refusal(args: argparse.Namespace) -> Optional[str]:
    """Why this invocation cannot run, found before anything is created; None when it can."""
    if args.workers < 1:
        return f"--workers: must be >= 1, got {args.workers}"
    for o in args.overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "workload":
            return f"{o}: pick the workload with --workload {' or --workload '.join(WORKLOADS)}"
        if key == "store":
            return f"{o}: pick the store with --store ({', '.join(STORES)}); its fields (store.KEY=VALUE) may follow"
        if key == "manager.shared_index.enabled":
            return f"{o}: use --no-index to turn the shared index off"
        port = o.split("=", 1)[1] if key == "metrics.port" and "=" in o else ""
        if port.isdigit() and 0 < int(port) and int(port) + args.workers - 1 > 65535:
            return (f"{o}: worker k serves on port {port}+k, past 65535 with {args.workers} workers "
                    "(fix: a lower port, or metrics.port=0)")
    if args.store not in FLUXON_STORES:
        if args.start_service or args.cluster_name or args.share_mem_path:
            return f"--start-service, --cluster-name and --share-mem-path are for --store {' or '.join(FLUXON_STORES)}"
        return None
    if not args.start_service:
        if not (args.cluster_name and args.share_mem_path):
            return ("--cluster-name: give --cluster-name and --share-mem-path of a running service "
                    "(fix: add them, or --start-service for a private one)")
        return None
    from cacheseek.errors import ConfigError
    from cacheseek.fluxon_service.service import fluxon_py_problem, private_netns_problem
    from cacheseek.sizes import parse_size

    try:
        parse_size(args.dram, "--dram")
    except ConfigError as exc:
        return str(exc)
    problem = fluxon_py_problem()
    if problem:
        return f"--start-service: {problem}"
    problem = private_netns_problem()
    if problem:
        return f"--start-service: the Fluxon service needs a private network namespace: {problem}"
    return None


def _log_to(workdir: Path) -> logging.Handler:
    handler = logging.FileHandler(workdir / "workers.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    for console in root.handlers:
        console.setLevel(max(console.level, logging.WARNING))
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def _overrides(args: argparse.Namespace, workdir: Path, cluster: Optional[str], share: Optional[str]) -> list[str]:
    out = [f"workload={args.workload}"]
    if args.store in FLUXON_STORES:
        out += store_overrides(args.store, cluster, share, args.op_timeout)
    else:
        out.append(f"+store={args.store}")
        if args.store == "localdisk" and not any(o.split("=", 1)[0] == "store.root" for o in args.overrides):
            out.append(f"store.root={workdir / 'kvstore'}")
    if args.no_index:
        out.append("manager.shared_index.enabled=false")
    return out + list(args.overrides)


def coordinate(args: argparse.Namespace) -> int:
    from cacheseek.errors import ConfigError
    from cacheseek.progress import bar

    refused = _refusal(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or default_workdir()).absolute()
    probe = _overrides(args, workdir, "c", "/dev/shm/c")
    n_sessions = plan_size(probe)  # a bad override fails here, before any process
    if args.restart_after is not None and not 0 < args.restart_after < n_sessions:
        raise ConfigError("--restart-after", f"must be in [1, {n_sessions - 1}] (the plan has {n_sessions} sessions), "
                          f"got {args.restart_after}", f"--restart-after {n_sessions // 2}")
    workdir.mkdir(parents=True, exist_ok=True)
    handler = _log_to(workdir)
    service = None
    generations = shares(n_sessions, args.workers, args.restart_after)
    progress = bar(n_sessions, "workers", unit="session")
    try:
        cluster = share = None
        if args.store in FLUXON_STORES:
            if args.start_service:
                from cacheseek.fluxon_service.service import FluxonService
                from cacheseek.progress import ticking

                name = args.cluster_name or f"csworkers{os.getpid()}"
                service = FluxonService(workdir / "service", dram=args.dram, cluster_name=name,
                                        share_mem_path=args.share_mem_path or f"/dev/shm/cacheseek-workers-{os.getpid()}")
                progress.set_postfix_str("starting the Fluxon service")
                with ticking(progress):
                    service.start()
                cluster, share = service.cluster_name, service.share_mem_path
            else:
                cluster, share = args.cluster_name, args.share_mem_path
        overrides = _overrides(args, workdir, cluster, share)
        if args.store == "localdisk":
            where = "root " + next(o for o in overrides if o.startswith("store.root=")).split("=", 1)[1]
        elif args.store == "memory":
            where = "each process its own: nothing is shared between processes"
        else:
            where = f"Fluxon cluster {cluster!r} at {share}"
        print(f"one cache, {args.workers} workers: workload={args.workload}, {n_sessions} sessions, "
              f"store={args.store} ({where}), shared index {'off' if args.no_index else 'on'}"
              + (f", restart after session {args.restart_after - 1}" if args.restart_after else "")
              + f"; work folder {workdir}", flush=True)
        processes, failures = [], []
        for gen, share_g in enumerate(generations):
            progress.set_postfix_str(f"generation {gen}: {args.workers} workers" if len(generations) > 1
                                     else f"{args.workers} workers")
            got, failed = run_generation(gen, share_g, overrides, workdir, worker_timeout=args.worker_timeout,
                                         barrier_timeout=args.barrier_timeout, progress=progress)
            processes += got
            failures += failed
            if failed:
                break
        progress.close()
        summary = summarize(processes, n_sessions, args.restart_after)
        passed = not failures and summary["mismatches"] == 0 and not summary["errors"] \
            and not summary["missing_sessions"]
        rows = summary.pop("rows")
        if processes:
            print(table({**summary, "rows": rows}, processes))
        endpoints = [f"g{p['generation']}w{p['worker']} {p['metrics_endpoint']}" for p in processes
                     if p.get("metrics_endpoint")]
        if endpoints:
            print("metrics endpoints: " + ", ".join(endpoints))
        for f in failures:
            print(f"FAIL: {f}", flush=True)
        print(f"chunks restored: {_pct(summary['all'])}"
              + (f"; sessions {args.restart_after}.. (after the restart): {_pct(summary['after_restart'])}"
                 if args.restart_after and "after_restart" in summary else ""))
        results = {"passed": passed, "workload": args.workload, "store": args.store, "workers": args.workers,
                   "restart_after": args.restart_after, "shared_index": not args.no_index,
                   "sessions_total": n_sessions, "overrides": overrides, "cluster_name": cluster,
                   "share_mem_path": share, **summary, "sessions": rows, "failures": failures,
                   "processes": processes}
        (workdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        what = "every frame equals a cold run" if passed else (
            f"{summary['mismatches']} sessions differ from a cold run, {len(summary['errors'])} errors, "
            f"{len(failures)} workers failed, {len(summary['missing_sessions'])} sessions not run")
        print(f"{'PASS' if passed else 'FAIL'}: {args.workers} workers on one {args.store} store "
              f"(shared index {'off' if args.no_index else 'on'}): {what} -> {workdir / 'results.json'}", flush=True)
        return 0 if passed else 1
    finally:
        progress.close()
        if service is not None:
            service.stop()
        logging.getLogger().removeHandler(handler)
        handler.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/workers.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="e.g. python tools/workers.py --workers 4 workload.sessions=48; on Fluxon, in a "
                                       "private network namespace: tools/netns-run.sh python tools/workers.py "
                                       "--store fluxon_plan --start-service --workers 2")
    p.add_argument("--workers", type=int, default=2, help="worker processes started at once (default 2)")
    p.add_argument("--store", choices=STORES, default="localdisk",
                   help="default: localdisk (store.root defaults to kvstore in the work folder)")
    p.add_argument("--workload", choices=WORKLOADS, default="interactive", help="default: interactive")
    p.add_argument("--restart-after", type=int, metavar="S",
                   help="the workers exit after sessions 0..S-1; fresh processes run the rest")
    p.add_argument("--no-index", action="store_true",
                   help="manager.shared_index.enabled=false: each worker finds only what it wrote")
    p.add_argument("--workdir", help="results and logs (default: a new outputs/workers/DATE/TIME)")
    p.add_argument("--worker-timeout", type=float, default=600.0,
                   help="bound of each generation of workers, seconds (default 600)")
    p.add_argument("--barrier-timeout", type=float, default=120.0,
                   help="how long a worker waits for the others before its sessions, seconds (default 120)")
    p.add_argument("--cluster-name", help="Fluxon stores: the running service's cluster name")
    p.add_argument("--share-mem-path", help="Fluxon stores: the running service's segment folder root (/dev/shm/...)")
    p.add_argument("--start-service", action="store_true", help="Fluxon stores: start a private service for the "
                   "run (needs a private network namespace, fluxon-py and etcd)")
    p.add_argument("--dram", default="64MiB", help="segment size with --start-service (default 64MiB)")
    p.add_argument("--op-timeout", type=float, default=30.0, help="bound of every Fluxon call, seconds")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--generation", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sessions", help=argparse.SUPPRESS)
    p.add_argument("--ready-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m cacheseek")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    worker = args.worker is not None
    # A worker logs everything to its log file (its stdout); the coordinator shows warnings and
    # keeps the rest in workers.log.
    logging.basicConfig(level=logging.INFO if worker else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cacheseek.cli import error_line
    from cacheseek.errors import CacheSeekError, ConfigError

    try:
        if worker:
            run_worker(args)
            return 0
        return coordinate(args)
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except CacheSeekError as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
