"""Plan semantics over the public fluxon-py 0.2.4 client (which has no Plan API).

Plan clients registered here (`cacheseek.registry.PLAN_CLIENTS`):

- ``fluxon_public``: `FluxonPublicPlanClient`, the emulation described below, always;
- ``fluxon``: chosen by capability (`open_fluxon_plan_client`): the native Plan API through
  `FluxonNativePlanClient` when the installed fluxon-py offers every Plan call, else the
  emulation. It logs which, and why. ``api: native|public`` forces one.

Both take the connection options of `FluxonClient` (``cluster_name``, ``share_mem_path``,
``instance_key``, ``op_timeout_s``, ``attach_timeout_s``, ``settle_s``), given to the Plan tier as
``store.client_options.*``. Constructing a client attaches to the running service at once: no
service is `FluxonUnavailableError` within a second.

How the emulation meets the Plan contract (`cacheseek.plan.base`)::

    wait_local_segments_ready()
        -> [the owner's segment as mapped read-only in this process (writable=False): every
            zero-copy value view points into it; register it once, read-only,
            a writable host staging segment this client owns (mapped and pre-faulted here)]
    local_fast_put_start(keys, value_len)
        reserves len(keys) staging blocks of value_len bytes (256-byte aligned) and returns an
        FXPLANV1 table of their addresses: the caller copies (D2H) into staging, not into Fluxon.
        A value whose power-of-two slot cannot fit the owner's segment raises
        `FluxonValueTooLargeError` here, before any copy; staging exhausted raises
        `StoreFullError` (raise ``staging_bytes``). The staging is sized from the geometry and
        checked at construction (one value must fit); `max_plan_values` tells the Plan tier how
        many values one plan may stage, and the tier writes a larger chunk in waves.
    local_fast_put_commit(plan) -> Future[PutCommitResult]
        on the commit thread: one Fluxon put per key straight from its staging block
        (``put_from_ptr``): ONE copy, by Fluxon (fluxon-py's native code, in this process, writes
        the bytes into the owner's segment through its own read-write mapping of it), with
        ``io_threads`` puts in flight; per-key codes (`PutKeyCode`); then the staging is freed.
        Keys are published one by one as their puts land (readers that know the key may see
        some of a plan's values before the future resolves: CacheSeek publishes through the
        trie's ready bit only after every code is checked). After a put times out no further
        put of the plan is issued (`PutKeyCode.NOT_ATTEMPTED`), and its staging is never freed
        or unmapped (the stuck call may still read it).
    put_abort(plan)        frees the staging blocks and the table.
    get_start(keys, atomic_group_lens)
        one Fluxon get per key (``io_threads`` in flight, in key order), each returning a
        holder and a zero-copy DLPack view into the owner's segment; the transferable prefix is
        the leading whole groups whose every key exists; views of the rest are released at
        once. Values stay in place while held (a remove or an overwrite defers freeing them).
    get_transfer(plan)     -> (table of the held views' addresses, n); nothing is copied.
    cancel_get_transfer / release_views
        release every holder. The caller's H2D (or memmove) reads straight from the segment:
        the one copy of a read.
    remove(key)            Fluxon remove; a missing key is not an error.
    close()                waits (bounded) for commits in flight, releases every view still
                           held (a view read after fluxon-py's close crashes the process), closes
                           the Fluxon client if this Plan client attached it, unmaps staging.

Copies per value, against the embedded client (which has none beyond the caller's own):
put = D2H into staging + Fluxon's copy staging -> segment; get = the caller's H2D straight from
the segment (zero-copy view). Each value costs a Fluxon call (~10-100 ms on a 2-core machine):
experiments/fluxon_plan has the figures.

Differences from the embedded client worth knowing (fluxon-py 0.2.4 behaviour):
- an overwrite of an existing key becomes visible to readers only after up to ~1 s (a remove is
  immediate). CacheSeek's keys are content-addressed, so a stale read returns the same bytes;
- Fluxon evicts values by itself when its segment fills (a put then fails with StorageFull):
  a value the trie calls ready can disappear; a restore then misses and invalidates the node;
- it reports no usage, so CacheSeek's own eviction does not act on this tier.

Importing this module needs neither fluxon-py, numpy nor torch.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import enum
import logging
import mmap
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import attrs

from cacheseek.errors import (
    ConfigError,
    PlanError,
    PlanUnavailableError,
    StoreClosedError,
    StoreFullError,
    StoreTimeoutError,
)
from cacheseek.fluxon.client import FluxonClient, FluxonImportError, FluxonValueTooLargeError, _load_fluxon
from cacheseek.fluxon.service import DEFAULT_CLUSTER_NAME, DEFAULT_SHARE_MEM_PATH
from cacheseek.plan.base import (
    InProcessPlanClient,
    REQUIRED_PLAN_CALLS,
    GetPlan,
    GetPlanState,
    PutCommitResult,
    PutPlan,
    PutPlanState,
    SegmentMapping,
    SegmentTimers,
)
from cacheseek.plan.fluxon_native import FluxonNativePlanClient, missing_plan_calls
from cacheseek.plan.allocator import FirstFitAllocator
from cacheseek.plan.table import encode_plan_table, plan_table_nbytes
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import AUTO, Size, parse_size

__all__ = [
    "FluxonPublicPlanClient",
    "FluxonPublicPlanSchema",
    "FluxonPlanSchema",
    "PutKeyCode",
    "native_plan_api_problem",
    "open_fluxon_plan_client",
]

log = logging.getLogger(__name__)

_ALIGN = 256  # staging blocks (and so every put source) start on 256-byte boundaries
_TABLE_ALIGN = 64
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23
_STAGING_FIX = "raise store.client_options.staging_bytes"


class PutKeyCode(enum.IntEnum):
    """Per-key codes of a commit (`PutCommitResult.key_codes`); 0 = published."""

    OK = 0
    FAILED = 1  # Fluxon refused the put (the message carries its error text)
    TIMEOUT = 2  # the put did not complete within op_timeout_s (it may still land later)
    NOT_ATTEMPTED = 3  # not issued: an earlier put of the plan timed out or the client closed
    CLOSED = 4  # the Fluxon client was closed meanwhile
    STORE_FULL = 6000  # Fluxon's StorageFullError: no space (its own eviction runs behind)
    TOO_LARGE = 6001  # the value cannot fit the owner's segment even when empty


@dataclasses.dataclass
class FluxonPublicPlanSchema:
    _target_: str = "cacheseek.plan.fluxon_public.FluxonPublicPlanClient"
    cluster_name: str = DEFAULT_CLUSTER_NAME
    share_mem_path: str = DEFAULT_SHARE_MEM_PATH
    instance_key: str = "cacheseek-plan"
    op_timeout_s: float = 30.0
    attach_timeout_s: float = 60.0
    settle_s: float = 2.0
    # auto (or null): sized from the geometry (value_bytes, chunk_bytes; the Plan tier passes them;
    # the CLI fits auto to the workload); or a size (512MiB)
    staging_bytes: Any = "auto"
    value_bytes: Optional[int] = None
    chunk_bytes: Optional[int] = None
    io_threads: int = 4
    prefault: bool = True
    table_arena_bytes: Any = "1MiB"
    key_index: bool = False


@dataclasses.dataclass
class FluxonPlanSchema(FluxonPublicPlanSchema):
    _target_: str = "cacheseek.plan.fluxon_public.open_fluxon_plan_client"
    api: str = "auto"


# -- host memory --------------------------------------------------------------------------------


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib


class _Arena:
    """An anonymous private mapping, carved by a `FirstFitAllocator` (offsets)."""

    def __init__(self, length: int, *, prefault: bool, align: int) -> None:
        t0 = time.perf_counter()
        self.length = -(-length // _PAGE) * _PAGE
        self.align = align
        self._mm: Optional[mmap.mmap] = mmap.mmap(-1, self.length, flags=mmap.MAP_PRIVATE)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.ptr = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open
        self.map_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.fault_method = "none"
        if prefault:
            libc = _libc()
            if libc is not None and libc.madvise(self.ptr, self.length, _MADV_POPULATE_WRITE) == 0:
                self.fault_method = "madvise"
            else:
                ctypes.memset(self.ptr, 0, self.length)
                self.fault_method = "touch"
        self.fault_seconds = time.perf_counter() - t1
        self._alloc = FirstFitAllocator(self.length, align)

    @property
    def used(self) -> int:
        return self._alloc.used

    def block(self, n: int) -> int:
        return self._alloc.block(n)

    def alloc(self, n: int) -> Optional[int]:
        return self._alloc.alloc(n)

    def free(self, off: int) -> None:
        self._alloc.free(off)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


# -- handle records -----------------------------------------------------------------------------


@attrs.define(eq=False)
class _PutRecord:
    offset: int  # of the plan's staging region
    block: int  # bytes between consecutive values in it
    table: Optional[int]


@attrs.define(eq=False)
class _GetRecord:
    views: list  # ValueView of the transferable prefix, key order
    table: Optional[int] = None


# -- the client ---------------------------------------------------------------------------------


@PLAN_CLIENTS.register("fluxon_public", FluxonPublicPlanSchema)
class FluxonPublicPlanClient(InProcessPlanClient):
    """`PlanClient` emulated over a public fluxon-py client (see the module docstring).

    ``client``: an attached `FluxonClient` to share (the caller keeps owning it: `close` leaves
    it open); else one is attached now from the connection options. ``staging_bytes``: host
    staging for uncommitted puts; None sizes it from the geometry (`staging_for`: ``value_bytes``,
    the largest value, one layer's K or V of a chunk; ``chunk_bytes``, one chunk's KV; the Plan
    tier passes both). A staging that cannot hold one value is a `ConfigError` here. A chunk larger
    than the staging (a 480p LingBot chunk is 3.57 GiB) is written in waves of plans of at most
    `max_plan_values` values each (the Plan tier splits it). ``io_threads``: Fluxon calls in flight per get or commit (calls
    are round-trip bound: 4 in flight were 1.4-3x faster than 1 on a 2-core machine,
    experiments/fluxon_plan).
    ``prefault``: fault the staging in at `wait_local_segments_ready` (libc
    ``madvise(MADV_POPULATE_WRITE)``, else a memset). ``key_index``: keep FluxonClient's etcd
    key index (only `FluxonClient.list_keys` needs it; it costs an etcd call per put and remove).
    """

    _client_name = "fluxon Plan client"

    def __init__(
        self,
        cluster_name: str = DEFAULT_CLUSTER_NAME,
        share_mem_path: str = DEFAULT_SHARE_MEM_PATH,
        instance_key: str = "cacheseek-plan",
        op_timeout_s: float = 30.0,
        attach_timeout_s: float = 60.0,
        settle_s: float = 2.0,
        staging_bytes: Optional[Size] = None,
        io_threads: int = 4,
        prefault: bool = True,
        table_arena_bytes: Size = 1 << 20,
        key_index: bool = False,
        value_bytes: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        *,
        client: Any = None,
    ) -> None:
        for name, value, low in (("value_bytes", value_bytes, 1), ("chunk_bytes", chunk_bytes, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"store.client_options.{name}", f"must be null or an int >= {low}, got {value!r}")
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise ConfigError("store.client_options.io_threads", f"must be an int >= 1, got {io_threads!r}")
        staging_bytes = parse_size(staging_bytes, "store.client_options.staging_bytes", minimum=_ALIGN,
                                   allow_auto=True, allow_none=True)
        if staging_bytes is None or staging_bytes == AUTO:
            staging_bytes = staging_for(value_bytes, chunk_bytes)
        table_arena_bytes = parse_size(table_arena_bytes, "store.client_options.table_arena_bytes", minimum=4096)
        if value_bytes is not None and _block(value_bytes) > staging_bytes:
            raise ConfigError(
                "store.client_options.staging_bytes",
                f"{staging_bytes} bytes cannot stage one value of {value_bytes} bytes (one layer's K or V of "
                "a chunk): no write could ever start",
                f"set it to at least {_block(value_bytes)}, or auto to size it from the geometry")
        self.staging_bytes = staging_bytes
        self.io_threads = io_threads
        self.prefault = bool(prefault)
        self.table_arena_bytes = table_arena_bytes
        if client is None:
            client = FluxonClient(cluster_name, share_mem_path, instance_key, op_timeout_s=op_timeout_s,
                                  attach_timeout_s=attach_timeout_s, settle_s=settle_s, key_index=key_index)
            self._owns_client = True
        else:
            self._owns_client = False
        self._client = client
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._segments: Optional[list[SegmentMapping]] = None
        self._owner_map: Optional[SegmentMapping] = None
        self._staging: Optional[_Arena] = None
        self._tables: Optional[_Arena] = None
        self._timers = SegmentTimers()
        self._live_puts: set[PutPlan] = set()
        self._live_gets: set[GetPlan] = set()
        self._commits = 0  # commits submitted and not finished
        self._quarantined = 0  # staging bytes left to stuck puts
        self._io: Optional[ThreadPoolExecutor] = None
        self._committer: Optional[ThreadPoolExecutor] = None
        self._closed = False
        log.info("Plan client fluxon_public on cluster %r (%s): reads zero-copy from the owner's "
                 "segment, writes staged here and copied once into Fluxon by fluxon-py",
                 client.cluster_name, client.share_mem_path)

    # -- segments -------------------------------------------------------------------------------
    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        with self._lock:
            self._ensure_ready()
            return list(self._segments or ())

    def _ensure_ready(self) -> None:
        self._check_open()
        if self._segments is not None:
            return
        seg = self._client.segment_mapping()
        if seg is None:
            raise PlanError(
                f"the Fluxon client of cluster {self._client.cluster_name!r} has no mapping of the owner's "
                f"segment {self._client.segment_dir}/mmap.file in this process")
        generation = self._client.segment_generation()
        staging = _Arena(self.staging_bytes, prefault=self.prefault, align=_ALIGN)
        try:
            tables = _Arena(self.table_arena_bytes, prefault=True, align=_TABLE_ALIGN)
        except BaseException:
            staging.close()
            raise
        self._staging, self._tables = staging, tables
        self._owner_map = SegmentMapping(seg.start, seg.length, generation, seg.writable)
        self._segments = [self._owner_map, SegmentMapping(staging.ptr, staging.length, 1, True)]
        self._timers = SegmentTimers(staging.map_seconds, staging.fault_seconds, staging.fault_method,
                                     1 if self.prefault else 0, -1, staging.length)
        log.info("fluxon_public segments: owner's %d MiB %s mapping at %#x (generation %d); staging %d MiB "
                 "at %#x, pre-faulted (%s) in %.3f s", seg.length >> 20, seg.perms, seg.start, generation,
                 staging.length >> 20, staging.ptr, staging.fault_method, staging.fault_seconds)

    # -- capability: PlanClientInfo (no usage: Fluxon 0.2.4 does not report it) ----------------
    def table_arena(self) -> Optional[tuple[int, int]]:
        with self._lock:
            return None if self._tables is None else (self._tables.ptr, self._tables.length)

    def segment_timers(self) -> SegmentTimers:
        return self._timers

    def staging_usage(self) -> tuple[int, int]:
        """``(bytes reserved by live or stuck put plans, staging bytes)``."""
        with self._lock:
            if self._staging is None:
                return 0, self.staging_bytes
            return self._staging.used, self._staging.length

    def live_handles(self) -> tuple[int, int]:
        """``(put plans STARTED, get plans not yet ended)``."""
        with self._lock:
            return len(self._live_puts), len(self._live_gets)

    @property
    def fluxon_client(self) -> Any:
        """The underlying `FluxonClient`."""
        return self._client

    # -- put ------------------------------------------------------------------------------------
    def max_plan_values(self, value_len: int) -> int:
        """How many values of ``value_len`` bytes one put plan can stage (plans hold their
        staging until committed, so the Plan tier splits a chunk into plans of at most this many
        values and writes them in waves); 0 when not even one fits."""
        return self.staging_bytes // _block(value_len)

    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        keys = tuple(keys)
        if not keys or len(set(keys)) != len(keys) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("local_fast_put_start needs distinct, non-empty string keys")
        if not isinstance(value_len, int) or isinstance(value_len, bool) or value_len <= 0:
            raise ValueError(f"value_len must be a positive int, got {value_len!r}")
        self._check_open()
        self._client.check_fits(keys[0], value_len)  # refused before any copy or Fluxon call
        with self._lock:
            self._ensure_ready()
            staging, block = self._staging, _block(value_len)
            if staging is None:
                raise StoreClosedError("fluxon Plan client has no staging (closed)")
            off = staging.alloc(block * len(keys))
            if off is None:
                raise StoreFullError(
                    f"fluxon Plan staging full: need {block * len(keys)} bytes ({len(keys)} values of "
                    f"{value_len} B), {staging.used} of {staging.length} reserved by uncommitted plans"
                    f"{f' ({self._quarantined} left to stuck puts)' if self._quarantined else ''}; {_STAGING_FIX}")
            try:
                table, ptr = self._write_table([staging.ptr + off + i * block for i in range(len(keys))])
            except BaseException:
                staging.free(off)
                raise
            plan = PutPlan(keys, owner=self, native=_PutRecord(off, block, table), value_len=value_len)
            self._live_puts.add(plan)
            return plan, ptr

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        with self._lock:
            self._check_handle(plan)
            plan.advance((PutPlanState.STARTED,), PutPlanState.COMMIT_SUBMITTED, "local_fast_put_commit")
            self._live_puts.discard(plan)
            record: _PutRecord = plan.native
            self._free_table(record)
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="fluxon-plan-commit")
            self._commits += 1
            try:
                return self._committer.submit(self._commit, plan, record)
            except BaseException:
                self._commits -= 1
                self._staging_free(record.offset)
                raise

    def _commit(self, plan: PutPlan, record: _PutRecord) -> PutCommitResult:
        """The commit thread: one put per key from its staging block; codes in key order."""
        n = len(plan.keys)
        codes = [PutKeyCode.NOT_ATTEMPTED] * n
        notes: list[str] = []
        stuck = False
        try:
            base = self._staging_ptr() + record.offset
            stop = False

            def put(i: int) -> None:
                self._client.put_from_ptr(plan.keys[i], base + i * record.block, plan.value_len)

            def settle(i: int, fut: Future) -> None:
                nonlocal stop, stuck
                try:
                    fut.result()
                    codes[i] = PutKeyCode.OK
                    return
                except BaseException as exc:  # noqa: BLE001 - reported as the key's code
                    code = _put_code(exc)
                    if code in (PutKeyCode.TIMEOUT, PutKeyCode.CLOSED):
                        stop = True
                    if code == PutKeyCode.TIMEOUT:
                        stuck = True
                    codes[i] = code
                    if len(notes) < 3:
                        notes.append(f"{plan.keys[i]}: {exc}")

            self._pipeline(n, put, settle, lambda: stop)
        except BaseException as exc:  # noqa: BLE001 - e.g. closed before the first put
            stuck = stuck or isinstance(exc, StoreTimeoutError)
            notes.append(f"commit failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if stuck:
                    self._quarantined += record.block * n
                    log.warning("fluxon_public: a put of a plan of %d keys timed out; its %d staging bytes stay "
                                "reserved (the call may still read them)", n, record.block * n)
                else:
                    self._staging_free(record.offset)
                self._commits -= 1
                self._idle.notify_all()
        bad = sum(c != PutKeyCode.OK for c in codes)
        message = "" if not bad else f"{bad} of {n} puts failed: " + "; ".join(notes)
        return PutCommitResult(0, tuple(int(c) for c in codes), message)

    def put_abort(self, plan: PutPlan) -> None:
        with self._lock:
            self._check_handle(plan)
            plan.advance((PutPlanState.STARTED,), PutPlanState.ABORTED, "put_abort")
            self._live_puts.discard(plan)
            record: _PutRecord = plan.native
            self._free_table(record)
            self._staging_free(record.offset)

    # -- get ------------------------------------------------------------------------------------
    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        bad = any(not isinstance(g, int) or isinstance(g, bool) or g <= 0 for g in lens)
        if not keys or bad or sum(lens) != len(keys):
            raise ValueError(f"atomic_group_lens {lens} must be positive and sum to the {len(keys)} keys")
        with self._lock:
            self._ensure_ready()
            owner = self._owner_map
        views = self._fetch(keys, lens, owner)
        with self._lock:
            if self._closed:
                _release_all(views)
                raise StoreClosedError("fluxon Plan client closed during get_start")
            plan = GetPlan(keys, owner=self, native=_GetRecord(views), atomic_group_lens=lens)
            self._live_gets.add(plan)
            return plan

    def _fetch(self, keys: tuple[str, ...], lens: tuple[int, ...], owner: Any) -> list:
        """Views of the transferable prefix (whole groups whose every key exists), key order."""
        starts, pos = [], 0  # starts[i]: index of the first key of i's group
        for g in lens:
            starts += [pos] * g
            pos += g
        views: list[Any] = [None] * len(keys)
        limit = len(keys)  # first index not in the prefix
        error: Optional[BaseException] = None

        def settle(i: int, fut: Future) -> None:
            nonlocal limit, error
            try:
                view = fut.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, after releasing
                error = error or exc
                return
            if view is None:
                limit = min(limit, starts[i])
                return
            views[i] = view
            if error is None and not (view.zero_copy and owner.ptr <= view.ptr and
                                      view.ptr + view.nbytes <= owner.ptr + owner.length):
                error = PlanError(
                    f"fluxon value {keys[i]!r} ({view.nbytes} B at {view.ptr:#x}) is not a zero-copy view into "
                    f"the owner's segment mapping [{owner.ptr:#x}, +{owner.length}): not written by a "
                    f"CacheSeek Plan client")

        try:
            self._pipeline(len(keys), lambda i: self._client.get_view(keys[i]), settle,
                           lambda: error is not None, limit_fn=lambda: limit)
        except BaseException as exc:
            error = error or exc
        if error is not None:
            _release_all(views)
            raise error
        _release_all(views[limit:])
        return views[:limit]

    def _pipeline(self, n: int, call: Any, settle: Any, stop: Any, *, limit_fn: Any = None) -> None:
        """Run ``call(i)`` for i in 0..n-1 on the I/O pool with at most ``io_threads`` in flight,
        settling results in index order; stops issuing once ``stop()`` or i >= ``limit_fn()``.
        Every issued call is settled before this returns (each is bounded by op_timeout_s)."""
        if self.io_threads == 1:
            for i in range(n):
                if stop() or (limit_fn is not None and i >= limit_fn()):
                    break
                fut: Future = Future()
                try:
                    fut.set_result(call(i))
                except BaseException as exc:  # noqa: BLE001 - handed to settle
                    fut.set_exception(exc)
                settle(i, fut)
            return
        pool = self._pool()
        in_flight: collections.deque[tuple[int, Future]] = collections.deque()
        i = 0
        while True:
            while (i < n and len(in_flight) < self.io_threads and not stop()
                   and (limit_fn is None or i < limit_fn())):
                in_flight.append((i, pool.submit(call, i)))
                i += 1
            if not in_flight:
                return
            j, fut = in_flight.popleft()
            settle(j, fut)

    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.STARTED,), "get_transfer")
            record: _GetRecord = plan.native
            ptrs = [v.ptr for v in record.views]  # HandleStateError if a view was released meanwhile
            record.table, ptr = self._write_table(ptrs)
            plan.advance((GetPlanState.STARTED,), GetPlanState.TRANSFERRING, "get_transfer")
            return ptr, len(ptrs)

    def value_lengths(self, plan: GetPlan) -> tuple[int, ...]:
        """See `PlanValueLengths`."""
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.TRANSFERRING,), "value_lengths")
            return tuple(int(v.nbytes) for v in plan.native.views)

    def _end_read(self, plan: GetPlan) -> None:
        self._live_gets.discard(plan)
        record: _GetRecord = plan.native
        if record.table is not None and self._tables is not None:
            self._tables.free(record.table)
        record.table = None
        _release_all(record.views)
        record.views = []

    # -- remove / close -------------------------------------------------------------------------
    def remove(self, key: str) -> None:
        self._check_open()
        self._client.remove(key)

    def close(self) -> None:
        """Wait (bounded by op_timeout_s) for commits in flight, release every held view, close
        the Fluxon client if this one attached it, unmap staging. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + self._client.op_timeout_s
            while self._commits and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.01, deadline - time.monotonic()))
            commits, gets, puts = self._commits, list(self._live_gets), list(self._live_puts)
            for plan in gets:
                _release_all(plan.native.views)
                plan.native.views = []
            self._live_gets.clear()
            self._live_puts.clear()
        if gets or puts:
            log.warning("fluxon_public closed with %d put plans and %d get plans live (their views released)",
                        len(puts), len(gets))
        for pool in (self._committer, self._io):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_client:
            self._client.close()
        if commits or self._quarantined:
            log.warning("fluxon_public: %d commits still running and %d staging bytes held by stuck puts at "
                        "close: staging left mapped until process exit", commits, self._quarantined)
            if self._tables is not None:
                self._tables.close()
            return
        for arena in (self._staging, self._tables):
            if arena is not None:
                arena.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals ------------------------------------------------------------------------------
    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(self.io_threads, thread_name_prefix="fluxon-plan-io")
            return self._io

    def _staging_ptr(self) -> int:
        with self._lock:
            if self._staging is None:
                raise StoreClosedError("fluxon Plan client has no staging (closed)")
            return self._staging.ptr

    def _staging_free(self, offset: int) -> None:
        if self._staging is not None:  # bookkeeping only: safe after the mapping is gone
            self._staging.free(offset)

    def _write_table(self, pointers: list[int]) -> tuple[int, int]:
        tables = self._tables
        if tables is None:
            raise StoreClosedError("fluxon Plan client has no table arena (closed)")
        off = tables.alloc(plan_table_nbytes(len(pointers)))
        if off is None:
            raise PlanError(f"plan table arena full ({tables.used} of {tables.length} B in live tables); end "
                            f"plans sooner or raise store.client_options.table_arena_bytes")
        encode_plan_table(tables.ptr + off, pointers)
        return off, tables.ptr + off

    def _free_table(self, record: _PutRecord) -> None:
        if record.table is not None and self._tables is not None:
            self._tables.free(record.table)
        record.table = None

    def __repr__(self) -> str:
        used, total = self.staging_usage()
        return (f"FluxonPublicPlanClient(cluster={self._client.cluster_name!r}, staging {used}/{total} B, "
                f"closed={self._closed})")


def _block(value_len: int) -> int:
    """The staging bytes one value of ``value_len`` bytes takes."""
    return -(-value_len // _ALIGN) * _ALIGN


_STAGING_MIN = 64 << 20
_STAGING_MAX = 4 << 30
_STAGING_DEFAULT = 256 << 20


def staging_for(value_bytes: Optional[int], chunk_bytes: Optional[int]) -> int:
    """The staging size from the geometry: one chunk's KV (so a chunk is one wave of plans) and
    at least 4 values, within 64 MiB..4 GiB (a larger chunk is written in several waves); 256 MiB
    when the geometry is unknown."""
    if value_bytes is None and chunk_bytes is None:
        return _STAGING_DEFAULT
    want = max(chunk_bytes or 0, 4 * _block(value_bytes or 1))
    size = min(max(want, _STAGING_MIN), _STAGING_MAX)
    if value_bytes is not None:
        size = max(size, _block(value_bytes))
    return -(-size // _ALIGN) * _ALIGN


def _release_all(views: Sequence[Any]) -> None:
    for v in views:
        if v is not None and not v.released:
            v.release()


def _put_code(exc: BaseException) -> PutKeyCode:
    if isinstance(exc, FluxonValueTooLargeError):
        return PutKeyCode.TOO_LARGE
    if isinstance(exc, StoreFullError):
        return PutKeyCode.STORE_FULL
    if isinstance(exc, StoreTimeoutError):
        return PutKeyCode.TIMEOUT
    if isinstance(exc, StoreClosedError):
        return PutKeyCode.CLOSED
    return PutKeyCode.FAILED


# -- choosing by capability ---------------------------------------------------------------------


def native_plan_api_problem() -> Optional[str]:
    """None when the installed fluxon-py's client offers every Plan call; otherwise why not
    (fluxon-py missing, or the calls its client classes lack)."""
    try:
        fluxon_py = _load_fluxon()
    except FluxonImportError as exc:
        return str(exc)
    classes = [c for c in vars(fluxon_py).values() if isinstance(c, type)]
    try:
        from fluxon_py.kvclient.fluxon import FluxonKVCacheStore

        classes.append(FluxonKVCacheStore)
    except ImportError:
        pass
    missing = min((missing_plan_calls(c) for c in classes), key=len, default=list(REQUIRED_PLAN_CALLS))
    if not missing:
        return None
    return (f"fluxon-py {getattr(fluxon_py, '__version__', '?')} has no Plan API "
            f"(missing {', '.join(missing)})")


_APIS = ("auto", "native", "public")
_NATIVE_OPTIONS = ("op_timeout_s", "attach_timeout_s", "table_arena_bytes", "value_bytes", "chunk_bytes")


@PLAN_CLIENTS.register("fluxon", FluxonPlanSchema)
def open_fluxon_plan_client(api: str = "auto", **options: Any) -> Any:
    """The ``fluxon`` Plan client: the native Plan API when the installed fluxon-py has it
    (`FluxonNativePlanClient`), else `FluxonPublicPlanClient`; ``api`` = ``native`` or ``public``
    forces one. ``options`` are `FluxonPublicPlanSchema`'s; the native client uses the
    connection options, the time bounds, ``table_arena_bytes`` and the geometry."""
    if api not in _APIS:
        raise ConfigError("store.client_options.api", f"unknown api {api!r}", f"use one of: {', '.join(_APIS)}")
    problem = native_plan_api_problem() if api != "public" else "forced by api=public"
    if api == "native" and problem:
        raise PlanUnavailableError(f"Plan client 'fluxon' with api=native: {problem}")
    if problem is None:
        log.info("Plan client 'fluxon': the installed fluxon-py offers the Plan API: using it natively "
                 "(fluxon_native)")
        spec = {"cluster_name": options.get("cluster_name", DEFAULT_CLUSTER_NAME),
                "share_mem_path": options.get("share_mem_path", DEFAULT_SHARE_MEM_PATH)}
        return FluxonNativePlanClient(
            config={"instance_key": options.get("instance_key", "cacheseek-plan"), "fluxonkv_spec": spec},
            **{k: options[k] for k in _NATIVE_OPTIONS if k in options})
    log.info("Plan client 'fluxon': %s; emulating it over the public client (fluxon_public: zero-copy "
             "reads, staged writes copied once by Fluxon)", problem)
    return FluxonPublicPlanClient(**options)
