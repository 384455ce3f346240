"""Argument checks shared by the synthetic runtime and its factory: bad input is a `ConfigError`
naming the ``runtime.*`` field and the fix, raised before anything is allocated."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from cacheseek.errors import ConfigError
from cacheseek.runtime.synthetic.control import MAX_ACTION_DIM
from cacheseek.runtime.geometry import check_cpu_memory, check_int, no_cuda_error

__all__ = ["DTYPES", "check_actions", "check_compute", "check_device", "check_dtype", "check_int", "check_prompt",
           "torch_dtype"]

DTYPES = ("bfloat16", "float16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a checked `DTYPES` name."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def check_dtype(dtype: Any) -> None:
    if dtype not in DTYPES:
        raise ConfigError("runtime.dtype", f"unknown dtype {dtype!r}", "use one of: " + ", ".join(DTYPES))


def check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, str):
        raise ConfigError("runtime.prompt", f"must be a string, got {type(prompt).__name__}")


def check_device(device: Any, geometry: Any = None) -> torch.device:
    """``device`` as a torch device: cpu, or an existing CUDA device (an index is filled in).
    Without CUDA, a ``geometry`` too large for a CPU gets `no_cuda_error`'s fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("runtime.device", f"unknown device {device!r}", "use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("runtime.device", f"unsupported device {device!r}", "use cpu or cuda")
    cpu_run = ("+experiment=rolling_tiny (the gate on a rolling ring, tiny geometry, cpu), or "
               "runtime.geometry=small runtime.device=cpu")
    if dev.type == "cpu" and geometry is not None:
        check_cpu_memory(geometry, cpu_run)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            if geometry is not None:
                raise no_cuda_error(geometry, cpu_run)
            raise ConfigError("runtime.device", "CUDA is not available", "use runtime.device=cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ConfigError("runtime.device", f"{device!r}: only {torch.cuda.device_count()} GPUs")
    return dev


def check_actions(actions: Any) -> list[list[float]]:
    """Per-chunk action vectors as float lists: finite, at most `MAX_ACTION_DIM` values each."""
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or not actions:
        raise ConfigError("runtime.actions", "must be a non-empty sequence of per-chunk controls")
    out = []
    for i, a in enumerate(actions):
        try:
            vals = [float(x) for x in a]
        except (TypeError, ValueError):
            raise ConfigError("runtime.actions", f"action {i} is not a sequence of floats: {a!r}") from None
        if len(vals) > MAX_ACTION_DIM:
            raise ConfigError("runtime.actions", f"action {i} has {len(vals)} values, at most {MAX_ACTION_DIM}")
        if not all(math.isfinite(x) for x in vals):
            raise ConfigError("runtime.actions", f"action {i} has a non-finite value")
        out.append(vals)
    return out


def check_compute(compute: Any) -> dict | None:
    """The optional compute term as ``{"gemm_dim", "gemms_per_layer_step"}`` (default 1), or None."""
    if compute is None:
        return None
    if not isinstance(compute, dict):
        raise ConfigError("runtime.compute", f"must be a dict or None, got {type(compute).__name__}")
    unknown = set(compute) - {"gemm_dim", "gemms_per_layer_step"}
    if unknown:
        raise ConfigError("runtime.compute", f"unknown keys {sorted(unknown)}", "use gemm_dim and gemms_per_layer_step")
    out = {"gemm_dim": compute.get("gemm_dim"), "gemms_per_layer_step": compute.get("gemms_per_layer_step", 1)}
    check_int("runtime.compute.gemm_dim", out["gemm_dim"], 1)
    check_int("runtime.compute.gemms_per_layer_step", out["gemms_per_layer_step"], 1)
    return out
