"""Shared helpers of the benchmarks under ``experiments/``: Hydra composition of a script's own
config, machine and version facts, a progress line per step, JSON results.

Not part of the package: run the scripts from the repository root (they put it on sys.path)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 1 << 30


def compose(config_dir: Path, name: str, overrides: Sequence[str]) -> Any:
    """The script's config composed by Hydra (``key=value`` overrides from the command line)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = hydra_compose(config_name=name, overrides=list(overrides))
    GlobalHydra.instance().clear()
    return cfg


def plain(cfg: Any) -> Any:
    """A composed config as plain dicts and lists (resolved), for the results files."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemFree", "MemAvailable", "AnonHugePages"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def git_state() -> dict[str, Any]:
    """``git_commit`` and ``git_dirty`` of the tree the benchmark runs from. ``CACHESEEK_COMMIT``
    names the commit where the tree's ``.git`` is not its own (the device machine's copy of the
    tree carries a stale one); the tree is then taken as clean."""
    import subprocess

    named = os.environ.get("CACHESEEK_COMMIT")
    if named:
        return {"git_commit": named, "git_dirty": False, "git_commit_from": "CACHESEEK_COMMIT"}

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"git_commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the results files."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env_info() -> dict[str, Any]:
    """Machine, GPU and versions, for the results files and the READMEs."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "meminfo": meminfo(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["gpu_memory_gib"] = round(p.total_memory / GiB, 1)
    except Exception as exc:  # noqa: BLE001
        info["torch_error"] = repr(exc)
    try:
        import cuda.bindings
        from cuda.bindings import runtime as rt

        info["cuda_bindings"] = cuda.bindings.__version__
        info["cuda_driver"] = rt.cudaDriverGetVersion()[1]
        info["cuda_runtime"] = rt.cudaRuntimeGetVersion()[1]
    except Exception as exc:  # noqa: BLE001
        info["cuda_bindings_error"] = repr(exc)
    return info


class Progress:
    """One printed line per step: ``[i/n] elapsed  message``."""

    def __init__(self, total: int, name: str) -> None:
        self.total, self.name, self.i, self.t0 = total, name, 0, time.perf_counter()

    def step(self, message: str) -> None:
        self.i += 1
        print(f"[{self.name} {self.i}/{self.total}] {time.perf_counter() - self.t0:7.1f} s  {message}", flush=True)

    def note(self, message: str) -> None:
        print(f"[{self.name}]          {message}", flush=True)


class TimedHooks:
    """A binding with timers around its two hooks (``sync`` first waits for the producer
    stream's work, so a hook's time is the cache's, not the chunk's compute): ``restore_s``,
    ``write_s_per_chunk`` and their sum ``write_s``; anything else is the binding's."""

    def __init__(self, binding: Any, sync: Callable[[], None]) -> None:
        self.binding, self.sync = binding, sync
        self.restore_s = 0.0
        self.write_s_per_chunk: list[float] = []

    @property
    def write_s(self) -> float:
        return sum(self.write_s_per_chunk)

    def on_runtime_created(self, runtime: Any, session_config: Any) -> None:
        t0 = time.perf_counter()
        self.binding.on_runtime_created(runtime, session_config)
        self.sync()
        self.restore_s = time.perf_counter() - t0

    def on_chunk_finalized(self, runtime: Any, idx: int, denoised: Any) -> None:
        self.sync()
        t0 = time.perf_counter()
        self.binding.on_chunk_finalized(runtime, idx, denoised)
        self.write_s_per_chunk.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.binding, name)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def timed(fn: Callable[[], Any], reps: int, *, sync: Callable[[], None] = lambda: None) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn`` (``sync`` after each, inside the timing)."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def gib_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GiB if seconds > 0 else 0.0
