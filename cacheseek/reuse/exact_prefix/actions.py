"""Action keys: the canonical bytes of one chunk's control, the edge label of the trie.

A world model's action for a chunk is a control tensor (LingBot-World-fast at 480x832: camera
control ``[1, 384, 3, 60, 104]`` float32, 7.19 M values). Its key must be

- exact where it matters: two controls that the model sees as different give different keys;
- stable against float noise below the model's resolution: values are quantized to 1e-6 (the
  conditioning is cast to bf16, whose resolution is far coarser);
- the same in every process and on every machine: a float32 value times 1e6 is exact in
  float64, then rounded half to even and written as little-endian integers;
- cheap: vectorized in cache-sized blocks, about 40 ms for a 480p chunk on one core (the old
  per-value Python path took seconds; `experiments/action_keys` measures both).

    key = H("action", "q1e-6", dtype tag, shape, quantized values)

with H the length-prefixed sha256 of `keys` and the values as ``<i4`` when every one fits
(|x| < 2147), else ``<i8``. ``None`` (a chunk without control) is ``b"noctrl"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cacheseek.reuse.exact_prefix.keys import sha256_of_parts

__all__ = ["NO_CONTROL", "QUANTUM", "action_bytes", "quantized_values"]

NO_CONTROL = b"noctrl"
QUANTUM = 1e-6
_SCALE = 1e6
_I4_RANGE = (2**31 - 1) / _SCALE  # |x| at or below this quantizes into int32
_BLOCK = 1 << 18  # values per pass: the float64 scratch stays in cache


def action_bytes(control: Any) -> bytes:
    """The 32-byte action key of one chunk's control (``b"noctrl"`` for None). Accepts a torch
    tensor (any device, any real dtype), a numpy array or nested sequences of numbers; raises
    ValueError on a non-finite value, which has no canonical quantum."""
    if control is None:
        return NO_CONTROL
    values = _flat_values(control)
    dtype = _int_dtype(values)
    shape = np.asarray(np.shape(control) if not hasattr(control, "shape") else tuple(control.shape), dtype="<i8")
    h = sha256_of_parts(b"action", b"q1e-6", dtype.str.encode(), memoryview(shape))
    h.update((values.size * dtype.itemsize).to_bytes(8, "little"))
    for block in _quantized_blocks(values, dtype):
        h.update(block)
    return h.digest()


def quantized_values(control: Any) -> np.ndarray:
    """The control's values in units of `QUANTUM` (flat, C order), as the key hashes them."""
    values = _flat_values(control)
    dtype = _int_dtype(values)
    return np.concatenate([b.copy() for b in _quantized_blocks(values, dtype)] or [np.empty(0, dtype)])


def _quantized_blocks(values: np.ndarray, dtype: np.dtype):
    """Yields views of one reused buffer: consume each before the next."""
    scratch = np.empty(min(_BLOCK, values.size), dtype=np.float64)
    out = np.empty(scratch.size, dtype=dtype)
    for start in range(0, values.size, _BLOCK):
        n = min(_BLOCK, values.size - start)
        f, q = scratch[:n], out[:n]
        np.multiply(values[start : start + n], _SCALE, dtype=np.float64, out=f)
        np.rint(f, out=f)
        np.copyto(q, f, casting="unsafe")
        yield q


def _int_dtype(values: np.ndarray) -> np.dtype:
    if values.size == 0:
        return np.dtype("<i4")
    lo, hi = float(values.min()), float(values.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError("the control holds a non-finite value: it has no canonical action key")
    if max(-lo, hi) > 2**62 / _SCALE:
        raise ValueError(f"control value {max(-lo, hi):g} is too large to quantize to {QUANTUM:g}")
    return np.dtype("<i4") if max(-lo, hi) <= _I4_RANGE else np.dtype("<i8")


def _flat_values(control: Any) -> np.ndarray:
    """The control's values as a flat float32 or float64 array (no copy when already one)."""
    if hasattr(control, "detach"):  # a torch tensor: move the narrow dtype, widen on the host
        import torch

        t = control.detach()
        if t.is_complex():
            raise ValueError(f"a control of dtype {t.dtype} has no action key")
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.to(torch.float32)  # exact, and half the bytes of float64
        elif t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float64)  # integers are exact in float64
        return t.contiguous().numpy().reshape(-1)
    arr = np.asarray(control)
    if arr.dtype not in (np.float32, np.float64):
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"a control of dtype {arr.dtype} has no action key")
        arr = arr.astype(np.float64)
    return np.ascontiguousarray(arr).reshape(-1)
