"""What the benchmarks on TeleFuser's real pipeline at LingBot-World 14B's size share
(``telefuser_480p``, ``session_reuse``): one child process per run, each building its own stack.

- `run_children`: the parent's loop: for each run name a child ``script --one NAME [extra] argv``
  within what is left of ``budget_s`` (at most ``timeout_s`` each; one with less than ``min_s``
  left is skipped), its ``store_<NAME>.json`` read back with its return code and wall, the
  results written after each child (a run that runs out of time leaves the others);
- `child_stack`: a child's stack: the ``lingbot_world_14b`` experiment on ``cfg.device`` with the
  store's overrides, the runtime's and ``extra``, no ring check; the CPU's threads set;
- `built`: a child's stack made ready (the pipeline built, the store's warm-up waited for) and
  what its results record of that;
- `device_sync`: the device's synchronize (nothing on a CPU);
- `nocache_run`: a session without a cache, timed as the gate times a request (its generate,
  after its runtime is made, synchronized);
- `plain` (a config as plain data) and `entry` (``--one NAME ...``: the child, else the parent);
- `profiled`: with ``BENCH_PROFILE=1`` in the environment, a block run under cProfile, its top
  functions (cumulative and own time) written beside the results (``profile_<what>.txt``).

Not part of the package: the scripts put ``experiments/`` on sys.path.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Iterator

from benchlib import REPO, write_json

__all__ = ["run_children", "child_stack", "built", "device_sync", "nocache_run", "plain", "entry", "profiled"]


def run_children(script: Path, names: Sequence[str], argv: Sequence[str], cfg: Any, out_dir: Path,
                 results: dict, child_args: Callable[[str], list[str]] = lambda name: [name]) -> None:
    """Run one child per name (see the module docstring) into ``results["stores"][name]``."""
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        left = float(cfg.budget_s) - (time.perf_counter() - t_all)
        if left < float(cfg.min_store_s):
            print(f"[{i}/{len(names)}] {name}: skipped, {left:.0f} s of budget_s left", flush=True)
            results["stores"][name] = {"skipped": f"{left:.0f} s of budget_s {cfg.budget_s} left"}
            continue
        print(f"[{i}/{len(names)}] {name} ({time.perf_counter() - t_all:.0f} s in)", flush=True)
        one = out_dir / f"store_{name}.json"
        one.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(script).resolve()), "--one", *child_args(name), *argv]
        t0 = time.perf_counter()
        try:
            rc: Any = subprocess.run(cmd, timeout=min(float(cfg.store_timeout_s), left), cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row = json.loads(one.read_text()) if one.exists() else {}
        row.update(returncode=rc, process_wall_s=time.perf_counter() - t0)
        results["stores"][name] = row
        write_json(out_dir / "results.json", results)


def child_stack(cfg: Any, store: str, out_dir: Path, run_name: str, extra: Sequence[str] = ()) -> tuple[Any, list[str]]:
    """A child's stack and the Hydra overrides it was built from (see the module docstring)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack

    overrides = ["+experiment=lingbot_world_14b", f"runtime.device={cfg.device}", "workload.ring_check=false",
                 *cfg.store_overrides[store], *extra, *cfg.runtime_overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hcfg = hydra_compose(config_name="config", overrides=overrides)
    if str(cfg.device) == "cpu" and cfg.cpu_threads:
        import torch

        torch.set_num_threads(int(cfg.cpu_threads))
    stack = build_stack(hcfg, run_dir=out_dir / f"run_{run_name}", note=lambda line: print(f"  {line}", flush=True))
    return stack, overrides


def built(stack: Any, t0: float) -> dict:
    """Build the pipeline and wait for the store's warm-up; ``{"build_s"`` (since ``t0``),
    ``"runtime"`` (what the factory describes)``}``."""
    stack.runtime_factory.pipeline
    stack.store.wait_ready(None)
    return {"build_s": time.perf_counter() - t0, "runtime": stack.runtime_factory.describe()}


def device_sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def nocache_run(factory: Any, actions: list, label: str, sync: Callable[[], None]) -> tuple[float, Any]:
    """The wall of a session of ``actions`` without a cache (printed with ``label``) and its runtime."""
    runtime = factory.make(actions, hooks=None)
    sync()
    start = time.perf_counter()
    runtime.generate()
    sync()
    wall = time.perf_counter() - start
    print(f"  {label}: {wall:.3f} s", flush=True)
    return wall, runtime


def plain(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def entry(main: Callable[[list[str]], Any], run_one: Callable[[str, list[str]], Any]) -> None:
    """A script's ``__main__``: ``--one NAME ARGV...`` runs one child, anything else the parent."""
    if sys.argv[1:2] == ["--one"]:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        run_one(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])


@contextlib.contextmanager
def profiled(out_dir: Path, what: str, top: int = 45) -> Iterator[None]:
    """The block under cProfile when ``BENCH_PROFILE=1`` (else nothing): its top ``top`` functions
    by cumulative and by own time in ``out_dir/profile_<what>.txt``."""
    if os.environ.get("BENCH_PROFILE") != "1":
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"profile_{what}.txt").write_text(text.getvalue())
