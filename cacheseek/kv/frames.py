"""A chunk's frames as one stored value, bound to the chunk's key and checksummed.

What a runtime hands the user for a chunk (TeleFuser: the uint8 frames ``[T, H, W, 3]`` after
``tensor2video``; the synthetic runtime: its decoded float32 frames ``[c, 3, h, w]``) is kept
beside the chunk's KV under ``{hex}:frm``, so that a restored chunk hands its frames out instead
of decoding its latent. The value is self-describing and self-checking on every store, whether
or not the store checksums its values (the Plan tier does not)::

    magic    8 B   b"CSFRMV01"
    key     32 B   the chunk's node key
    digest  16 B   xxh3-128 over key, dtype code, shape and the frame bytes
    dtype    1 B   code (`DTYPES`)
    ndim     1 B
    pad      6 B
    shape   4 B x ndim (u32, little endian)
    bytes          the frames, C order

`unpack` checks the magic, the key (a value under another chunk's name is not this chunk's),
the shape and dtype the runtime expects, the length and the digest; any mismatch is a
`CorruptValueError`: a miss, never frames handed out.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch
import xxhash

from cacheseek.errors import CorruptValueError

__all__ = ["MAGIC", "DTYPES", "FramesSpec", "host_bytes", "pack", "unpack", "packed_nbytes", "tensor_nbytes"]

MAGIC = b"CSFRMV01"
_HEAD = struct.Struct("<8s32s16sBB6x")
DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.float32, 3: torch.float16}
_NUMPY = {torch.uint8: np.uint8, torch.float32: np.float32, torch.float16: np.float16}
_CODES = {v: k for k, v in DTYPES.items()}


class FramesSpec:
    """The frames a runtime hands out for one chunk: ``shape`` and torch ``dtype``. The reader
    needs it to size the read (a Plan store is read by length) and to check what it got."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if dtype not in _CODES:
            raise ValueError(f"frames of dtype {dtype} cannot be stored (one of {sorted(map(str, _CODES))})")
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)

    def __repr__(self) -> str:
        return f"FramesSpec({self.shape}, {self.dtype})"


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a C-order tensor of ``shape`` and ``dtype``."""
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def host_bytes(value: Any) -> np.ndarray:
    """The bytes of ``value`` (bytes, or a tensor of any dtype on any device) as a flat uint8 host array."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(value, dtype=np.uint8)


def packed_nbytes(spec: FramesSpec) -> int:
    """Bytes of the stored value of frames of ``spec``."""
    return _HEAD.size + 4 * len(spec.shape) + spec.nbytes


def _digest(key: bytes, code: int, shape: tuple[int, ...], body: Any) -> bytes:
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(bytes([code, len(shape)]))
    h.update(struct.pack(f"<{len(shape)}I", *shape))
    h.update(body)
    return h.digest()


def pack(key: bytes, frames: Any) -> torch.Tensor:
    """The stored value of ``frames`` (a CPU tensor or numpy array) for the chunk ``key``: a 1-D
    uint8 CPU tensor (header, then the frame bytes)."""
    t = frames if isinstance(frames, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(frames))
    t = t.detach().to("cpu").contiguous()
    code = _CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"frames of dtype {t.dtype} cannot be stored")
    shape = tuple(int(d) for d in t.shape)
    body = t.reshape(-1).view(torch.uint8).numpy()
    head = _HEAD.pack(MAGIC, key, _digest(key, code, shape, body), code, len(shape)) + struct.pack(
        f"<{len(shape)}I", *shape)
    out = torch.empty(len(head) + body.nbytes, dtype=torch.uint8)
    arr = out.numpy()
    arr[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    arr[len(head):] = body
    return out


def unpack(key: bytes, value: Any, spec: FramesSpec, locator: str) -> np.ndarray:
    """The frames in ``value`` (bytes, or a uint8 tensor on any device) as a numpy array of
    ``spec`` (a view of the value's bytes where they are on the host: no copy); `CorruptValueError` naming ``locator`` when it is not this chunk's frames of that
    spec, or fails its digest."""
    raw = host_bytes(value)
    if raw.nbytes < _HEAD.size:
        raise CorruptValueError(locator, f"{raw.nbytes} bytes, shorter than a frames header")
    magic, stored_key, digest, code, ndim = _HEAD.unpack(raw[:_HEAD.size].tobytes())
    if magic != MAGIC:
        raise CorruptValueError(locator, "not a frames value (bad magic)")
    if stored_key != key:
        raise CorruptValueError(locator, "the frames of another chunk (key mismatch)")
    end = _HEAD.size + 4 * ndim
    shape = struct.unpack(f"<{ndim}I", raw[_HEAD.size:end].tobytes()) if raw.nbytes >= end else None
    if DTYPES.get(code) != spec.dtype or shape != spec.shape:
        raise CorruptValueError(locator, f"frames {shape} {DTYPES.get(code)}, the runtime hands out {spec}")
    body = raw[end:]
    if body.nbytes != spec.nbytes:
        raise CorruptValueError(locator, f"{body.nbytes} frame bytes, {spec.nbytes} expected")
    if _digest(key, code, shape, body) != digest:
        raise CorruptValueError(locator, "checksum mismatch")
    return body.view(_NUMPY[spec.dtype]).reshape(spec.shape)
