"""`FluxonPublicPlanClient` (Plan client ``fluxon_public``): Plan semantics over the public
fluxon-py 0.2.4 client, which has no Plan API.

It takes the connection options of `FluxonEndpoint` (``cluster_name``, ``share_mem_path``,
``instance_key``, ``op_timeout_s``, ``attach_timeout_s``, ``settle_s``), given to the Plan tier as
``store.client_options.*``. Constructing a client attaches to the running service at once: no
service is `FluxonUnavailableError` within a second. (The ``fluxon`` Plan client chooses between
this emulation and the native Plan API by capability: `cacheseek.plan.fluxon_select`.)

How the emulation meets the Plan contract (`cacheseek.plan.base`; the verbs shared with the
embedded store: `cacheseek.plan.inprocess`)::

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
        checked at construction (one value must fit; `cacheseek.plan.fluxon_staging`);
        `max_plan_values` tells the Plan tier how many values one plan may stage, and the tier
        writes a larger chunk in waves.
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
    records                the cluster's chunk records (`PlanSharedRecords`): the Fluxon client's,
                           in the service's etcd; the Plan tier publishes and finds chunks there.
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

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError, PlanError, StoreClosedError
from cacheseek.fluxon.client import FluxonClient
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.kv.records import ChunkRecords
from cacheseek.plan.base import GetPlan, PutCommitResult, PutPlan, SegmentMapping
from cacheseek.plan.fluxon_calls import CommitOutcome, fetch_prefix, release_all
from cacheseek.plan.fluxon_staging import Staging, max_values, resolve_staging_bytes
from cacheseek.plan.inprocess import InProcessPlanClient, check_group_lens
from cacheseek.plan.pipeline import run_in_order
from cacheseek.plan.segment import page_round
from cacheseek.plan.table_arena import TableArena
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import AUTO, Size, parse_size

__all__ = ["FluxonPublicPlanClient"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _PutRecord:
    offset: int  # of the plan's staging region
    block: int  # bytes between consecutive values in it
    table: Optional[int] = None


@attrs.define(eq=False)
class _GetRecord:
    views: list  # ValueView of the transferable prefix, key order
    table: Optional[int] = None


# The connection options of a Plan client: registered as ``cacheseek-plan``, attaching bounded by 60 s.
PLAN_ENDPOINT_DEFAULTS = {"instance_key": "cacheseek-plan", "attach_timeout_s": 60.0}
_FIELD_PREFIX = "store.client_options."


def plan_endpoint(options: dict[str, Any]) -> FluxonEndpoint:
    """The `FluxonEndpoint` of a Plan client's options (``store.client_options.*``; those that
    are not its fields are ignored)."""
    return FluxonEndpoint.of(options, field_prefix=_FIELD_PREFIX, **PLAN_ENDPOINT_DEFAULTS)


@PLAN_CLIENTS.register("fluxon_public", objects=("client",), keywords=lambda: FluxonEndpoint.keywords(**PLAN_ENDPOINT_DEFAULTS))
class FluxonPublicPlanClient(InProcessPlanClient):
    """`PlanClient` emulated over a public fluxon-py client (see the module docstring).

    ``client``: an attached `FluxonClient` to share (the caller keeps owning it: `close` leaves
    it open); else one is attached now from the connection options (``endpoint``: the fields of
    `FluxonEndpoint`, by name; a Plan client registers as ``cacheseek-plan`` and waits up to 60 s
    to attach). ``staging_bytes``: host
    staging for uncommitted puts; None sizes it from the geometry (`staging_for`: ``value_bytes``,
    the largest value, one layer's K or V of a chunk; ``chunk_bytes``, one chunk's KV; the Plan
    tier passes both). A staging that cannot hold one value is a `ConfigError` here. A chunk
    larger than the staging (a 480p LingBot chunk is 3.57 GiB) is written in waves of plans of at
    most `max_plan_values` values each (the Plan tier splits it). ``io_threads``: Fluxon calls in
    flight per get or commit (`cacheseek.plan.pipeline`). ``prefault``: fault the staging in at
    `wait_local_segments_ready`. ``key_index``: keep FluxonClient's etcd key index (only
    `FluxonClient.list_keys` needs it; it costs an etcd call per put and remove).
    """

    _client_name = "fluxon Plan client"

    def __init__(
        self,
        staging_bytes: Optional[Size] = AUTO,
        io_threads: int = 4,
        prefault: bool = True,
        table_arena_bytes: Size = "1MiB",
        key_index: bool = False,
        value_bytes: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        *,
        client: Any = None,
        **endpoint: Any,
    ) -> None:
        for name, value, low in (("value_bytes", value_bytes, 1), ("chunk_bytes", chunk_bytes, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"store.client_options.{name}", f"must be null or an int >= {low}, got {value!r}")
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise ConfigError("store.client_options.io_threads", f"must be an int >= 1, got {io_threads!r}")
        self.staging_bytes = resolve_staging_bytes(staging_bytes, value_bytes, chunk_bytes)
        self.table_arena_bytes = parse_size(table_arena_bytes, "store.client_options.table_arena_bytes",
                                            minimum=4096)
        self.io_threads = io_threads
        self.prefault = bool(prefault)
        where = FluxonEndpoint(**{**PLAN_ENDPOINT_DEFAULTS, **endpoint}, field_prefix=_FIELD_PREFIX)
        self._owns_client = client is None
        if client is None:
            client = FluxonClient.attach(where, key_index=key_index)
        super().__init__()
        self._client = client
        self._idle = threading.Condition(self._lock)
        self._segments: Optional[list[SegmentMapping]] = None
        self._owner_map: Optional[SegmentMapping] = None
        self._staging: Optional[Staging] = None
        self._commits = 0  # commits submitted and not finished
        self._io: Optional[ThreadPoolExecutor] = None
        self._committer: Optional[ThreadPoolExecutor] = None
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
        staging = Staging(self.staging_bytes, prefault=self.prefault)
        try:
            tables = TableArena(page_round(self.table_arena_bytes),
                                full_fix="raise store.client_options.table_arena_bytes")
        except BaseException:
            staging.close()
            raise
        self._staging, self._tables = staging, tables
        self._owner_map = SegmentMapping(seg.start, seg.length, generation, seg.writable)
        self._segments = [self._owner_map, SegmentMapping(staging.ptr, staging.length, 1, True)]
        self._timers = staging.timers()
        log.info("fluxon_public segments: owner's %d MiB %s mapping at %#x (generation %d); staging %d MiB "
                 "at %#x, pre-faulted (%s) in %.3f s", seg.length >> 20, seg.perms, seg.start, generation,
                 staging.length >> 20, staging.ptr, staging.fault_method, staging.fault_seconds)

    # -- capability: PlanClientInfo (no usage: Fluxon 0.2.4 does not report it) ----------------
    def staging_usage(self) -> tuple[int, int]:
        """``(bytes reserved by live or stuck put plans, staging bytes)``."""
        with self._lock:
            if self._staging is None:
                return 0, self.staging_bytes
            return self._staging.used, self._staging.length

    @property
    def fluxon_client(self) -> Any:
        """The underlying `FluxonClient`."""
        return self._client

    # -- capability: PlanSharedRecords ----------------------------------------------------------
    @property
    def records(self) -> ChunkRecords:
        """The cluster's chunk records (`FluxonClient.records`: in the service's etcd)."""
        return self._client.records

    # -- put ------------------------------------------------------------------------------------
    def max_plan_values(self, value_len: int) -> int:
        """How many values of ``value_len`` bytes one put plan can stage (plans hold their
        staging until committed, so the Plan tier splits a chunk into plans of at most this many
        values and writes them in waves); 0 when not even one fits."""
        return max_values(self.staging_bytes, value_len)

    def _before_reserve(self, keys: tuple[str, ...], value_len: int) -> None:
        self._check_open()
        self._client.check_fits(keys[0], value_len)  # refused before any copy or Fluxon call

    def _reserve(self, keys: tuple[str, ...], value_len: int) -> tuple[_PutRecord, list[int]]:
        self._ensure_ready()
        staging = self._staging
        if staging is None:
            raise StoreClosedError("fluxon Plan client has no staging (closed)")
        off, block = staging.reserve(len(keys), value_len)
        return _PutRecord(off, block), [staging.ptr + off + i * block for i in range(len(keys))]

    def _unreserve(self, record: _PutRecord) -> None:
        if self._staging is not None:  # bookkeeping only: safe after the mapping is gone
            self._staging.free(record.offset)

    def _submit_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="fluxon-plan-commit")
        self._commits += 1
        try:
            return self._committer.submit(self._run_commit, plan, plan.native)
        except BaseException:
            self._commits -= 1
            self._unreserve(plan.native)
            raise

    def _run_commit(self, plan: PutPlan, record: _PutRecord) -> PutCommitResult:
        """The commit thread: one put per key from its staging block; codes in key order."""
        outcome = CommitOutcome(plan.keys)
        try:
            base = self._staging_ptr() + record.offset
            outcome.run(self._runner, lambda i: self._client.put_from_ptr(
                plan.keys[i], base + i * record.block, plan.value_len))
        except BaseException as exc:  # noqa: BLE001 - e.g. closed before the first put
            outcome.failed(exc)
        finally:
            with self._lock:
                n = len(plan.keys)
                if not outcome.stuck:
                    self._unreserve(record)
                elif self._staging is not None:
                    self._staging.quarantine(record.block * n)
                    log.warning("fluxon_public: a put of a plan of %d keys timed out; its %d staging bytes stay "
                                "reserved (the call may still read them)", n, record.block * n)
                self._commits -= 1
                self._idle.notify_all()
        return outcome.result()

    # -- get ------------------------------------------------------------------------------------
    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        check_group_lens(keys, lens)
        with self._lock:
            self._ensure_ready()
            owner = self._owner_map
        views = fetch_prefix(keys, lens, self._client.get_view, owner, self._runner)
        with self._lock:
            if self._closed:
                release_all(views)
                raise StoreClosedError("fluxon Plan client closed during get_start")
            plan = GetPlan(keys, owner=self, native=_GetRecord(views), atomic_group_lens=lens)
            self._live_gets.add(plan)
            return plan

    def _transfer_pointers(self, record: _GetRecord) -> list[int]:
        return [v.ptr for v in record.views]  # HandleStateError if a view was released meanwhile

    def _lengths(self, record: _GetRecord) -> tuple[int, ...]:
        return tuple(int(v.nbytes) for v in record.views)

    def _release_held(self, record: _GetRecord) -> None:
        release_all(record.views)
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
                self._release_held(plan.native)
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
        quarantined = self._staging.quarantined if self._staging is not None else 0
        if commits or quarantined:
            log.warning("fluxon_public: %d commits still running and %d staging bytes held by stuck puts at "
                        "close: staging left mapped until process exit", commits, quarantined)
            if self._tables is not None:
                self._tables.close()
            return
        for arena in (self._staging, self._tables):
            if arena is not None:
                arena.close()

    # -- internals ------------------------------------------------------------------------------
    def _runner(self, n: int, call: Any, settle: Any, stop: Any, *, limit: Any = None) -> None:
        """`run_in_order` with ``io_threads`` in flight on this client's I/O pool."""
        run_in_order(n, call, settle, stop, width=self.io_threads, pool=self._pool, limit=limit)

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

    def __repr__(self) -> str:
        used, total = self.staging_usage()
        return (f"FluxonPublicPlanClient(cluster={self._client.cluster_name!r}, staging {used}/{total} B, "
                f"closed={self._closed})")
