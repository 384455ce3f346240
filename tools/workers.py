"""One cache, several workers: two worker processes share one Fluxon service.

    python tools/workers.py --cluster-name NAME --share-mem-path PATH [--store fluxon_plan]
                            [--workdir DIR] [HYDRA_OVERRIDE ...]
    python tools/workers.py --start-service [...]     # a private service for the run

The coordinator (this command) starts two fresh worker processes, one after the other, each
attached to the same Fluxon cluster through the chosen store:

1. worker 1 runs A = P+X cold (empty trie): every chunk is written to Fluxon; it then saves its
   forest snapshot (``save_forest_snapshot``, an atomic JSON replace) and exits;
2. worker 2 starts with an empty trie, loads worker 1's snapshot, and runs B = P+X (must hit
   every chunk, frames equal to worker 1's A), C = P+Y (must hit |P| chunks) and D = P+Y cold on
   a fresh trie without ingest (the reference: C's frames must equal D's).

It prints each request's hit depth and PASS or FAIL (exit 0 / 1; 2 for a usage, config or
attach error, as one ``error:`` line), and writes ``results.json``, the snapshot, each worker's
log and its own (``workers.log``) under ``--workdir``: by default a new run folder
``outputs/workers/DATE/TIME`` beside Hydra's, created only once the invocation is accepted; no
temporary folder is left anywhere. A progress bar shows on a terminal while the workers run. The actions, the geometry and the sizes come from the usual Hydra config
(``workload`` abcd: ``total_chunks``, ``prefix_chunks``, ``action_seed``), so any override of
``python -m cacheseek`` can follow the options, e.g. ``runtime.local_attn_size=7
runtime.sink_size=3 workload.total_chunks=5 workload.prefix_chunks=3``.

Stores (``--store``): ``fluxon_plan`` (the Plan tier with ``store.client=fluxon``: zero-copy
reads, staged writes) or ``fluxon`` (the generic per-layer tier, `FluxonTensorTier`).

The service's master and owner advertise a non-loopback address: on a shared machine run the
whole command inside a private network namespace (``tools/netns-run.sh``); with
``--start-service`` this command refuses to start a service outside one, before it creates
anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("cacheseek.workers")
SCRIPT = str(Path(__file__).resolve())

STORES = ("fluxon_plan", "fluxon")


def store_overrides(store: str, cluster_name: str, share_mem_path: str, op_timeout_s: float) -> list[str]:
    """The Hydra overrides that attach ``store`` to a Fluxon cluster."""
    if store == "fluxon_plan":
        opts = {"cluster_name": cluster_name, "share_mem_path": share_mem_path, "op_timeout_s": op_timeout_s}
        return ["+store=fluxon_plan", "store.client=fluxon"] + [
            f"+store.client_options.{k}={v}" for k, v in opts.items()]
    if store == "fluxon":
        return ["+store=fluxon", f"store.cluster_name={cluster_name}", f"store.share_mem_path={share_mem_path}",
                f"store.op_timeout_s={op_timeout_s}"]
    raise ValueError(f"unknown store {store!r}: use one of {', '.join(STORES)}")


# -- a worker -----------------------------------------------------------------------------------


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _request(stack: Any, name: str, actions: list, label: str, n: int, *, manager: Any = None,
             ingest: bool = True) -> dict[str, Any]:
    binding, hashes, wall = stack.run_session(actions, manager=manager, ingest=ingest)
    k = binding.last_fast_forward
    return {"name": name, "actions": label, "hit_depth": k, "chunks_computed": n - k,
            "wall_s": round(wall, 3), "bytes_restored": binding.bytes_restored,
            "bytes_written": binding.bytes_written, "ingest_errors": binding.ingest_errors,
            "frame_hashes": [h if isinstance(h, str) else h.hex() for h in hashes]}


def run_worker(role: str, overrides: list[str], snapshot: Path, out: Path, run_dir: Path) -> dict[str, Any]:
    """Worker ``first`` runs A and saves the snapshot; worker ``second`` loads it and runs B, C, D."""
    from cacheseek.errors import ConfigError
    from cacheseek.orchestrator import build_stack, instantiate
    from cacheseek.reuse.exact_prefix import NamespaceForest
    from cacheseek.reuse.exact_prefix.trie import load_forest_snapshot, save_forest_snapshot
    from cacheseek.workloads.prefix_gate import PrefixGate

    cfg = _compose(overrides)
    gate = instantiate(cfg.workload)
    if not isinstance(gate, PrefixGate):
        raise ConfigError("workload", f"tools/workers.py runs the abcd workload, not {cfg.workload._target_}")
    n = gate.n
    stack = build_stack(cfg, run_dir=run_dir, workload=gate)
    result: dict[str, Any] = {"role": role, "pid": os.getpid(), "store": stack.store_name,
                              "store_class": type(stack.store).__name__, "total_chunks": n,
                              "prefix_chunks": gate.p}
    try:
        if role == "first":
            result["requests"] = [_request(stack, "A", gate.P + gate.X, "P+X", n)]
            save_forest_snapshot(stack.forest, snapshot)
            result["snapshot_nodes"] = sum(len(ns["nodes"]) for ns in stack.forest.snapshot()["namespaces"])
        else:
            load_forest_snapshot(snapshot, into=stack.forest)  # checked, the previous generation as fallback
            result["loaded_ready_nodes"] = sum(n.has_kv for ns in stack.forest.namespaces() for n in ns.iter_nodes())
            b = _request(stack, "B", gate.P + gate.X, "P+X", n)
            c = _request(stack, "C", gate.P + gate.Y, "P+Y", n)
            fresh = stack.new_manager(forest=NamespaceForest(), shared_index=False)
            d = _request(stack, "D", gate.P + gate.Y, "P+Y", n, manager=fresh, ingest=False)
            result["requests"] = [b, c, d]
        result["metrics"] = stack.metrics.as_dict()
    finally:
        stack.close()
    out.write_text(json.dumps(result, indent=2, default=str))
    return result


# -- the coordinator ----------------------------------------------------------------------------


def _spawn(role: str, overrides: list[str], workdir: Path, timeout_s: float, progress: Any = None) -> dict[str, Any]:
    from cacheseek.progress import ticking

    out, logf = workdir / f"worker-{role}.json", workdir / f"worker-{role}.log"
    cmd = [sys.executable, SCRIPT, "--role", role, "--snapshot", str(workdir / "forest.json"),
           "--out", str(out), "--workdir", str(workdir), *overrides]
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    with open(logf, "wb") as f, ticking(progress):
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise WorkerFailed(role, f"did not finish within {timeout_s:.0f} s", logf) from None
    if rc != 0 or not out.exists():
        raise WorkerFailed(role, f"exited with status {rc}", logf)
    result = json.loads(out.read_text())
    result["process_wall_s"] = round(time.monotonic() - t0, 2)
    return result


class WorkerFailed(RuntimeError):
    def __init__(self, role: str, what: str, logf: Path) -> None:
        tail = ""
        try:
            lines = [ln for ln in logf.read_text(errors="replace").splitlines()
                     if not ln.startswith(("|", "0 [W]", "1 [W]", "2 [W]"))]
            tail = "\n".join("    " + ln[:300] for ln in lines[-15:])
        except OSError:
            pass
        super().__init__(f"worker {role} {what} (log {logf}):\n{tail}")


def check(first: dict[str, Any], second: dict[str, Any]) -> tuple[bool, list[tuple[str, bool, str]]]:
    """The verdicts: B hits every chunk with A's frames, C hits |P| with D's frames, D is cold."""
    (a,) = first["requests"]
    b, c, d = second["requests"]
    n, p = first["total_chunks"], first["prefix_chunks"]
    rows = [
        ("A", a["hit_depth"] == 0 and a["ingest_errors"] == 0, "cold, writes every chunk"),
        ("B", b["hit_depth"] == n and b["frame_hashes"] == a["frame_hashes"], f"K={n}, frames == A (worker 1)"),
        ("C", c["hit_depth"] == p and c["frame_hashes"] == d["frame_hashes"], f"K={p}, frames == D"),
        ("D", d["hit_depth"] == 0 and d["frame_hashes"][:p] == a["frame_hashes"][:p], "cold reference"),
    ]
    return all(ok for _, ok, _ in rows), rows


def _table(first: dict[str, Any], second: dict[str, Any], rows: list[tuple[str, bool, str]]) -> str:
    reqs = [(first, first["requests"][0])] + [(second, r) for r in second["requests"]]
    verdict = {name: ("ok" if ok else "MISMATCH", expect) for name, ok, expect in rows}
    lines = ["worker  pid      req  actions  hit K  computed  wall s  expected                      frames",
             "------  -------  ---  -------  -----  --------  ------  ----------------------------  ------"]
    for w, r in reqs:
        ok, expect = verdict[r["name"]]
        lines.append(f"{'1' if w is first else '2':<6}  {w['pid']:<7}  {r['name']:<3}  {r['actions']:<7}  "
                     f"{r['hit_depth']:<5}  {r['chunks_computed']:<8}  {r['wall_s']:<6.2f}  {expect:<28}  {ok}")
    return "\n".join(lines)


def default_workdir() -> Path:
    """A new run folder ``outputs/workers/DATE/TIME`` (under the current folder, like Hydra's)."""
    return Path("outputs") / "workers" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def _refusal(args: argparse.Namespace) -> Optional[str]:
    """Why this invocation cannot run, found before anything is created; None when it can."""
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


def coordinate(args: argparse.Namespace) -> int:
    from cacheseek.progress import bar

    refused = _refusal(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or default_workdir()).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "forest.json").unlink(missing_ok=True)
    handler = _log_to(workdir)
    service = None
    progress = bar(3 if args.start_service else 2, "workers", unit="step")
    try:
        if args.start_service:
            from cacheseek.fluxon_service.service import FluxonService
            from cacheseek.progress import ticking

            name = args.cluster_name or f"csworkers{os.getpid()}"
            service = FluxonService(workdir / "service", dram=args.dram, cluster_name=name,
                                    share_mem_path=args.share_mem_path or f"/dev/shm/cacheseek-workers-{os.getpid()}")
            progress.set_postfix_str("starting the Fluxon service")
            with ticking(progress):
                service.start()
            progress.update()
            cluster, share = service.cluster_name, service.share_mem_path
        else:
            cluster, share = args.cluster_name, args.share_mem_path
        overrides = store_overrides(args.store, cluster, share, args.op_timeout) + list(args.overrides)
        print(f"one cache, two workers: store={args.store}, Fluxon cluster {cluster!r} at {share}; "
              f"work folder {workdir}", flush=True)
        try:
            progress.set_postfix_str("worker 1: A")
            first = _spawn("first", overrides, workdir, args.worker_timeout, progress)
            progress.update()
            progress.write(f"worker 1 (pid {first['pid']}): ran A, wrote the forest snapshot "
                           f"({first['snapshot_nodes']} nodes) in {first['process_wall_s']:.1f} s")
            progress.set_postfix_str("worker 2: B, C, D")
            second = _spawn("second", overrides, workdir, args.worker_timeout, progress)
            progress.update()
            progress.write(f"worker 2 (pid {second['pid']}): fresh process, empty trie, loaded "
                           f"{second['loaded_ready_nodes']} ready nodes from the snapshot; ran B, C, D in "
                           f"{second['process_wall_s']:.1f} s")
        except WorkerFailed as exc:
            progress.close()
            print(f"FAIL: {exc}", flush=True)
            return 1
        progress.close()
        passed, rows = check(first, second)
        print(_table(first, second, rows))
        b, c, _ = second["requests"]
        n, p = first["total_chunks"], first["prefix_chunks"]
        print(f"hit depths: B={b['hit_depth']} (all {n} chunks), C={c['hit_depth']} (|P|={p})")
        results = {"passed": passed, "store": args.store, "cluster_name": cluster, "share_mem_path": share,
                   "overrides": overrides, "workers": [first, second]}
        (workdir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        print(f"{'PASS' if passed else 'FAIL'}: one Fluxon cache shared by two worker processes "
              f"(store={args.store}) -> {workdir / 'results.json'}", flush=True)
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
                                epilog="Run inside a private network namespace on a shared machine: "
                                       "tools/netns-run.sh python tools/workers.py --start-service")
    p.add_argument("--store", choices=STORES, default="fluxon_plan", help="default: fluxon_plan (store.client=fluxon)")
    p.add_argument("--cluster-name", help="the running service's cluster name")
    p.add_argument("--share-mem-path", help="the running service's segment folder root (/dev/shm/...)")
    p.add_argument("--start-service", action="store_true", help="start a private service for the run (needs a "
                   "private network namespace, fluxon-py and etcd)")
    p.add_argument("--dram", default="64MiB", help="segment size with --start-service (default 64MiB)")
    p.add_argument("--workdir", help="results, snapshot and logs (default: a new outputs/workers/DATE/TIME)")
    p.add_argument("--op-timeout", type=float, default=30.0, help="bound of every Fluxon call, seconds")
    p.add_argument("--worker-timeout", type=float, default=600.0, help="bound of each worker process, seconds")
    p.add_argument("--role", choices=("first", "second"), help=argparse.SUPPRESS)
    p.add_argument("--snapshot", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m cacheseek")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    # A worker logs everything to its log file (its stdout); the coordinator shows warnings and
    # keeps the rest in workers.log.
    logging.basicConfig(level=logging.INFO if args.role else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cacheseek.cli import error_line
    from cacheseek.errors import CacheSeekError, ConfigError

    try:
        if args.role:
            run_worker(args.role, list(args.overrides), Path(args.snapshot), Path(args.out),
                       Path(args.workdir or ".") / f"run-{args.role}")
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
