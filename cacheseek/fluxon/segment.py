"""The owner's segment file as this process maps it.

fluxon-py 0.2.4 maps ``<share_mem_path>/<cluster>/mmap.file`` twice in every client process:
read-only (``r--s``, where zero-copy value views point) and read-write (``rw-s``, where the
native client writes a put's payload). `mappings_of` reads them from ``/proc/self/maps``;
`zero_copy_mapping` picks the one views point into; `file_generation` names the file's identity,
which changes when a restarted owner recreates it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["SegmentMapping", "mappings_of", "zero_copy_mapping", "file_generation"]


@dataclass(frozen=True)
class SegmentMapping:
    """The owner's segment file as mapped in this process (from /proc/self/maps)."""

    path: str
    start: int
    end: int
    perms: str  # e.g. "r--s": read-only, shared

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def writable(self) -> bool:
        return "w" in self.perms

    def contains(self, ptr: int, nbytes: int = 0) -> bool:
        return self.start <= ptr and ptr + nbytes <= self.end


def mappings_of(path: Union[str, os.PathLike[str]], maps: str = "/proc/self/maps") -> list[SegmentMapping]:
    """Every mapping of the file ``path`` (resolved) in this process, in address order."""
    target = os.path.realpath(path)
    out: list[SegmentMapping] = []
    with open(maps) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append(SegmentMapping(target, lo, hi, parts[1]))
    return out


def zero_copy_mapping(maps: list[SegmentMapping]) -> Optional[SegmentMapping]:
    """The read-only mapping zero-copy views point into (the largest such; None if there is no
    mapping). Falls back to the largest mapping of any kind when no read-only one exists."""
    ro = [m for m in maps if not m.writable] or maps
    return max(ro, key=lambda m: m.length, default=None)


def file_generation(path: Union[str, os.PathLike[str]]) -> int:
    """An identity of the file (its inode and device, folded to 31 bits)."""
    st = os.stat(path)
    return ((st.st_ino * 1_000_003) ^ st.st_dev) & 0x7FFF_FFFF
