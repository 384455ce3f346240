"""Byte sizes as people write them, in one parser for every size CacheSeek takes.

``parse_size`` accepts an int (a byte count) or a string: ``"4096"``, ``"512MiB"``, ``"24GiB"``,
``"1.5GiB"``, ``"64M"``, ``"16k"``. Units are binary throughout (``K``/``KiB`` = 1024,
``M``/``MiB`` = 1024**2, ``G``..., ``T``...), as Fluxon reads its own ``dram`` setting, so one
spelling means the same number everywhere. Units take any case (``64mib`` = ``64MiB``), and a
whole float (``1e9``, which YAML reads as a float) is that many bytes; `describe_given` says
both explicitly in the line each given size is echoed with at start. A size above `MAX_SIZE`
(16 EiB, beyond any machine) is refused; `cacheseek.sizing` refuses one above the machine's
whole memory or disk, with the figure. The decimal spellings (``kB``, ``MB``,
``GB``, ``TB``) are refused, with the binary spelling and the decimal byte count as the fix: one
reader takes ``1.5GB`` for 1.5 * 10**9 bytes and another for 1.5 * 2**30, and a store sized 7%
off the user's intent is found only when it fills. A size is one word: ``"5 GiB"`` is refused
too (a shell-quoted override with a space is more often two values run together than one).
Two words besides numbers:

- ``"auto"`` (where the caller allows it): the size is fitted to the workload by
  `cacheseek.sizing` before the store is built; stores built directly never see it;
- ``None`` / ``"null"`` / ``"none"`` (where the caller allows it): no bound.

Every bad value raises `ConfigError` naming the field, with the spelling that works as the fix.
`format_size` writes sizes back in the same units; `available_memory`, `free_bytes` and
`device_free_bytes` say how much room there is (for ``auto`` and for refusing a size the machine cannot hold).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Union

from cacheseek.errors import ConfigError

__all__ = ["AUTO", "MAX_SIZE", "Size", "available_memory", "device_free_bytes", "disk_total_bytes", "format_size",
           "describe_given", "free_bytes", "parse_size", "total_memory"]

AUTO = "auto"
Size = Union[int, str]  # what a config field holds before `parse_size`: 4096, "512MiB", "auto"

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tib": 1 << 40,
}
_CANONICAL = {"k": "KiB", "kib": "KiB", "m": "MiB", "mib": "MiB", "g": "GiB", "gib": "GiB", "t": "TiB", "tib": "TiB"}
MAX_SIZE = 1 << 64  # no machine has this much memory or disk
_DECIMAL = {"kb": ("KiB", 10**3), "mb": ("MiB", 10**6), "gb": ("GiB", 10**9), "tb": ("TiB", 10**12)}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)(\s*)([A-Za-z]*)")
_FIX = "write a byte count or a size with a binary unit, e.g. 512MiB or 24GiB"


def parse_size(value: Any, field: str, *, allow_auto: bool = False, allow_none: bool = False,
               minimum: int = 0) -> Any:
    """``value`` as an int of bytes (or `AUTO`, or None, where allowed). ConfigError naming
    ``field`` when it is not a size, is below ``minimum``, or is a word that is not allowed."""
    words = ("auto" if allow_auto else "") + (" null" if allow_none else "")
    fix = _FIX + (f", or {' or '.join(words.split())}" if words.strip() else "")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
        if allow_none:
            return None
        raise ConfigError(field, "needs a size, got null", fix)
    if isinstance(value, str) and value.strip().lower() == AUTO:
        if allow_auto:
            return AUTO
        raise ConfigError(field, "'auto' is not accepted here", _FIX)
    if isinstance(value, bool):
        raise ConfigError(field, f"expected a size, got {value!r}", fix)
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        n = _parse_text(value, field, fix)
    else:
        raise ConfigError(field, f"expected a size, got {type(value).__name__} {value!r}", fix)
    if n < minimum:
        raise ConfigError(field, f"must be at least {format_size(minimum)}, got {value!r}", fix)
    if n >= MAX_SIZE:
        raise ConfigError(field, f"{value!r} is {n:.3g} bytes, more than any machine has (16 EiB)", fix)
    return n


def _parse_text(value: str, field: str, fix: str) -> int:
    """A size written as text: a number and a binary unit, in one word (see the module doc)."""
    m = _SIZE_RE.fullmatch(value.strip())
    if not m:
        raise ConfigError(field, f"cannot read {value!r} as a size", fix)
    number, space, unit = m.groups()
    if unit.lower() in _DECIMAL:
        binary, scale = _DECIMAL[unit.lower()]
        raise ConfigError(field, f"{value!r} has a decimal unit, and sizes take binary units",
                          f"write {number}{binary} (binary) or {int(float(number) * scale)} "
                          f"(the decimal {number}{unit} in bytes)")
    if unit.lower() not in _UNITS:
        raise ConfigError(field, f"cannot read {value!r} as a size", fix)
    if space:
        raise ConfigError(field, f"{value!r} has a space inside", f"write it as one word: {number}{unit}")
    return int(float(number) * _UNITS[unit.lower()])


def describe_given(value: Any) -> str:
    """How a given size was read, when its spelling is not the canonical one: a unit in another
    case (``64mib``: "units are binary, any case: 64MiB"), a float (``1e9``: "a float, read as a
    whole byte count"); "" otherwise."""
    if isinstance(value, float):
        return f"{value!r} is a float, read as {int(value)} bytes, not a decimal size: sizes take binary units"
    m = _SIZE_RE.fullmatch(str(value).strip()) if isinstance(value, str) else None
    if m is None or not m.group(3):
        return ""
    number, _, unit = m.groups()
    canonical = _CANONICAL.get(unit.lower())
    if canonical is None or unit == canonical:
        return ""
    return f"{unit!r} is read as {canonical} (binary, any case): {number}{canonical}"


def format_size(n: Optional[float]) -> str:
    """``1.50 GiB``, ``512 MiB``, ``4 KiB``, ``96 B``; None reads as ``unbounded``."""
    if n is None:
        return "unbounded"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}".replace(".00 ", " ")
    return f"{n:.0f} B"


def available_memory(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` in bytes (what can be allocated without swapping), or None if unknown."""
    return _meminfo("MemAvailable", meminfo)


def total_memory(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """``MemTotal`` in bytes (all the memory the machine has), or None if unknown."""
    return _meminfo("MemTotal", meminfo)


def _meminfo(key: str, meminfo: str) -> Optional[int]:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_free_bytes(device: Any) -> int:
    """Free bytes of a torch device: CUDA ``mem_get_info``, the host's ``MemAvailable`` for the
    CPU. ConfigError naming ``store.capacity_fraction`` where the host's cannot be read."""
    if getattr(device, "type", str(device).split(":")[0]) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    free = available_memory()
    if free is None:
        raise ConfigError("store.capacity_fraction", "the free host memory cannot be read here",
                          "give store.capacity_bytes instead")
    return free


def free_bytes(path: Union[str, os.PathLike[str]]) -> Optional[int]:
    """Bytes free to an unprivileged writer on the file system holding ``path`` (its nearest
    existing parent), or None if unknown."""
    st = _statvfs(path)
    return None if st is None else st.f_bavail * st.f_frsize


def disk_total_bytes(path: Union[str, os.PathLike[str]]) -> Optional[int]:
    """The size of the file system holding ``path`` (its nearest existing parent), or None."""
    st = _statvfs(path)
    return None if st is None else st.f_blocks * st.f_frsize


def _statvfs(path: Union[str, os.PathLike[str]]) -> Any:
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return os.statvfs(p)
    except OSError:
        return None
