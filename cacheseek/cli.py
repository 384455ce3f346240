"""``python -m cacheseek``: compose the config, build the stack, run the workload, report.

Every bad input ends in one line on stderr, ``error: FIELD: what is wrong (fix: ...)``, and exit
status 2, with no traceback: Hydra's compose errors (an unknown option, ``store=X`` without the
``+``, a typo in a key, a wrong type; `cacheseek.hydra_errors`), an output folder that cannot be
written (`OutputDirCheck`), and CacheSeek's own `ConfigError`s, a store or transfer runtime that
cannot start included; a run folder that Hydra made for a run refused so is removed again
(`forget_run_folder`). A failed gate prints FAIL and exits 1. In a multirun a job that fails
(a bad value, a store failing, a FAIL) does not stop the sweep: it writes its one error line to
``error.json`` in its folder, the other jobs run, the summary table lists every job (the failed
one with its reason), and the run exits 1 (2 when a job had a bad input). A bug is still a
traceback. ``HYDRA_FULL_ERROR=1`` shows Hydra's full report instead of the one line.

Output: the choices made for the user (the default store, ``transfer: auto``, each ``auto``
size) and each size given, as read, at start, a progress bar on a terminal, then the report
(`cacheseek.report`). Log lines go to the run folder's ``cacheseek.log``; only warnings reach
the terminal (conf/config.yaml).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import cacheseek.schema  # noqa: F401  (registers the root schema)
from cacheseek import report
from cacheseek.cli_help import CONF_DIR
from cacheseek.errors import CacheSeekError, ConfigError
from cacheseek.hydra_errors import config_error_from_hydra
from cacheseek.codecs.quality import store_codec
from cacheseek.metrics import store_stats
from cacheseek.metrics_server import MetricsConfig, MetricsServer
from cacheseek.orchestrator import build_stack
from cacheseek.registry import LAYOUTS, import_backends

log = logging.getLogger("cacheseek")

EXIT_FAIL, EXIT_USAGE = 1, 2

import_backends()


class GateFailed(RuntimeError):
    """The workload's correctness verdict was FAIL."""


class SweepExit:
    """The exit status a multirun ends with: the worst of its jobs' (0 when every job passed)."""

    status = 0


def _job_failed(run_dir: Path, line: str, status: int) -> None:
    """A multirun job that failed: its reason in ``error.json`` (the summary's row), the sweep goes on."""
    SweepExit.status = max(SweepExit.status, status)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "error.json").write_text(json.dumps({"error": line, "exit": status}, indent=2))


def run(cfg: DictConfig, run_dir: Path, **objects: Any) -> dict[str, Any]:
    """The task: build the stack, run the workload, write results.json. Returns the results."""
    t0 = time.perf_counter()
    metrics_cfg = MetricsConfig.from_conf(cfg.get("metrics"))  # a bad metrics section: refused before anything starts
    stack = build_stack(cfg, run_dir=run_dir, note=lambda line: print(line, flush=True), **objects)
    server = None
    try:
        if metrics_cfg.port is not None:
            server = MetricsServer(stack.metrics, host=metrics_cfg.host, port=metrics_cfg.port).start()
            print(f"metrics: serving {server.url}", flush=True)
        results = stack.workload.run(stack)
        stack.store.flush()
        results["store"] = stack.store_name
        results["codec"] = store_codec(stack.store)  # ``lossy`` names a lossy codec: frames judged by PSNR
        describe = getattr(stack.runtime_factory, "describe", None)
        results["runtime"] = describe() if describe is not None else {"runtime": type(stack.runtime_factory).__name__}
        results["layout"] = LAYOUTS.name_of(type(stack.layout)) or type(stack.layout).__name__  # auto resolved
        results["store_stats"] = store_stats(stack.store)
        results["metrics"] = stack.metrics.as_dict()
        results["metrics_endpoint"] = server.url if server is not None else None
        results["notes"] = stack.notes
    except BaseException:
        if server is not None:
            server.close()
        raise
    finally:
        stack.close()
    results["config"] = OmegaConf.to_container(cfg, resolve=True)
    results["wall_s"] = time.perf_counter() - t0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if "requests" in results:
        print(report.request_table(results["requests"]))
    print(report.metrics_block(results["metrics"]))
    if results.get("summary"):
        print(results["summary"])
    if "verdicts" in results:
        print("\n".join(report.gate_verdicts(results)))
    elif not results["passed"] and report.nothing_cached(results["metrics"]):
        print(report.nothing_cached(results["metrics"]))
    verdict = "PASS" if results["passed"] else "FAIL"
    if results["codec"]["lossy"]:
        verdict += f" (LOSSY codec {','.join(results['codec']['lossy'])}: quality, not bit-exact)"
    runtime = " ".join(f"{k}={v}" for k, v in results["runtime"].items())
    print(f"{verdict}: {results.get('workload')} on store={stack.store_name} {runtime} "
          f"({results['wall_s']:.2f} s) -> {run_dir / 'results.json'}", flush=True)
    if server is not None:
        try:
            if metrics_cfg.hold_s:
                print(f"metrics: still serving {server.url} for {metrics_cfg.hold_s:.0f} s (SIGTERM or Ctrl-C ends it)",
                      flush=True)
            server.hold(metrics_cfg.hold_s)
        finally:
            server.close()
    return results


class OutputDirCheck(Callback):
    """Finds out why a run or sweep folder cannot be used before Hydra tries to use it: Hydra
    swallows a callback's exceptions, so the check records a `ConfigError` naming
    ``hydra.run.dir`` or ``hydra.sweep.dir`` in ``problem``, and `main` reports it as the cause
    of Hydra's own failure. A probe file is written and removed; the folder stays, as Hydra's would.

    It also records the run folder, and ``made``: the outermost folder of its path that did not
    exist before this run, so that a bad input found after Hydra made the folder can remove what
    this run made (`forget_run_folder`) and nothing that was there before."""

    problem: Optional[ConfigError] = None
    run_dir: Optional[Path] = None
    made: Optional[Path] = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        OutputDirCheck.problem = unwritable_output_dir(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        OutputDirCheck.problem = unwritable_output_dir(config, "sweep")


def _outermost_missing(folder: Path) -> Optional[Path]:
    """The outermost folder on the way to ``folder`` that does not exist yet (None: it exists)."""
    missing = None
    for p in (folder, *folder.parents):
        if p.exists():
            break
        missing = p
    return missing


def unwritable_output_dir(config: DictConfig, which: str) -> Optional[ConfigError]:
    """The `ConfigError` naming ``hydra.{which}.dir`` (``which``: run or sweep) when that folder
    cannot be made or written, else None (it is made). For ``run`` it records the folder and the
    outermost one it made in `OutputDirCheck`, so that `forget_run_folder` removes only those."""
    field = f"hydra.{which}.dir"
    try:
        folder = Path(str(OmegaConf.select(config, field)))
    except Exception:  # noqa: BLE001 - an interpolation only Hydra can resolve: Hydra checks it
        return None
    if which == "run":
        here = Path(os.path.abspath(folder))  # as a FileHandler names its file
        OutputDirCheck.run_dir, OutputDirCheck.made = here, _outermost_missing(here)
    fix = f"choose a folder you can write: {field}=/tmp/cacheseek-{which}"
    if folder.exists() and not folder.is_dir():
        return ConfigError(field, f"{folder} is a file, not a folder", fix)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return ConfigError(field, f"cannot write {folder}: {exc.strerror or exc}", fix)
    return None


# What Hydra writes in a run folder before the task runs, besides the job's log file.
_HYDRA_FILES = {".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}


def forget_run_folder() -> None:
    """Remove the run folder of a run refused for a bad input, and the parents made for it, when
    this run made it and it holds only what Hydra wrote there (``.hydra/``, the log file): a bad
    input leaves no folder behind. Anything else in it (a store's files, another process's) keeps
    it where it is. The log file's handlers are closed first, so that no later line recreates it."""
    folder, made = OutputDirCheck.run_dir, OutputDirCheck.made
    OutputDirCheck.run_dir = OutputDirCheck.made = None
    if folder is None or made is None or not folder.is_dir():
        return
    logs = {h.baseFilename: h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)}
    ours = _HYDRA_FILES | {Path(name).name for name in logs if Path(name).parent == folder}
    if any(str(p.relative_to(folder)) not in ours and not _empty_store_part(folder, p) for p in folder.rglob("*")):
        return
    for name, handler in logs.items():
        if Path(name).parent == folder:
            logging.getLogger().removeHandler(handler)
            handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    for parent in folder.parents:  # the empty parents this run made (outputs/<date>/)
        if not (parent == made or made in parent.parents):
            break
        try:
            parent.rmdir()
        except OSError:
            break


def _empty_store_part(folder: Path, p: Path) -> bool:
    """Part of a store root this run made under its folder that holds no value: ``kvstore/``,
    a tiered level's folder, an empty shard, a ``.lock`` (a store opened, then the run refused)."""
    rel = p.relative_to(folder).parts
    if rel[0] != "kvstore" or p.is_symlink():
        return False
    return p.is_dir() or (p.name == ".lock" and p.is_file() and p.stat().st_size == 0)


def error_line(exc: ConfigError) -> str:
    """``error: FIELD: problem (fix: ...)`` on one line (a multi-line problem keeps its first)."""
    lines = str(exc.problem).strip().splitlines() or [""]
    more = " (more in the log file)" if len(lines) > 1 else ""
    fix = f" (fix: {exc.fix})" if exc.fix else ""
    return f"error: {exc.field}: {lines[0]}{more}{fix}"


def _usage_error(exc: BaseException) -> Optional[ConfigError]:
    """The `ConfigError` a bad input raised, directly, through Hydra, or as a cause; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = config_error_from_hydra(exc)
        if found is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _task(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    try:
        results = run(cfg, run_dir)
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr, flush=True)
        log.info("bad input, exit %d: %s", EXIT_USAGE, exc)  # the log file only
        if multirun:
            return _job_failed(run_dir, error_line(exc), EXIT_USAGE)
        if "(more in the log file)" not in error_line(exc):  # else the folder keeps the log it names
            forget_run_folder()
        sys.exit(EXIT_USAGE)
    except CacheSeekError as exc:  # a store or transfer failing in the middle of the run
        line = f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        print(line, file=sys.stderr, flush=True)
        log.exception("the run failed")
        if multirun:
            return _job_failed(run_dir, line, EXIT_FAIL)
        sys.exit(EXIT_FAIL)
    if not results["passed"]:
        if multirun:
            SweepExit.status = max(SweepExit.status, EXIT_FAIL)
            return
        sys.exit(EXIT_FAIL)


def main() -> None:
    """The entry point: Hydra runs `_task`; what goes wrong before or around it is one line."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        _task()
        sys.exit(SweepExit.status)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing its report: we print one line
    try:
        _task()
        if SweepExit.status:
            sys.exit(SweepExit.status)
    except BrokenPipeError:  # `python -m cacheseek --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_FAIL)
    except Exception as exc:  # noqa: BLE001 - sorted below; anything else is a bug and re-raised
        if getattr(exc, "reported", False):
            sys.exit(EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAIL)
        if isinstance(exc, GateFailed):
            sys.exit(EXIT_FAIL)
        bad = _usage_error(exc)
        if bad is None and isinstance(exc, OSError):
            bad = OutputDirCheck.problem
        if bad is None:
            raise
        print(error_line(bad), file=sys.stderr, flush=True)
        forget_run_folder()
        sys.exit(EXIT_USAGE)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
