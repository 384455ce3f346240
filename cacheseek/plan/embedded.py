"""`EmbeddedPlanClient`: an in-process Plan store over one host memory segment.

The single-machine tier that needs no service, and the Plan test bed. It offers the calls of
`cacheseek.plan.base.PlanClient` with the lifecycles documented there, over:

- one segment (``backing``): ``"shared"`` an anonymous MAP_SHARED mapping, ``"private"`` an
  anonymous MAP_PRIVATE mapping, or ``"shm"`` a MAP_SHARED file in ``shm_dir`` (how a Fluxon
  owner's segment looks). With ``hugepages`` (default) the segment is advised MADV_HUGEPAGE: a
  private mapping then gets 2 MiB pages where THP is ``madvise`` (the cheapest to fault and to
  register, docs/design.md section 4); shared memory gets them only where shmem THP is enabled (it is
  ``never`` on the H200 machine). The bytes actually backed by huge pages are read back from
  ``/proc/self/smaps`` into the segment timers. The segment is created and pre-faulted by
  ``wait_local_segments_ready`` (libc ``madvise(MADV_POPULATE_WRITE)`` through ctypes, which
  releases the GIL, from ``prefault_threads`` threads, 0 = one per CPU up to 16; ``memset`` where
  the kernel refuses), so that registering it with CUDA and the first write pay for no page fault;
- a first-fit allocator with ``alignment``-byte blocks that coalesces freed neighbours;
- a key index of published values; each value counts its readers. A remove or an overwrite
  unpublishes a value at once but frees its bytes only when the last reader releases its views;
- plan tables (FXPLANV1) allocated in a separate small arena (``table_arena()``), freed when the
  plan ends;
- ``generation``: bumped each time the segment is (re)created (`recreate_segment`).

A reservation that does not fit raises `StoreFullError` ("store full: need N bytes, X of Y used;
raise store.segment_bytes or free values"); nothing is evicted here. Thread-safe: one lock guards
the index, the allocator and the handles. `PlanFaults` injects failures at every step (tests).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import math
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError, PlanError, StoreClosedError, StoreFullError
from cacheseek.plan.base import (
    GetPlan,
    GetPlanState,
    InProcessPlanClient,
    PlanUsage,
    PutCommitResult,
    PutPlan,
    PutPlanState,
    SegmentMapping,
    SegmentTimers,
)
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.table import PLAN_MAGIC, encode_plan_table, plan_table_nbytes
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import Size, format_size, parse_size

__all__ = ["EmbeddedPlanClient", "EmbeddedPlanSchema", "PlanFaults"]

log = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE
_PREFAULT_SLICE = 256 << 20  # one thread per 256 MiB, up to prefault_threads
_MAX_AUTO_THREADS = 16
_BACKINGS = ("shared", "private", "shm")
_STORE_FULL_FIX = "raise store.segment_bytes or free values"


@dataclasses.dataclass
class EmbeddedPlanSchema:
    _target_: str = "cacheseek.plan.embedded.EmbeddedPlanClient"
    segment_bytes: Any = "1GiB"
    prefault_threads: int = 0
    backing: str = "shared"
    hugepages: bool = True
    shm_dir: Optional[str] = None
    alignment: int = 256
    table_arena_bytes: Any = "1MiB"


class PlanFaults:
    """Faults for `EmbeddedPlanClient`, armed by tests.

    Points (each fires on the ``nth`` next time the client reaches it, ``times`` times):
    ``put_start`` (start raises PlanError), ``commit_raise`` (the commit call raises after it was
    submitted), ``commit_status`` (the commit resolves with status 1, nothing published),
    ``get_start``, ``get_transfer`` (raises; the plan stays STARTED), ``remove`` (raises),
    ``table_magic`` / ``table_count`` / ``table_null`` (the next table is written corrupt).
    ``key_codes[key] = code`` makes the commit of ``key`` return that code (not published).
    """

    POINTS = (
        "put_start", "commit_raise", "commit_status", "get_start", "get_transfer", "remove",
        "table_magic", "table_count", "table_null",
    )

    def __init__(self) -> None:
        self._armed: dict[str, list[list[int]]] = {}
        self.key_codes: dict[str, int] = {}
        self.fired: list[str] = []

    def arm(self, point: str, *, nth: int = 1, times: int = 1) -> None:
        if point not in self.POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(self.POINTS)}")
        self._armed.setdefault(point, []).append([nth - 1, times])

    def fire(self, point: str) -> bool:
        for entry in self._armed.get(point, []):
            if entry[1] <= 0:
                continue
            if entry[0] > 0:
                entry[0] -= 1
                continue
            entry[1] -= 1
            self.fired.append(point)
            return True
        return False

    def key_code(self, key: str) -> int:
        return self.key_codes.get(key, 0)


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
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


class _Segment:
    """One mapped, pre-faulted segment (or the table arena): ``ptr``, ``length``, timers."""

    def __init__(
        self,
        length: int,
        backing: str,
        shm_dir: Optional[str],
        prefault_threads: int,
        *,
        prefault: bool,
        hugepages: bool = True,
    ) -> None:
        t0 = time.perf_counter()
        self.length = length
        self._path: Optional[str] = None
        if backing == "shm":
            fd, self._path = tempfile.mkstemp(prefix="cacheseek-plan-", dir=shm_dir or "/dev/shm")
            try:
                os.ftruncate(fd, length)
                self._mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            flags = mmap.MAP_SHARED if backing == "shared" else mmap.MAP_PRIVATE
            self._mm = mmap.mmap(-1, length, flags=flags)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.ptr = ctypes.addressof(self._anchor)
        libc = _libc()
        self.hugepages = bool(hugepages and length >= 2 << 20 and libc is not None)
        if self.hugepages:
            libc.madvise(self.ptr, length, _MADV_HUGEPAGE)  # advice only: refusal is harmless
        self.map_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.threads = 0
        self.fault_method = self._prefault(libc, prefault_threads) if prefault else "none"
        self.fault_seconds = time.perf_counter() - t1
        self.huge_bytes = huge_page_bytes(self.ptr) if self.hugepages else 0

    def _prefault(self, libc: Optional[ctypes.CDLL], threads: int) -> str:
        n = max(1, min(auto_threads(threads), math.ceil(self.length / _PREFAULT_SLICE)))
        step = -(-self.length // n // _PAGE) * _PAGE
        if self.hugepages:
            step = -(-step // (2 << 20)) * (2 << 20)  # whole huge pages per thread
        slices = [(off, min(step, self.length - off)) for off in range(0, self.length, step)]
        self.threads = len(slices)
        methods: list[str] = []

        def fault(off: int, size: int) -> None:
            if libc is not None and libc.madvise(self.ptr + off, size, _MADV_POPULATE_WRITE) == 0:
                methods.append("madvise")
                return
            ctypes.memset(self.ptr + off, 0, size)
            methods.append("touch")

        workers = [threading.Thread(target=fault, args=s, daemon=True) for s in slices[1:]]
        for w in workers:
            w.start()
        fault(*slices[0])
        for w in workers:
            w.join()
        used = set(methods)
        return used.pop() if len(used) == 1 else "mixed"

    def close(self) -> None:
        del self._anchor
        self._mm.close()
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


@attrs.define(eq=False)
class _Value:
    key: str
    offset: int
    length: int
    readers: int = 0
    retired: bool = False


@attrs.define(eq=False)
class _PutRecord:
    values: list[_Value]
    table: int  # offset in the table arena


@attrs.define(eq=False)
class _GetRecord:
    held: list[_Value]
    table: Optional[int] = None


@PLAN_CLIENTS.register("embedded", EmbeddedPlanSchema)
class EmbeddedPlanClient(InProcessPlanClient):
    """In-process Plan store (see the module docstring). ``faults``: a `PlanFaults` for tests."""

    _client_name = "embedded Plan store"
    _on_device = False  # values in host memory (a subclass may keep them on the device)

    def __init__(
        self,
        segment_bytes: Size = 1 << 30,
        prefault_threads: int = 0,
        backing: str = "shared",
        hugepages: bool = True,
        shm_dir: Optional[str] = None,
        alignment: int = 256,
        table_arena_bytes: Size = 1 << 20,
        *,
        prefault: bool = True,
        faults: Optional[PlanFaults] = None,
    ) -> None:
        for name, value, low in (("prefault_threads", prefault_threads, 0), ("alignment", alignment, 8)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"store.{name}", f"must be an int >= {low}, got {value!r}")
        if isinstance(segment_bytes, str) and segment_bytes.strip().lower() == "auto":
            raise ConfigError("store.segment_bytes", "'auto' is fitted to a workload by build_stack, "
                              "not by the client", "give a size such as 512MiB when building the client directly")
        segment_bytes = parse_size(segment_bytes, "store.segment_bytes", minimum=alignment)
        table_arena_bytes = parse_size(table_arena_bytes, "store.table_arena_bytes", minimum=4096)
        if alignment & (alignment - 1):
            raise ConfigError("store.alignment", f"must be a power of two, got {alignment}")
        if backing not in _BACKINGS:
            raise ConfigError(
                "store.backing", f"unknown backing {backing!r}", f"use one of: {', '.join(_BACKINGS)}"
            )
        self.segment_bytes = -(-segment_bytes // alignment) * alignment
        self.prefault_threads = prefault_threads
        self.backing = backing
        self.hugepages = bool(hugepages)
        self.shm_dir = shm_dir
        self.alignment = alignment
        self.table_arena_bytes = table_arena_bytes
        self.prefault = prefault
        self.faults = faults if faults is not None else PlanFaults()
        self._lock = threading.RLock()
        self._segment: Optional[_Segment] = None
        self._arena: Optional[_Segment] = None
        self._alloc: Optional[FirstFitAllocator] = None
        self._tables: Optional[FirstFitAllocator] = None
        self._index: dict[str, _Value] = {}
        self._live_puts: set[PutPlan] = set()
        self._live_gets: set[GetPlan] = set()
        self._generation = 0
        self._timers = SegmentTimers()
        self._closed = False

    # -- segments -------------------------------------------------------------------------------
    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        with self._lock:
            seg = self._ensure_segment()
            return [SegmentMapping(seg.ptr, seg.length, self._generation, True, self._on_device)]

    def _ensure_segment(self) -> _Segment:
        self._check_open()
        if self._segment is not None:
            return self._segment
        try:
            seg = self._new_segment()
        except OSError as exc:  # ENOMEM, ENOSPC in shm_dir: the size does not fit this machine
            raise ConfigError(
                "store.segment_bytes", f"cannot map a {format_size(self.segment_bytes)} {self.backing} "
                f"segment: {exc.strerror or exc}", "use store.segment_bytes=auto or a smaller size") from None
        try:
            arena = _Segment(self.table_arena_bytes, "private", None, 1, prefault=True, hugepages=False)
        except BaseException:
            seg.close()
            raise
        self._segment, self._arena = seg, arena
        self._alloc = FirstFitAllocator(seg.length, self.alignment)
        self._tables = FirstFitAllocator(arena.length, 64)
        self._generation += 1
        self._timers = SegmentTimers(
            seg.map_seconds, seg.fault_seconds, seg.fault_method, seg.threads, seg.huge_bytes, seg.length
        )
        log.info(
            "embedded Plan segment: %d MiB %s, generation %d, mapped in %.3f s, "
            "pre-faulted (%s, %d threads) in %.3f s, %d MiB in 2 MiB pages",
            seg.length >> 20,
            self.backing,
            self._generation,
            seg.map_seconds,
            seg.fault_method,
            seg.threads,
            seg.fault_seconds,
            max(seg.huge_bytes, 0) >> 20,
        )
        return seg

    def _new_segment(self) -> Any:
        """The value segment (``ptr``, ``length``, timers, ``close()``); a subclass may back it
        with other memory (`DevicePlanClient`: the runtime device's)."""
        return _Segment(
            self.segment_bytes, self.backing, self.shm_dir, self.prefault_threads,
            prefault=self.prefault, hugepages=self.hugepages,
        )

    def recreate_segment(self) -> list[SegmentMapping]:
        """Drop every value and map a fresh segment with the next generation. Refused while a
        plan or a view is live. Unregister the old mapping from the transfer runtime first."""
        with self._lock:
            self._check_open()
            if self._live_puts or self._live_gets:
                raise PlanError(
                    f"cannot recreate the segment: {len(self._live_puts)} put plans and "
                    f"{len(self._live_gets)} get plans are live"
                )
            self._unmap()
            return self.wait_local_segments_ready()

    def _unmap(self) -> None:
        self._index.clear()
        for seg in (self._segment, self._arena):
            if seg is not None:
                seg.close()
        self._segment = self._arena = None
        self._alloc = self._tables = None

    @property
    def generation(self) -> int:
        return self._generation

    # -- capability: PlanClientInfo -------------------------------------------------------------
    def table_arena(self) -> Optional[tuple[int, int]]:
        with self._lock:
            return None if self._arena is None else (self._arena.ptr, self._arena.length)

    def usage(self) -> PlanUsage:
        with self._lock:
            used = self._alloc.used if self._alloc is not None else 0
            return PlanUsage(used, self.segment_bytes, len(self._index))

    def segment_timers(self) -> SegmentTimers:
        return self._timers

    def live_handles(self) -> tuple[int, int]:
        """``(put plans STARTED, get plans not yet ended)``: both 0 when every handle was consumed."""
        with self._lock:
            return len(self._live_puts), len(self._live_gets)

    def keys(self) -> list[str]:
        """Published keys, sorted (tests and diagnostics)."""
        with self._lock:
            return sorted(self._index)

    # -- put ------------------------------------------------------------------------------------
    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        keys = tuple(keys)
        if not keys or len(set(keys)) != len(keys) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("local_fast_put_start needs distinct, non-empty string keys")
        if not isinstance(value_len, int) or isinstance(value_len, bool) or value_len <= 0:
            raise ValueError(f"value_len must be a positive int, got {value_len!r}")
        with self._lock:
            seg = self._ensure_segment()
            alloc = self._allocator()
            if self.faults.fire("put_start"):
                raise PlanError(f"injected fault: local_fast_put_start of {len(keys)} keys")
            values: list[_Value] = []
            try:
                for key in keys:
                    off = alloc.alloc(value_len)
                    if off is None:
                        raise StoreFullError(
                            f"store full: need {len(keys) * alloc.block(value_len)} bytes "
                            f"({len(keys)} values of {value_len} B), {alloc.used} of "
                            f"{alloc.capacity} used; {_STORE_FULL_FIX}"
                        )
                    values.append(_Value(key, off, value_len))
                table, ptr = self._write_table([seg.ptr + v.offset for v in values])
            except BaseException:
                self._free_values(values)
                raise
            plan = PutPlan(keys, owner=self, native=_PutRecord(values, table), value_len=value_len)
            self._live_puts.add(plan)
            return plan, ptr

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        with self._lock:
            self._check_handle(plan)
            plan.advance(
                (PutPlanState.STARTED,), PutPlanState.COMMIT_SUBMITTED, "local_fast_put_commit"
            )
            self._live_puts.discard(plan)
            record: _PutRecord = plan.native
            self._free_table(record.table)
            if self.faults.fire("commit_raise"):
                self._free_values(record.values)
                raise PlanError(f"injected fault: local_fast_put_commit of {len(plan.keys)} keys")
            if self.faults.fire("commit_status"):
                self._free_values(record.values)
                result = PutCommitResult(1, (0,) * len(plan.keys), "injected fault: commit status")
            else:
                codes = []
                for value in record.values:
                    code = self.faults.key_code(value.key)
                    if code:
                        self._allocator().free(value.offset)
                    else:
                        old = self._index.get(value.key)
                        self._index[value.key] = value
                        if old is not None:
                            self._retire(old)
                    codes.append(code)
                result = PutCommitResult(0, tuple(codes))
        future: Future[PutCommitResult] = Future()
        future.set_result(result)
        return future

    def put_abort(self, plan: PutPlan) -> None:
        with self._lock:
            self._check_handle(plan)
            plan.advance((PutPlanState.STARTED,), PutPlanState.ABORTED, "put_abort")
            self._live_puts.discard(plan)
            record: _PutRecord = plan.native
            self._free_table(record.table)
            self._free_values(record.values)

    # -- get ------------------------------------------------------------------------------------
    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        if not keys or any(not isinstance(g, int) or g <= 0 for g in lens) or sum(lens) != len(keys):
            raise ValueError(
                f"atomic_group_lens {lens} must be positive and sum to the {len(keys)} keys"
            )
        with self._lock:
            self._ensure_segment()
            if self.faults.fire("get_start"):
                raise PlanError(f"injected fault: get_start of {len(keys)} keys")
            held: list[_Value] = []
            pos = 0
            for g in lens:
                group = [self._index.get(k) for k in keys[pos : pos + g]]
                if any(v is None for v in group):
                    break
                held.extend(group)  # type: ignore[arg-type]
                pos += g
            for v in held:
                v.readers += 1
            plan = GetPlan(keys, owner=self, native=_GetRecord(held), atomic_group_lens=lens)
            self._live_gets.add(plan)
            return plan

    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.STARTED,), "get_transfer")
            if self.faults.fire("get_transfer"):
                raise PlanError("injected fault: get_transfer")
            record: _GetRecord = plan.native
            seg = self._ensure_segment()
            record.table, ptr = self._write_table([seg.ptr + v.offset for v in record.held])
            plan.advance((GetPlanState.STARTED,), GetPlanState.TRANSFERRING, "get_transfer")
            return ptr, len(record.held)

    def value_lengths(self, plan: GetPlan) -> tuple[int, ...]:
        """See `PlanValueLengths`."""
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.TRANSFERRING,), "value_lengths")
            return tuple(v.length for v in plan.native.held)

    def _end_read(self, plan: GetPlan) -> None:
        self._live_gets.discard(plan)
        record: _GetRecord = plan.native
        if record.table is not None:
            self._free_table(record.table)
            record.table = None
        for v in record.held:
            v.readers -= 1
            if v.readers == 0 and v.retired:
                self._allocator().free(v.offset)
        record.held = []

    # -- remove / close -------------------------------------------------------------------------
    def remove(self, key: str) -> None:
        with self._lock:
            self._check_open()
            if self.faults.fire("remove"):
                raise PlanError(f"injected fault: remove {key!r}")
            value = self._index.pop(key, None)
            if value is not None:
                self._retire(value)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._live_puts or self._live_gets:
                log.warning(
                    "closing the embedded Plan store with %d put plans and %d get plans live",
                    len(self._live_puts), len(self._live_gets),
                )
            self._unmap()
            self._live_puts.clear()
            self._live_gets.clear()
            self._closed = True

    # -- internals ------------------------------------------------------------------------------
    def _allocator(self) -> FirstFitAllocator:
        if self._alloc is None:
            raise StoreClosedError("embedded Plan store has no segment (closed)")
        return self._alloc

    def _retire(self, value: _Value) -> None:
        value.retired = True
        if value.readers == 0:
            self._allocator().free(value.offset)

    def _free_values(self, values: list[_Value]) -> None:
        for v in values:
            self._allocator().free(v.offset)

    def _write_table(self, pointers: list[int]) -> tuple[int, int]:
        tables, arena = self._tables, self._arena
        if tables is None or arena is None:
            raise StoreClosedError("embedded Plan store has no table arena (closed)")
        off = tables.alloc(plan_table_nbytes(len(pointers)))
        if off is None:
            raise PlanError(
                f"plan table arena full ({tables.used} of {tables.capacity} B in live "
                f"tables); end plans sooner or raise table_arena_bytes"
            )
        ptr = arena.ptr + off
        encode_plan_table(ptr, pointers)
        word = ctypes.c_uint64
        if self.faults.fire("table_magic"):
            word.from_address(ptr).value = PLAN_MAGIC ^ 0xFF
        if self.faults.fire("table_count"):
            word.from_address(ptr + 8).value = len(pointers) + 1
        if self.faults.fire("table_null") and pointers:
            word.from_address(ptr + 16).value = 0
        return off, ptr

    def _free_table(self, offset: int) -> None:
        if self._tables is not None:
            self._tables.free(offset)

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"EmbeddedPlanClient({self.backing}, {u.used_bytes}/{u.capacity_bytes} B, "
            f"{u.n_values} values, generation {self._generation})"
        )
