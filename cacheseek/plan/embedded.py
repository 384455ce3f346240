"""`EmbeddedPlanClient`: an in-process Plan store over one host memory segment.

The single-machine tier that needs no service, and the Plan test bed. It offers the calls of
`cacheseek.plan.base.PlanClient` with the lifecycles documented there (the verbs it shares with
the Fluxon public client: `cacheseek.plan.inprocess`), over:

- one segment (``backing``, a `HostSegment`): ``"shared"`` an anonymous MAP_SHARED mapping,
  ``"private"`` an anonymous MAP_PRIVATE mapping, or ``"shm"`` a MAP_SHARED file in ``shm_dir``
  (how a Fluxon owner's segment looks). With ``hugepages`` (default) the segment is advised
  MADV_HUGEPAGE: a private mapping then gets 2 MiB pages where THP is ``madvise`` (the cheapest
  to fault and to register, docs/design.md section 4); shared memory gets them only where shmem
  THP is enabled (it is ``never`` on the H200 machine). The bytes actually backed by huge pages
  are read back into the segment timers. The segment is created and pre-faulted by
  ``wait_local_segments_ready`` from ``prefault_threads`` threads (0 = one per CPU up to 16), so
  that registering it with CUDA and the first write pay for no page fault; or, through the
  `PlanSegmentPieces` capability, mapped by ``map_local_segments`` and faulted part by part with
  ``fault_local_range`` (the Plan tier faults a piece, registers it, then the next one);
- a first-fit allocator with ``alignment``-byte blocks that coalesces freed neighbours;
- a key index of published values; each value counts its readers. A remove or an overwrite
  unpublishes a value at once but frees its bytes only when the last reader releases its views;
- plan tables (FXPLANV1) allocated in a separate small arena (``table_arena()``), freed when the
  plan ends;
- ``generation``: bumped each time the segment is (re)created (`recreate_segment`).

A reservation that does not fit raises `StoreFullError` ("store full: need N bytes, X of Y used;
raise store.segment_bytes or free values"); nothing is evicted here. Thread-safe: one lock guards
the index, the allocator and the handles.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError, PlanError, StoreClosedError, StoreFullError
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.base import GetPlan, PlanUsage, PutCommitResult, PutPlan, SegmentMapping, SegmentTimers
from cacheseek.plan.inprocess import InProcessPlanClient, check_group_lens
from cacheseek.plan.segment import BACKINGS, HostSegment
from cacheseek.plan.table_arena import TableArena
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import Size, format_size, parse_size

__all__ = ["EmbeddedPlanClient"]

log = logging.getLogger(__name__)

_STORE_FULL_FIX = "raise store.segment_bytes or free values"


@attrs.define(eq=False)
class _Value:
    key: str
    offset: int
    length: int
    readers: int = 0
    retired: bool = False


_OFFSET = operator.attrgetter("offset")
_LENGTH = operator.attrgetter("length")


@attrs.define(eq=False)
class _PutRecord:
    values: list[_Value]
    table: Optional[int] = None  # offset in the table arena


@attrs.define(eq=False)
class _GetRecord:
    held: list[_Value]
    table: Optional[int] = None


@PLAN_CLIENTS.register("embedded", objects=("prefault",))
class EmbeddedPlanClient(InProcessPlanClient):
    """In-process Plan store (see the module docstring)."""

    _client_name = "embedded Plan store"
    _on_device = False  # values in host memory (a subclass may keep them on the device)

    def __init__(
        self,
        segment_bytes: Size = "1GiB",
        prefault_threads: int = 0,
        backing: str = "shared",
        hugepages: bool = True,
        shm_dir: Optional[str] = None,
        alignment: int = 256,
        table_arena_bytes: Size = "1MiB",
        *,
        prefault: bool = True,
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
        if backing not in BACKINGS:
            raise ConfigError("store.backing", f"unknown backing {backing!r}", f"use one of: {', '.join(BACKINGS)}")
        super().__init__()
        self.segment_bytes = -(-segment_bytes // alignment) * alignment
        self.prefault_threads = prefault_threads
        self.backing = backing
        self.hugepages = bool(hugepages)
        self.shm_dir = shm_dir
        self.alignment = alignment
        self.table_arena_bytes = table_arena_bytes
        self.prefault = prefault
        self._segment: Any = None
        self._alloc: Optional[FirstFitAllocator] = None
        self._index: dict[str, _Value] = {}
        self._generation = 0

    # -- segments -------------------------------------------------------------------------------
    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        with self._lock:
            seg = self._ensure_segment()
            if self.prefault and hasattr(seg, "fault_rest"):
                seg.fault_rest()  # what map_local_segments left unfaulted (nothing otherwise)
                self._timers = self._segment_timers(seg)
            return [SegmentMapping(seg.ptr, seg.length, self._generation, True, self._on_device)]

    # -- capability: PlanSegmentPieces ----------------------------------------------------------
    def map_local_segments(self) -> list[SegmentMapping]:
        """The segments mapped, not pre-faulted yet: fault them with `fault_local_range` (or
        `wait_local_segments_ready`, which faults whatever is left)."""
        with self._lock:
            seg = self._ensure_segment(prefault=False)
            return [SegmentMapping(seg.ptr, seg.length, self._generation, True, self._on_device)]

    def fault_local_range(self, ptr: int, length: int) -> None:
        """Pre-fault ``length`` bytes of the segment at ``ptr`` (with ``prefault_threads``
        threads; nothing when the client does not pre-fault). The client's lock is not held
        while the pages fault."""
        with self._lock:
            self._check_open()
            seg = self._segment
        if seg is None or not self.prefault or not hasattr(seg, "fault"):
            return
        seg.fault(ptr - seg.ptr, length)
        self._timers = self._segment_timers(seg)

    @staticmethod
    def _segment_timers(seg: Any) -> SegmentTimers:
        return SegmentTimers(seg.map_seconds, seg.fault_seconds, seg.fault_method, seg.threads, seg.huge_bytes,
                             seg.length)

    def _ensure_segment(self, prefault: Optional[bool] = None) -> Any:
        self._check_open()
        if self._segment is not None:
            return self._segment
        try:
            seg = self._new_segment(self.prefault if prefault is None else prefault)
        except OSError as exc:  # ENOMEM, ENOSPC in shm_dir: the size does not fit this machine
            raise ConfigError(
                "store.segment_bytes", f"cannot map a {format_size(self.segment_bytes)} {self.backing} "
                f"segment: {exc.strerror or exc}", "use store.segment_bytes=auto or a smaller size") from None
        try:
            tables = TableArena(self.table_arena_bytes, full_fix="raise table_arena_bytes")
        except BaseException:
            seg.close()
            raise
        self._segment, self._tables = seg, tables
        self._alloc = FirstFitAllocator(seg.length, self.alignment)
        self._generation += 1
        self._timers = self._segment_timers(seg)
        log.info("embedded Plan segment: %d MiB %s, generation %d, mapped in %.3f s, pre-faulted (%s, %d threads) "
                 "in %.3f s, %d MiB in 2 MiB pages", seg.length >> 20, self.backing, self._generation, seg.map_seconds,
                 seg.fault_method, seg.threads, seg.fault_seconds, max(seg.huge_bytes, 0) >> 20)
        return seg

    def _new_segment(self, prefault: bool) -> Any:
        """The value segment (``ptr``, ``length``, timers, ``close()``), pre-faulted or not; a
        subclass may back it with other memory (`DevicePlanClient`: the runtime device's)."""
        return HostSegment(self.segment_bytes, self.backing, self.shm_dir, self.prefault_threads, prefault=prefault,
                           hugepages=self.hugepages)

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
        for mapped in (self._segment, self._tables):
            if mapped is not None:
                mapped.close()
        self._segment = self._tables = None
        self._alloc = None

    @property
    def generation(self) -> int:
        return self._generation

    # -- capability: PlanClientInfo (table_arena, segment_timers: InProcessPlanClient) ----------
    def usage(self) -> PlanUsage:
        with self._lock:
            used = self._alloc.used if self._alloc is not None else 0
            return PlanUsage(used, self.segment_bytes, len(self._index))

    def keys(self) -> list[str]:
        """Published keys, sorted (tests and diagnostics)."""
        with self._lock:
            return sorted(self._index)

    # -- put ------------------------------------------------------------------------------------
    def _reserve(self, keys: tuple[str, ...], value_len: int) -> tuple[_PutRecord, list[int]]:
        seg = self._ensure_segment()
        alloc = self._allocator()
        values: list[_Value] = []
        for key in keys:
            off = alloc.alloc(value_len)
            if off is None:
                self._free_values(values)
                raise StoreFullError(
                    f"store full: need {len(keys) * alloc.block(value_len)} bytes "
                    f"({len(keys)} values of {value_len} B), {alloc.used} of "
                    f"{alloc.capacity} used; {_STORE_FULL_FIX}"
                )
            values.append(_Value(key, off, value_len))
        return _PutRecord(values), [seg.ptr + v.offset for v in values]

    def _unreserve(self, record: _PutRecord) -> None:
        self._free_values(record.values)

    def _submit_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        record: _PutRecord = plan.native
        for value in record.values:
            old = self._index.get(value.key)
            self._index[value.key] = value
            if old is not None:
                self._retire(old)
        future: Future[PutCommitResult] = Future()
        future.set_result(PutCommitResult(0, (0,) * len(record.values)))
        return future

    # -- get ------------------------------------------------------------------------------------
    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        check_group_lens(keys, lens)
        with self._lock:
            self._ensure_segment()
            found = list(map(self._index.get, keys))  # C loops: a 480p restore is 240+ keys
            held: list[_Value] = found
            if None in found:  # the transferable prefix ends before the first group with a gap
                pos = 0
                for g in lens:
                    if None in found[pos : pos + g]:
                        break
                    pos += g
                held = found[:pos]
            for v in held:
                v.readers += 1
            plan = GetPlan(keys, owner=self, native=_GetRecord(held), atomic_group_lens=lens)
            self._live_gets.add(plan)
            return plan

    def _transfer_pointers(self, record: _GetRecord) -> list[int]:
        base = self._ensure_segment().ptr
        return [base + off for off in map(_OFFSET, record.held)]

    def _lengths(self, record: _GetRecord) -> tuple[int, ...]:
        return tuple(map(_LENGTH, record.held))

    def _release_held(self, record: _GetRecord) -> None:
        for v in record.held:
            v.readers -= 1
            if v.readers == 0 and v.retired:
                self._allocator().free(v.offset)
        record.held = []

    # -- remove / close -------------------------------------------------------------------------
    def remove(self, key: str) -> None:
        with self._lock:
            self._check_open()
            value = self._index.pop(key, None)
            if value is not None:
                self._retire(value)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._live_puts or self._live_gets:
                log.warning("closing the embedded Plan store with %d put plans and %d get plans live",
                            len(self._live_puts), len(self._live_gets))
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

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"EmbeddedPlanClient({self.backing}, {u.used_bytes}/{u.capacity_bytes} B, "
            f"{u.n_values} values, generation {self._generation})"
        )
