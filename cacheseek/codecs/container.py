"""The byte container every codec writes: one ``uint8`` tensor per value.

Layout: ``MAGIC`` (8 bytes), header length (u32 little-endian), a JSON header padded with spaces
to a multiple of 16 bytes, then the sections named in the header, each padded to 16 bytes (so a
section can be viewed as float32 in place). The header names the codec and its format version,
the decoded dtype and shape, the codec's parameters and each section's name and length.

The container is one tensor so a store writes it like any other (LocalDisk: kind ``tensor``,
dtype ``uint8``; its checksum covers these encoded bytes). `parse` trusts nothing: a value that is
not a ``uint8`` tensor, a bad magic, an unreadable header or section lengths that do not add up to
the value's size raise `CorruptValueError` (read as a miss, never as wrong KV).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from cacheseek.errors import CorruptValueError

__all__ = ["MAGIC", "pack", "parse", "Parsed", "DTYPES"]

MAGIC = b"CSKCODEC"
_HLEN = struct.Struct("<I")
_ALIGN = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _pad(n: int) -> int:
    return -n % _ALIGN


def pack(header: dict[str, Any], sections: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One ``uint8`` tensor on the sections' device: magic, header, the sections (each a
    contiguous tensor of any dtype, stored as its bytes)."""
    device = sections[0][1].device if sections else torch.device("cpu")
    parts: list[torch.Tensor] = []
    names = []
    for name, t in sections:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        names.append([name, int(raw.numel())])
        parts.append(raw)
        if _pad(raw.numel()):
            parts.append(torch.zeros(_pad(raw.numel()), dtype=torch.uint8, device=device))
    meta = json.dumps({**header, "sections": names}, sort_keys=True, separators=(",", ":")).encode()
    meta += b" " * _pad(len(MAGIC) + _HLEN.size + len(meta))
    head = torch.frombuffer(bytearray(MAGIC + _HLEN.pack(len(meta)) + meta), dtype=torch.uint8)
    return torch.cat([head.to(device)] + parts)


@attrs.frozen
class Parsed:
    """A parsed container: its header (without ``sections``) and each section as a ``uint8``
    slice of the value (on the value's device)."""

    header: dict
    sections: dict

    def section(self, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return self.sections[name].view(dtype)


def parse(key: str, value: Any, codec: str) -> Parsed:
    """Check and split an encoded value that ``codec`` wrote; `CorruptValueError` otherwise."""
    def corrupt(problem: str) -> CorruptValueError:
        return CorruptValueError(key, f"{codec} codec: {problem}")

    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise corrupt(f"not an encoded value (a {getattr(value, 'dtype', type(value).__name__)} value; "
                      "written under another codec?)")
    size = int(value.numel())
    prefix = bytes(value[: len(MAGIC) + _HLEN.size].cpu().numpy().tobytes())
    if len(prefix) < len(MAGIC) + _HLEN.size or prefix[: len(MAGIC)] != MAGIC:
        raise corrupt("bad magic")
    (hlen,) = _HLEN.unpack(prefix[len(MAGIC):])
    start = len(MAGIC) + _HLEN.size
    if start + hlen > size:
        raise corrupt("truncated header")
    try:
        header = json.loads(bytes(value[start:start + hlen].cpu().numpy().tobytes()))
        sections = [(str(n), int(ln)) for n, ln in header.pop("sections")]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        raise corrupt("unreadable header") from None
    if header.get("codec") != codec:
        raise corrupt(f"written by codec {header.get('codec')!r}")
    if header.get("dtype") not in DTYPES:
        raise corrupt(f"bad dtype {header.get('dtype')!r}")
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise corrupt(f"bad shape {shape!r}")
    header["numel"] = math.prod(shape)
    out = {}
    at = start + hlen
    for name, n in sections:
        if n < 0 or at + n > size:
            raise corrupt(f"section {name} runs past the value's {size} bytes")
        out[name] = value[at:at + n]
        at += n + _pad(n)
    if at != size:
        raise corrupt(f"{size} bytes, the sections account for {at}")
    return Parsed(header, out)
