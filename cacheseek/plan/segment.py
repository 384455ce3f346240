"""`HostSegment`: one mapped, pre-faulted range of host memory, with its setup timers.

What every in-process Plan client maps: the embedded store's value segment, the Fluxon public
client's staging, and both clients' plan-table arenas. ``backing``:

- ``"shared"``: an anonymous MAP_SHARED mapping;
- ``"private"``: an anonymous MAP_PRIVATE mapping;
- ``"shm"``: a MAP_SHARED file in ``shm_dir`` (default /dev/shm), unlinked at `close` (how a Fluxon
  owner's segment looks).

With ``hugepages`` a segment of 2 MiB or more is advised MADV_HUGEPAGE (advice only: the kernel
may refuse); the bytes actually backed by huge pages are read back from ``/proc/self/smaps``
(``huge_bytes``, -1 when unreadable). With ``prefault`` the pages are faulted in at once, so that
registering the segment and the first write pay for none: libc ``madvise(MADV_POPULATE_WRITE)``
through ctypes (which releases the GIL) from up to ``prefault_threads`` threads (0 = one per CPU
up to 16; one per 256 MiB at most), ``memset`` where the kernel refuses. ``fault_method`` says
which ran: "madvise", "touch", "mixed" or "none". Without ``prefault`` the caller may fault the
segment part by part (`fault`: the Plan tier faults a piece, registers it, then the next one);
`fault_rest` faults what is left after the faulted prefix.

Lifecycle: mapped by the constructor; ``ptr`` is valid until `close` (idempotent).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import tempfile
import threading
import time
from typing import Optional

__all__ = ["HostSegment", "BACKINGS", "PAGE", "PREFAULT_SLICE", "auto_threads", "huge_page_bytes", "page_round"]

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_HUGE_PAGE = 2 << 20
PREFAULT_SLICE = 256 << 20  # one thread per 256 MiB, up to prefault_threads
_POPULATE_STEP = 4 << 20  # bytes of one madvise(MADV_POPULATE_WRITE) call (a multiple of 2 MiB)
_MAX_AUTO_THREADS = 16
PAGE = mmap.PAGESIZE
BACKINGS = ("shared", "private", "shm")


def page_round(length: int) -> int:
    """``length`` rounded up to whole pages."""
    return -(-length // PAGE) * PAGE


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def auto_threads(threads: int) -> int:
    """``threads``, or for 0 one per CPU (up to 16)."""
    return threads if threads > 0 else max(1, min(_MAX_AUTO_THREADS, os.cpu_count() or 1))


def huge_page_bytes(ptr: int) -> int:
    """Bytes of the mapping that starts at ``ptr`` backed by 2 MiB pages (AnonHugePages plus
    ShmemPmdMapped and FilePmdMapped in ``/proc/self/smaps``); -1 when that cannot be read."""
    start = f"{ptr:x}-"
    try:
        with open("/proc/self/smaps") as f:
            found = False
            total = 0
            for line in f:
                if not found:
                    found = line.startswith(start)
                    continue
                if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
                    break  # the next mapping
                key, _, rest = line.partition(":")
                if key in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"):
                    total += int(rest.split()[0]) * 1024
            return total if found else -1
    except (OSError, ValueError, IndexError):
        return -1


class HostSegment:
    """``length`` bytes of host memory at ``ptr`` (see the module docstring), with the timers
    ``map_seconds``, ``fault_seconds``, ``fault_method``, ``threads`` and ``huge_bytes``."""

    def __init__(self, length: int, backing: str, shm_dir: Optional[str], prefault_threads: int, *, prefault: bool,
                 hugepages: bool = True) -> None:
        if backing not in BACKINGS:
            raise ValueError(f"unknown backing {backing!r}; use one of: {', '.join(BACKINGS)}")
        t0 = time.perf_counter()
        self.length = length
        self._path: Optional[str] = None
        if backing == "shm":
            fd, self._path = tempfile.mkstemp(prefix="cacheseek-plan-", dir=shm_dir or "/dev/shm")
            try:
                os.ftruncate(fd, length)
                self._mm: Optional[mmap.mmap] = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            except BaseException:
                os.unlink(self._path)
                raise
            finally:
                os.close(fd)
        else:
            flags = mmap.MAP_SHARED if backing == "shared" else mmap.MAP_PRIVATE
            self._mm = mmap.mmap(-1, length, flags=flags)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.ptr = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open
        libc = _libc()
        self.hugepages = bool(hugepages and length >= _HUGE_PAGE and libc is not None)
        if self.hugepages:
            libc.madvise(self.ptr, length, _MADV_HUGEPAGE)  # type: ignore[union-attr]  # advice only
        self.map_seconds = time.perf_counter() - t0
        self.threads = 0
        self.fault_seconds = 0.0
        self.faulted_end = 0  # bytes faulted from the start on
        self._libc = libc
        self._prefault_threads = prefault_threads
        self._methods: set[str] = set()
        self.huge_bytes = 0
        if prefault:
            self.fault(0, length)

    @property
    def fault_method(self) -> str:
        """"madvise", "touch", "mixed" or "none" (nothing faulted yet)."""
        if not self._methods:
            return "none"
        return next(iter(self._methods)) if len(self._methods) == 1 else "mixed"

    def fault_rest(self) -> None:
        """Fault whatever follows the faulted prefix (nothing when the whole segment is)."""
        if self.faulted_end < self.length:
            self.fault(self.faulted_end, self.length - self.faulted_end)

    def fault(self, off: int, size: int) -> None:
        """Pre-fault ``[off, off + size)`` of the segment (see the module docstring); adds to
        ``fault_seconds`` and refreshes ``huge_bytes``."""
        if off < 0 or size <= 0 or off + size > self.length:
            raise ValueError(f"fault range [{off}, +{size}) is outside the {self.length}-byte segment")
        t0 = time.perf_counter()
        self._methods.add(self._prefault(off, size))
        self.fault_seconds += time.perf_counter() - t0
        if off <= self.faulted_end:
            self.faulted_end = max(self.faulted_end, off + size)
        if self.faulted_end == self.length:
            self.huge_bytes = huge_page_bytes(self.ptr) if self.hugepages else 0

    def _prefault(self, base: int, length: int) -> str:
        libc = self._libc
        n = max(1, min(auto_threads(self._prefault_threads), math.ceil(length / PREFAULT_SLICE)))
        step = -(-length // n // PAGE) * PAGE
        if self.hugepages:
            step = -(-step // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages per thread
        slices = [(base + off, min(step, length - off)) for off in range(0, length, step)]
        self.threads = max(self.threads, len(slices))
        methods: list[str] = []

        def fault(off: int, size: int) -> None:
            # In steps: one MADV_POPULATE_WRITE call holds the process's mmap lock while it runs,
            # so a whole 1.5 GiB slice would stall every mmap meanwhile (cudaMalloc included)
            # for a second; a step of 4 MiB stalls one for about a millisecond.
            end, used = off + size, set()
            for start in range(off, end, _POPULATE_STEP):
                n = min(_POPULATE_STEP, end - start)
                if libc is not None and libc.madvise(self.ptr + start, n, _MADV_POPULATE_WRITE) == 0:
                    used.add("madvise")
                else:
                    ctypes.memset(self.ptr + start, 0, n)
                    used.add("touch")
            methods.extend(used)

        workers = [threading.Thread(target=fault, args=s, daemon=True) for s in slices[1:]]
        for w in workers:
            w.start()
        fault(*slices[0])
        for w in workers:
            w.join()
        used = set(methods)
        return used.pop() if len(used) == 1 else "mixed"

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Unmap (and unlink an ``shm`` file). Idempotent; ``ptr`` is invalid afterwards."""
        if self._mm is None:
            return
        self._mm.close()
        self._mm = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
