"""Packing of b-bit codes (1 <= b <= 8) into bytes with torch ops (CPU and CUDA alike).

Eight codes make one ``b``-byte group: code ``i`` of a group sits at bits ``b*i .. b*i+b-1`` of a
little-endian word. Codes are padded with zeros to a multiple of eight. For ``b`` of 1, 2, 4 and 8
(``8 / b`` codes to a byte) that is computed on ``uint8`` tensors alone (a few passes over the
packed bytes: the fast path on a GPU); other widths go through 64-bit words.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]


def packed_nbytes(n: int, bits: int) -> int:
    return -(-n // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes``: ``uint8`` of any length, each < ``2**bits``; returns ``packed_nbytes`` bytes."""
    n = codes.numel()
    pad = -n % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if bits == 8:
        return codes
    if bits in (1, 2, 4):
        per = codes.view(-1, 8 // bits)
        out = per[:, 0].clone()
        for i in range(1, 8 // bits):
            out |= per[:, i] << (bits * i)
        return out
    c = codes.view(-1, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(1, dtype=torch.int64)
    out = (word.unsqueeze(1) >> (torch.arange(bits, device=codes.device, dtype=torch.int64) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` codes of ``packed`` (`pack_bits`'s output), as ``uint8``."""
    if bits == 8:
        return packed[:n]
    if bits in (1, 2, 4):
        mask = (1 << bits) - 1
        parts = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
        return torch.stack(parts, 1).reshape(-1)[:n]
    b = packed.view(-1, bits).to(torch.int64)
    word = (b << (torch.arange(bits, device=packed.device, dtype=torch.int64) * 8)).sum(1, dtype=torch.int64)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)[:n]
