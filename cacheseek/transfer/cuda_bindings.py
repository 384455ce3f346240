"""The cuda-bindings surface the CUDA transfer runtime stands on: importing ``cudart`` (with the
fix when it is missing), reading a Cython function's parameter names from its signature line
(the batch call's signature differs between bindings), device indices and stream handles.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import TransferError

__all__ = ["import_cudart", "device_index", "coerce_stream", "torch_current_stream", "parameter_names"]


def import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError as exc:
            raise TransferError(
                "the CUDA transfer runtime needs cuda-bindings, which is not installed: pip install "
                "-e '.[fluxon]' on a CUDA machine; on a CPU, transfer=auto (the default) picks host"
            ) from exc
    return cudart


def device_index(device: Any) -> Optional[int]:
    """``"cuda:N"`` or ``N`` -> N; anything else (``"cuda"``, None) -> None: the thread's current
    device."""
    if device is None or isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device
    text = str(device)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text.startswith("cuda:"):
        raise TransferError(f"transfer device must be 'cuda', 'cuda:N' or an index, got {device!r}")
    return None  # "cuda", or a CPU device of tests that run the fake cudart over CPU memory


def coerce_stream(stream: Optional[Any]) -> Optional[int]:
    """A raw stream handle from None, an int, or an object with ``cuda_stream`` (a torch stream)."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    raise TypeError(f"stream must be None, an int handle or a torch stream, got {type(stream).__name__}")


def torch_current_stream() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


def parameter_names(fn: Callable) -> list[str]:
    """Parameter names from a Cython function's embedded signature line (``name(a: T, size_t b)``)."""
    first = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
    m = re.match(r"^\w+\((.*)\)", first)
    if not m:
        return []
    parts, depth, cur = [], 0, ""
    for ch in m.group(1):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    names = []
    for part in parts:
        part = part.split("=")[0].strip()
        names.append(part.split(":")[0].strip() if ":" in part else part.split()[-1] if part else "")
    return names
