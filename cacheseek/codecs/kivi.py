"""The quantized codecs (``store.codec=int8|int4``), KIVI-style, lossy and opt-in.

A K or V value ``[..., tokens, heads, head_dim]`` is viewed as a matrix ``[tokens, channels]``
(channels = heads x head_dim). Following KIVI (Liu et al., 2024), K is quantized per channel (K has
outlier channels: one scale per channel and group of ``group`` tokens) and V per token (one scale
per token and group of ``group`` channels). Each group stores its minimum and step (float32) beside
the codes; a code is ``round((x - min) / step)`` in ``0 .. 2**bits - 1``, int4 two to a byte.

Dequantized values are rounded back to the value's dtype. The restored KV differs from what was
computed, so the gate reports a quality verdict instead of bit-exactness (``lossy = True``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cacheseek.codecs import container
from cacheseek.codecs.base import ROLES, KVCodec
from cacheseek.codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from cacheseek.errors import CorruptValueError, StoreError
from cacheseek.registry import CODECS

__all__ = ["KiviCodec", "Int8Codec", "Int4Codec"]

GROUP = 128


def _matrix_shape(shape: list[int]) -> tuple[int, int]:
    """``(tokens, channels)`` of a value of ``shape``: the last two dims are channels when it has
    at least three (BSHD), else the last one."""
    if not shape:
        return 1, 1
    split = len(shape) - (2 if len(shape) >= 3 else 1)
    return math.prod(shape[:split]), math.prod(shape[split:])


def _grouped(x: torch.Tensor, role: str, group: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` ``[rows, cols]`` float32 padded and reshaped so every row of the result is one
    quantization group: K groups ``group`` tokens of one channel, V ``group`` channels of one token."""
    rows, cols = x.shape
    if role == "k":
        pad = -rows % group
        if pad:
            x = torch.cat([x, x[-1:].expand(pad, cols)])
        g = x.view(-1, group, cols).transpose(1, 2).reshape(-1, group)
    else:
        pad = -cols % group
        if pad:
            x = torch.cat([x, x[:, -1:].expand(rows, pad)], 1)
        g = x.view(rows, -1, group).reshape(-1, group)
    return g, x.shape


def _ungrouped(g: torch.Tensor, role: str, group: int, padded: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    prow, pcol = padded
    if role == "k":
        x = g.view(prow // group, pcol, group).transpose(1, 2).reshape(prow, pcol)
    else:
        x = g.view(prow, pcol // group, group).reshape(prow, pcol)
    return x[:rows, :cols]


class KiviCodec(KVCodec):
    """``bits``-bit KIVI quantization; see the module docstring."""

    bits = 8
    lossy = True
    version = 1

    def encode(self, value: torch.Tensor, role: str) -> torch.Tensor:
        t = self.check_value(role, value).detach()
        if role not in ROLES:
            raise StoreError(f"codec {self.name}: role {role!r} is not k or v")
        shape = list(t.shape)
        rows, cols = _matrix_shape(shape)
        header = {"codec": self.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": shape,
                  "role": role, "group": GROUP, "bits": self.bits}
        if t.numel() == 0:
            return container.pack(header, [])
        g, padded = _grouped(t.reshape(rows, cols).float(), role, GROUP)
        lo = g.amin(1, keepdim=True)
        # A tensor divisor, not a Python number: CUDA divides by a scalar as a multiply by its
        # reciprocal, which rounds differently from the CPU; one format on every device.
        step = (g.amax(1, keepdim=True) - lo) / torch.full_like(lo, (1 << self.bits) - 1)
        step = torch.where(step > 0, step, torch.ones_like(step))
        q = ((g - lo) / step).round_().clamp_(0, (1 << self.bits) - 1).to(torch.uint8)
        header["padded"] = list(padded)
        codes = q.reshape(-1) if self.bits == 8 else pack_bits(q.reshape(-1), self.bits)
        return container.pack(header, [("lo", lo.reshape(-1)), ("step", step.reshape(-1)), ("codes", codes)])

    def decode(self, key: str, value: Any, device: torch.device | str | None = None) -> torch.Tensor:
        got = container.parse(key, value, self.name)
        h = got.header
        dtype, shape, n = container.DTYPES[h["dtype"]], h["shape"], h["numel"]
        device = torch.device(device) if device is not None else value.device
        if h.get("bits") != self.bits or h.get("group") != GROUP or h.get("role") not in ROLES:
            raise CorruptValueError(key, f"{self.name} codec: bits, group or role do not match")
        if n == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        rows, cols = _matrix_shape(shape)
        padded = h.get("padded")
        role = h["role"]
        want = [rows + (-rows % GROUP), cols] if role == "k" else [rows, cols + (-cols % GROUP)]
        s = got.sections
        groups = want[0] * want[1] // GROUP
        code_bytes = groups * GROUP if self.bits == 8 else packed_nbytes(groups * GROUP, self.bits)
        if (padded != want or set(s) != {"lo", "step", "codes"} or s["lo"].numel() != 4 * groups
                or s["step"].numel() != 4 * groups or s["codes"].numel() != code_bytes):
            raise CorruptValueError(key, f"{self.name} codec: section sizes do not match the header")
        codes = s["codes"].to(device)
        q = codes if self.bits == 8 else unpack_bits(codes, self.bits, groups * GROUP)
        lo = s["lo"].to(device).view(torch.float32).view(-1, 1)
        step = s["step"].to(device).view(torch.float32).view(-1, 1)
        g = q.view(-1, GROUP).to(torch.float32) * step + lo
        return _ungrouped(g, role, GROUP, tuple(want), rows, cols).to(dtype).reshape(shape)


@CODECS.register("int8")
class Int8Codec(KiviCodec):
    name = "int8"
    bits = 8


@CODECS.register("int4")
class Int4Codec(KiviCodec):
    name = "int4"
    bits = 4
