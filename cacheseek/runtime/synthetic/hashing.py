"""Exact byte-level helpers of the synthetic model: length-prefixed framing, SHAKE-derived
constants, splitmix64 mixing and a tensor's raw bytes (for hashes of weights and frames)."""

from __future__ import annotations

import hashlib
import struct

import torch

from cacheseek.kv.frames import host_bytes

__all__ = ["M64", "lp", "splitmix64", "tensor_bytes", "unit_floats"]

M64 = (1 << 64) - 1


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (any dtype, any device), row-major."""
    return host_bytes(t).tobytes()


def splitmix64(z: int) -> int:
    """The splitmix64 finalizer of ``z`` (taken modulo 2**64)."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def lp(*parts: bytes) -> bytes:
    """The parts, each preceded by its length (8 bytes, little-endian): an unambiguous framing."""
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def unit_floats(data: bytes, n: int) -> list[float]:
    """n floats in [-1, 1] derived from `data` by SHAKE-256."""
    raw = hashlib.shake_256(data).digest(2 * n)
    return [v / 32767.5 - 1.0 for v in struct.unpack(f"<{n}H", raw)]
