"""The lossless codec (``store.codec=lossless``): a bf16 exponent split, bit-exact.

A bf16 value is 1 sign, 8 exponent and 7 mantissa bits. Activations use few exponents (a KV
value's magnitudes span a few octaves), so the exponent byte carries 2-3 bits of information while
sign and mantissa are close to random. The codec splits each value into two planes:

- ``sm``: sign and mantissa, one byte per value (``s << 7 | m``), stored raw;
- the exponent plane, coded with a dictionary of its ``2**b - 1`` most frequent exponents: each
  value's exponent becomes a ``b``-bit code (`cacheseek.codecs.bitpack`), the code ``2**b - 1``
  is an escape whose exponent byte follows in ``esc`` (in order). ``b`` (1..7) is chosen per value
  from the exponent histogram to minimise the encoded size.

Typical bf16 KV: ``b = 3`` or ``4``, 11-12 bits per value, a ratio of about 1.33-1.45. A value
that does not pay (random bits, other dtypes) is stored ``raw`` in the same container, so the
encoded size never exceeds the raw size by more than the header.

Every step is a torch op (histogram, gather, shifts, masked scatter): the same code is the CPU
reference and the GPU codec. Decode checks that the number of escape codes is the number of
escape bytes stored (a sync); the store's checksum already covers the encoded bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from cacheseek.codecs import container
from cacheseek.codecs.base import KVCodec
from cacheseek.codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from cacheseek.errors import CorruptValueError
from cacheseek.registry import CODECS

__all__ = ["ExponentSplitCodec", "choose_bits"]

_MAX_BITS = 7


def choose_bits(hist: list[int], n: int) -> tuple[int, int]:
    """``(b, encoded exponent bytes)`` minimising codes plus escapes plus the table, from the
    exponent histogram (256 counts, any order)."""
    counts = sorted(hist, reverse=True)
    best = None
    covered = 0
    for b in range(1, _MAX_BITS + 1):
        k = (1 << b) - 1
        covered = sum(counts[:k])
        size = packed_nbytes(n, b) + (n - covered) + k
        if best is None or size < best[1]:
            best = (b, size)
    return best


@CODECS.register("lossless")
class ExponentSplitCodec(KVCodec):
    """bf16 exponent split; see the module docstring."""

    name = "lossless"
    version = 1
    lossy = False

    def encode(self, value: torch.Tensor, role: str) -> torch.Tensor:
        t = self.check_value(role, value).detach().contiguous()
        header = {"codec": self.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        n = t.numel()
        if t.dtype != torch.bfloat16 or n == 0:
            return container.pack({**header, "mode": "raw"}, [("raw", t)])
        pairs = t.reshape(-1).view(torch.uint8).view(-1, 2)  # little-endian: low byte, then high byte
        lo, hi = pairs[:, 0], pairs[:, 1]
        exp = ((hi & 0x7F) << 1) | (lo >> 7)
        sm = (hi & 0x80) | (lo & 0x7F)
        hist = torch.bincount(exp.to(torch.int32), minlength=256)
        bits, exp_bytes = choose_bits(hist.tolist(), n)
        if exp_bytes >= n:
            return container.pack({**header, "mode": "raw"}, [("raw", t)])
        esc = (1 << bits) - 1
        order = torch.argsort(hist, descending=True, stable=True)[:esc]
        table = order.to(torch.uint8)
        lut = torch.full((256,), esc, dtype=torch.uint8, device=t.device)
        lut[order] = torch.arange(esc, dtype=torch.int32, device=t.device).to(torch.uint8)
        codes = lut.index_select(0, exp.to(torch.int32))
        escaped = exp[codes == esc]
        header.update(mode="split", bits=bits, n_esc=int(escaped.numel()))
        return container.pack(header, [("table", table), ("codes", pack_bits(codes, bits)), ("sm", sm),
                                       ("esc", escaped)])

    def decode(self, key: str, value: Any, device: torch.device | str | None = None) -> torch.Tensor:
        got = container.parse(key, value, self.name)
        h = got.header
        dtype, shape, n = container.DTYPES[h["dtype"]], h["shape"], h["numel"]
        device = torch.device(device) if device is not None else value.device

        def corrupt(problem: str) -> CorruptValueError:
            return CorruptValueError(key, f"{self.name} codec: {problem}")

        if h.get("mode") == "raw":
            raw = got.sections.get("raw")
            if raw is None or raw.numel() != n * torch.empty((), dtype=dtype).element_size():
                raise corrupt("raw section does not match the shape")
            return raw.to(device).view(dtype).reshape(shape)
        if h.get("mode") != "split" or dtype != torch.bfloat16:
            raise corrupt(f"unknown mode {h.get('mode')!r} for {h['dtype']}")
        bits, n_esc = h.get("bits"), h.get("n_esc")
        if not isinstance(bits, int) or not 1 <= bits <= _MAX_BITS or not isinstance(n_esc, int) or n_esc < 0:
            raise corrupt(f"bad bits {bits!r} or escape count {n_esc!r}")
        esc = (1 << bits) - 1
        s = got.sections
        if (set(s) != {"table", "codes", "sm", "esc"} or s["table"].numel() != esc or s["sm"].numel() != n
                or s["codes"].numel() != packed_nbytes(n, bits) or s["esc"].numel() != n_esc):
            raise corrupt("section sizes do not match the header")
        codes = unpack_bits(s["codes"].to(device), bits, n)
        table = torch.cat([s["table"].to(device), torch.zeros(1, dtype=torch.uint8, device=device)])
        exp = table.index_select(0, codes.to(torch.int32))
        if n_esc:
            mask = codes == esc
            found = int(mask.sum())
            if found != n_esc:
                raise corrupt(f"{found} escape codes, {n_esc} escaped exponents stored")
            exp.masked_scatter_(mask, s["esc"].to(device))
        elif bool((codes == esc).any()):
            raise corrupt(f"escape codes, {n_esc} escaped exponents stored")
        sm = s["sm"].to(device)
        out = torch.stack([((exp & 1) << 7) | (sm & 0x7F), (sm & 0x80) | (exp >> 1)], 1)  # low, high byte
        return out.view(torch.bfloat16).reshape(shape)
