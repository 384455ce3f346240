"""Action keys: the canonical bytes of one chunk's control, the edge label of the trie.

A world model's action for a chunk is a control tensor (LingBot-World-fast at 480x832: camera
control ``[1, 384, 3, 60, 104]`` float32, 7.19 M values). Its key must be

- exact where it matters: two controls that the model sees as different give different keys;
- stable against float noise below the model's resolution: values are quantized to 1e-6 (the
  conditioning is cast to bf16, whose resolution is far coarser);
- the same in every process and on every machine: a float32 value times 1e6 is exact in
  float64, then rounded half to even and written as little-endian integers. IEEE float64
  multiply and round-half-to-even are exactly rounded on a CPU and a CUDA GPU alike, so a
  CUDA tensor quantized on its own device keys like its CPU copy;
- cheap: the values are hashed with xxh3-128 (a 480p chunk's 28.8 MB of ``<i4`` in about 4.5
  ms on one core of the 2-core development VM, against 20-27 ms for sha256, the previous format's
  floor), quantized in cache-sized numpy blocks on the CPU; a CUDA tensor is quantized on its GPU
  and only the integers cross, into a pinned buffer of the calling thread.
  `experiments/action_keys` measures every path against the previous format in one run. The
  binding does not key a session up front: `lazy_keys.LazyActionKeys` computes each chunk's key
  (`chunk_action_key`) when the lookup reads it, and the rest off the request path.

    key = H("action", "q1e-6/xxh3-128", dtype tag, shape, byte count, xxh3_128(quantized values))

with H the length-prefixed sha256 of `keys` and the values as ``<i4`` when every one fits
(|x| <= 2147.483647), else ``<i8``. ``None`` (a chunk without control) is ``b"noctrl"``. The
previous format (``"q1e-6"``, sha256 over the values themselves, until issue 24) keyed the same
integers; stores written with it miss once. xxh3-128 is not a cryptographic hash: like the
weights fingerprint it guards against honest mix-ups, not against controls crafted to collide.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

import xxhash

from cacheseek.reuse.exact_prefix.keys import sha256_of_parts

__all__ = ["NO_CONTROL", "QUANTUM", "MAX_KEY_THREADS", "POOL_MIN_VALUES", "Quantized", "action_bytes",
           "action_keys", "chunk_action_key", "digest", "is_cuda_tensor", "quantize", "quantize_on_device",
           "quantized_values", "usable_cpus"]

NO_CONTROL = b"noctrl"
QUANTUM = 1e-6
# `action_keys`' pool, off: on the H200 host three 480p CUDA chunks took 99.5 ms pooled (3 threads)
# against 79.7 ms serial (experiments/action_keys); set it above 1 where a host shows a gain
MAX_KEY_THREADS = 1
_SCALE = 1e6
_I4_RANGE = (2**31 - 1) / _SCALE  # |x| at or below this quantizes into int32
_MAX_VALUE = 2**62 / _SCALE  # |x| above this has no int64 quantum with margin
_BLOCK = 1 << 18  # values per pass: the float64 scratch stays in cache
POOL_MIN_VALUES = 1 << 18  # a control worth a thread (~1.5 ms to key); starting the pool costs ~1 ms
_FORMAT = b"q1e-6/xxh3-128"
_pinned = threading.local()  # each thread's pinned landing buffer for a CUDA control's integers
_LANDING_PIECES = 4  # a CUDA control's integers cross in this many pieces, hashed as they land


class Quantized(NamedTuple):
    """A control ready to hash: its shape, the integer width and its values in that width."""

    shape: tuple[int, ...]
    dtype: np.dtype  # <i4 or <i8
    size: int
    blocks: Callable[[], Iterator[np.ndarray]]  # flat C order; consume each block before the next


def action_bytes(control: Any) -> bytes:
    """The 32-byte action key of one chunk's control (``b"noctrl"`` for None). Accepts a torch
    tensor (any device, any real dtype), a numpy array or nested sequences of numbers; raises
    ValueError on a non-finite value, which has no canonical quantum."""
    if control is None:
        return NO_CONTROL
    return digest(quantize(control))


def action_keys(controls: Iterable[Any]) -> list[bytes]:
    """`action_bytes` of each control, in order, on up to `MAX_KEY_THREADS` threads: one per
    control of at least 2**18 values, never more than the usable cores (fewer than two such
    controls, or one core, run inline: the pool would cost more than it saves). A CUDA tensor is
    quantized in the calling thread, on the caller's current stream; the hashing runs on the
    pool. A control that has no key raises ValueError naming its chunk index (the first such
    chunk in order)."""
    controls = list(controls)
    large = sum(_n_values(c) >= POOL_MIN_VALUES for c in controls)
    workers = min(large, MAX_KEY_THREADS, usable_cpus())
    if workers <= 1:
        return [_chunk_key(i, _staged(i, c, pinned=True)) for i, c in enumerate(controls)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cacheseek-action-keys") as pool:
        futures = []
        for i, c in enumerate(controls):  # chunk i hashes while chunk i + 1 quantizes on its GPU
            try:
                staged = _staged(i, c)
            except ValueError:
                for f in futures:
                    f.result()  # an earlier chunk's error is the one to report
                raise
            futures.append(pool.submit(_chunk_key, i, staged))
        return [f.result() for f in futures]


def chunk_action_key(index: int, control: Any) -> bytes:
    """`action_bytes` of chunk ``index``'s control, in this thread (a CUDA tensor is quantized on
    this thread's current stream); a control that has no key raises ValueError naming the chunk,
    as `action_keys` does."""
    return _chunk_key(index, _staged(index, control, pinned=True))


def quantized_values(control: Any) -> np.ndarray:
    """The control's values in units of `QUANTUM` (flat, C order), as the key hashes them."""
    q = quantize(control)
    return np.concatenate([b.copy() for b in q.blocks()] or [np.empty(0, q.dtype)])


def digest(q: Quantized) -> bytes:
    """The 32-byte key of a quantized control (the formula in the module docstring); the step
    `action_bytes` runs after `quantize`, named so both quantization paths can be checked to key
    alike and the hashing thread can be observed."""
    shape = np.asarray(q.shape, dtype="<i8")
    values = xxhash.xxh3_128()
    for block in q.blocks():
        values.update(block)
    h = sha256_of_parts(b"action", _FORMAT, q.dtype.str.encode(), memoryview(shape),
                        (q.size * q.dtype.itemsize).to_bytes(8, "little"), values.digest())
    return h.digest()


def quantize(control: Any) -> Quantized:
    """The control as integers in units of `QUANTUM`, ready for `digest`: a CUDA tensor takes
    `quantize_on_device` (into this thread's pinned buffer), anything else the numpy path in
    cache-sized blocks. Raises ValueError on a value without a canonical quantum."""
    if is_cuda_tensor(control):
        return quantize_on_device(control, pinned=True)
    values = _flat_values(control)
    dtype = _int_dtype(*_bounds(values), values.size)
    shape = tuple(control.shape) if hasattr(control, "shape") else np.shape(control)
    return Quantized(tuple(int(d) for d in shape), dtype, values.size, lambda: _quantized_blocks(values, dtype))


def quantize_on_device(t: Any, pinned: bool = False) -> Quantized:
    """Quantize a torch tensor with torch on the tensor's device (float64 multiply, round half to
    even, cast) and bring only the integers to the host. Bit-identical to the numpy path; on a
    CPU tensor it is slower (it widens the whole tensor at once), so only CUDA tensors take it.
    ``pinned``: a CUDA tensor's integers land in this thread's pinned buffer (hash them before
    this thread quantizes again); else in a fresh host array."""
    t = t.detach()
    if t.is_complex():
        raise ValueError(f"a control of dtype {t.dtype} has no action key")
    shape = tuple(int(d) for d in t.shape)
    flat = t.reshape(-1)  # the logical C order (a copy for a non-contiguous view)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)  # integers and bools, as the numpy path widens them
    if flat.numel() == 0:
        dtype = np.dtype("<i4")
        return Quantized(shape, dtype, 0, lambda: iter(()))
    lo, hi = torch.stack(torch.aminmax(flat)).to(torch.float64).tolist()  # NaN propagates
    dtype = _int_dtype(lo, hi, flat.numel())
    q = flat.to(torch.float64, copy=True).mul_(_SCALE).round_()  # a copy: the caller's tensor is untouched
    q = q.to(torch.int32 if dtype.itemsize == 4 else torch.int64)
    if pinned and q.is_cuda:
        return Quantized(shape, dtype, q.numel(), _landing(q, dtype))
    host = q.cpu().numpy().astype(dtype, copy=False)  # little-endian on every host
    return Quantized(shape, dtype, host.size, lambda: iter((host,)))


def _landing(q: Any, dtype: np.dtype) -> Callable[[], Iterator[np.ndarray]]:
    """``q`` (CUDA integers) copied into this thread's pinned buffer in `_LANDING_PIECES` pieces on
    the current stream, each with an event; the blocks wait for their piece, so the hash of one
    piece runs while the next ones cross (a 480p control: 0.8 ms of copies beside 1.2 ms of xxh3).
    Consume the blocks before this thread quantizes again."""
    nbytes = q.numel() * q.element_size()
    buf = getattr(_pinned, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _pinned.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
    out = buf[:nbytes].view(q.dtype)
    stream = torch.cuda.current_stream(q.device)
    step = -(-q.numel() // _LANDING_PIECES)
    pieces = []
    for start in range(0, q.numel(), step):
        out[start:start + step].copy_(q[start:start + step], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        pieces.append((start, min(start + step, q.numel()), event))
    host = out.numpy()

    def blocks(source: Any = q) -> Iterator[np.ndarray]:  # ``source`` keeps the device integers alive
        for start, end, event in pieces:
            event.synchronize()
            yield host[start:end].astype(dtype, copy=False)  # little-endian on every host

    return blocks


def _quantized_blocks(values: np.ndarray, dtype: np.dtype) -> Iterator[np.ndarray]:
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


def _bounds(values: np.ndarray) -> tuple[float, float]:
    if values.size == 0:
        return 0.0, 0.0
    return float(values.min()), float(values.max())


def _int_dtype(lo: float, hi: float, size: int) -> np.dtype:
    """The integer width of the key from the control's smallest and largest value (NaN when any
    value is NaN): the one rule both quantization paths share."""
    if size == 0:
        return np.dtype("<i4")
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError("the control holds a non-finite value: it has no canonical action key")
    if max(-lo, hi) > _MAX_VALUE:
        raise ValueError(f"control value {max(-lo, hi):g} is too large to quantize to {QUANTUM:g}")
    return np.dtype("<i4") if max(-lo, hi) <= _I4_RANGE else np.dtype("<i8")


def _flat_values(control: Any) -> np.ndarray:
    """The control's values as a flat float32 or float64 array (no copy when already one)."""
    if hasattr(control, "detach"):  # a torch tensor: move the narrow dtype, widen on the host
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


def is_cuda_tensor(control: Any) -> bool:
    """Whether the control is a torch tensor on a CUDA device (the one kind that is quantized on
    its own device)."""
    device = getattr(control, "device", None)
    return hasattr(control, "detach") and getattr(device, "type", None) == "cuda"


def _staged(index: int, control: Any, pinned: bool = False) -> Any:
    """A CUDA tensor quantized now (this thread, the caller's stream; ``pinned``: into this
    thread's pinned buffer, to be hashed before the next); anything else as is."""
    if control is None or not is_cuda_tensor(control):
        return control
    try:
        return quantize_on_device(control, pinned=pinned)
    except ValueError as e:
        raise _chunk_error(index, e) from e


def _n_values(control: Any) -> int:
    if hasattr(control, "numel"):
        return int(control.numel())
    return int(control.size) if isinstance(control, np.ndarray) else 0  # nested sequences: small


def _chunk_key(index: int, staged: Any) -> bytes:
    try:
        if staged is None:
            return NO_CONTROL
        return digest(staged if isinstance(staged, Quantized) else quantize(staged))
    except ValueError as e:
        raise _chunk_error(index, e) from e


def _chunk_error(index: int, cause: ValueError) -> ValueError:
    return ValueError(f"chunk {index}'s control: {cause}")


def usable_cpus() -> int:
    """The cores this process may run on: `action_keys`' pool never has more threads."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
