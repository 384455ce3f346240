"""The LocalDisk value file: ``MAGIC`` (8 bytes), the header's length (u32 little-endian), a
sealed JSON header (`cacheseek.stores.checksum`: the value's kind, dtype, shape, byte count and
xxh3 over its key, header and payload), then the raw payload. `encode` makes a file's parts,
`decode` reads one back from an open file and trusts nothing in it: a wrong magic, length, key,
checksum (or one other than its chunk record names) is a `CorruptValueError`, never a value.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, Optional

from cacheseek.errors import CorruptValueError, StoreError
from cacheseek.stores import checksum

__all__ = ["MAGIC", "encode", "decode", "stored_nbytes"]

MAGIC = b"CSKVAL03"  # 03: the header's xxh3 checksum covers the value's key (cacheseek.stores.checksum)
_HLEN = struct.Struct("<I")
_PREFIX = len(MAGIC) + _HLEN.size


def _tensor_bytes(t: Any) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return t.reshape(-1).view(_torch().uint8).numpy().data


def _torch() -> Any:
    import torch

    return torch


def encode(key: str, value: Any) -> tuple[bytes, Any, str]:
    """``(header, body, checksum)``: the file's first bytes (magic, length, sealed JSON), its
    payload, and the checksum the header carries."""
    meta, body = _meta(key, value)
    header = checksum.seal(key, meta, body)
    return MAGIC + _HLEN.pack(len(header)) + header, body, checksum.claimed_digest(header)

def stored_nbytes(key: str, value: Any) -> int:
    """The size of the file ``write(key, value)`` makes (the unit of the tier's usage)."""
    meta, body = _meta(key, value)
    return _PREFIX + len(checksum.seal(key, meta, b"")) + meta["nbytes"]

def _meta(key: str, value: Any) -> tuple[dict[str, Any], Any]:
    if isinstance(value, str):
        body: Any = value.encode("utf-8")
        meta: dict[str, Any] = {"kind": "str"}
    elif isinstance(value, (bytes, bytearray, memoryview)):
        body = bytes(value)
        meta = {"kind": "bytes"}
    elif _is_tensor(value):
        if value.device.type != "cpu":
            raise StoreError(f"localdisk: {key}: expected a CPU snapshot, got a tensor on {value.device}")
        t = value.detach().contiguous()
        body = _tensor_bytes(t) if t.numel() else b""
        meta = {"kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    else:
        try:
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            body = text.encode("utf-8")
        except (TypeError, ValueError):
            raise StoreError(
                f"localdisk: {key}: cannot store a {type(value).__name__} (a CPU tensor, bytes, "
                "str, or plain JSON data: numbers, lists, dicts with string keys)"
            ) from None
        meta = {"kind": "json"}
    meta["nbytes"] = memoryview(body).nbytes
    return meta, body

def decode(key: str, path: Path, f: Any, expect: Optional[str] = None) -> Any:
    def corrupt(problem: str) -> CorruptValueError:
        return CorruptValueError(key, f"file {path}: {problem}")

    size = os.fstat(f.fileno()).st_size
    prefix = f.read(_PREFIX)
    if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise corrupt("not a CacheSeek value of this format (bad magic)")
    (hlen,) = _HLEN.unpack(prefix[len(MAGIC) :])
    if _PREFIX + hlen > size:
        raise corrupt(f"{size} bytes on disk, shorter than its header (truncated)")
    sealed = checksum.unseal(key, f.read(hlen))
    if expect is not None and sealed.claimed != expect:
        raise corrupt(f"checksum {sealed.claimed} is not the {expect} its chunk's record names "
                      "(another writer's bytes)")
    meta = sealed.meta
    try:
        kind, nbytes = meta["kind"], int(meta["nbytes"])
    except (ValueError, KeyError, TypeError):
        raise corrupt("unreadable header") from None
    if size != _PREFIX + hlen + nbytes:
        raise corrupt(f"{size} bytes on disk, header says {_PREFIX + hlen + nbytes} (truncated or damaged)")
    if kind in ("str", "bytes", "json"):
        raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise corrupt("truncated payload")
        sealed.verify(raw)
        if kind == "bytes":
            return raw
        try:
            text = raw.decode("utf-8")
            return json.loads(text) if kind == "json" else text
        except (ValueError, UnicodeDecodeError):
            raise corrupt(f"unreadable {kind} payload") from None
    if kind != "tensor":
        raise corrupt(f"unknown kind {kind!r}")
    torch = _torch()
    dtype = getattr(torch, str(meta.get("dtype")), None)
    shape = meta.get("shape")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list):
        raise corrupt("bad dtype or shape in header")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise corrupt(f"bad shape {shape!r}")
    if math.prod(shape) * torch.empty((), dtype=dtype).element_size() != nbytes:
        raise corrupt("shape and size disagree")
    out = torch.empty(shape, dtype=dtype)
    buf = _tensor_bytes(out) if nbytes else b""
    got = 0
    while got < nbytes:
        n = f.readinto(buf[got:])
        if not n:
            raise corrupt("truncated payload")
        got += n
    sealed.verify(buf)
    return out


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: cannot be a tensor
    return torch is not None and isinstance(value, torch.Tensor)
