"""``python -m cacheseek``: compose the config, build the stack, run the workload, report.

User errors (a bad field, an unwritable root, an unknown backend) print one line naming the
field and exit 2 without a traceback; a failed gate prints FAIL and exits 1 (in a multirun the
job raises, the launcher finishes the batch and exits 1).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

import cacheseek.schema  # noqa: F401  (registers the root schema)
from cacheseek.errors import ConfigError, PlanUnavailableError, StoreError
from cacheseek.registry import import_backends

log = logging.getLogger("cacheseek")

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

import_backends()


class GateFailed(RuntimeError):
    """The workload's correctness verdict was FAIL."""


def run(cfg: DictConfig, run_dir: Path, **objects: Any) -> dict[str, Any]:
    """The task: build the stack, run the workload, write results.json. Returns the results."""
    from cacheseek import report
    from cacheseek.orchestrator import build_stack, instantiate

    t0 = time.perf_counter()
    stack = build_stack(cfg, run_dir=run_dir, **objects)
    try:
        workload = instantiate(cfg.workload)
        results = workload.run(stack)
        flush = getattr(stack.store, "flush", None)
        if flush is not None:
            flush()
        results["store"] = stack.store_name
        describe = getattr(stack.runtime_factory, "describe", None)
        results["runtime"] = describe() if describe is not None else {"runtime": type(stack.runtime_factory).__name__}
        results["store_stats"] = _stats(stack.store)
        results["metrics"] = stack.metrics.as_dict()
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
    for row in results.get("ring_check", []):
        if row["verdict"] != "ok":
            print(f"ring check K={row['K']}: {row['verdict']} {row['diff']}")
    if results.get("ring_check"):
        ok = sum(r["verdict"] == "ok" for r in results["ring_check"])
        print(f"ring check: {ok}/{len(results['ring_check'])} resume depths equal a cold run")
    verdict = "PASS" if results["passed"] else "FAIL"
    runtime = " ".join(f"{k}={v}" for k, v in results["runtime"].items())
    print(f"{verdict}: {results.get('workload')} on store={stack.store_name} {runtime} "
          f"({results['wall_s']:.2f} s) -> {run_dir / 'results.json'}")
    return results


def _stats(store: Any) -> dict[str, Any]:
    stats = getattr(store, "stats", None)
    if stats is None:
        return {}
    as_dict = getattr(stats, "as_dict", None)
    return as_dict() if as_dict else dict(stats) if isinstance(stats, dict) else {"repr": repr(stats)}


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        results = run(cfg, Path(hc.runtime.output_dir))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        log.error("config error: %s", exc)
        if multirun:
            raise
        sys.exit(2)
    except (StoreError, PlanUnavailableError) as exc:  # e.g. no Fluxon service to attach to
        print(f"error: store: {type(exc).__name__}: {exc}", file=sys.stderr)
        log.error("store error: %s", exc)
        if multirun:
            raise
        sys.exit(1)
    if not results["passed"]:
        if multirun:
            raise GateFailed(f"gate FAILED in {hc.runtime.output_dir}")
        sys.exit(1)
