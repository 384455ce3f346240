"""`PlanTierStore` (store ``fluxon_plan``): KV and latents moved straight between the runtime's
tensors and a Plan store's registered host segments, in batches, with no CPU staging.

It is a `TierStore` and a `PathReadStore` (``accepts_device_views``): the manager hands it
detached views of the ring tail on write and a `RestoreTarget` on read (docs/design.md section 2).

Warm-up (construction, never a request's first write): the Plan client's segments are made ready
(an embedded client maps and pre-faults its segment here: 2 MiB pages where allowed, else libc
``madvise(MADV_POPULATE_WRITE)`` from several threads), each mapping is registered with the
transfer runtime once, the runtime's write and read streams are made and, with
``staging_slot_bytes``, the staging slots allocated. Every stage is timed into `stats` (map,
fault, register per mapping, total). Without a ``transfer`` object or a ``device`` the runtime is
chosen from the device of the first tensors seen and that first write pays the registration.

Streams: writes go on the store's write stream, reads on its read stream (both the runtime's own,
non-blocking on CUDA, so ``cudaMemcpyBatchAsync`` takes them and compute on the legacy stream is
not serialized with them). The caller's stream (``stream``, default the current one) is the
*producer*: copies are ordered after an event recorded on it.

Write of one chunk (`put_async`)::

    keys {locator}:L{i}:k / :v, grouped by byte size (one value size per Plan)
    start every Plan -> decode every table
    overlap off: one D2H batch from the ring views on the write stream after the producer
        event; synchronize; commit every Plan; check every status and key code; handle.ready;
        on_ready(handle); then return
    overlap on: take a staging slot (blocks while ``staging_slots`` writes or
        ``max_inflight_bytes`` are in flight: backpressure); snapshot the views into it with one
        device-side batch on the producer stream (the ring may be overwritten as soon as this
        returns); return the PENDING handle. The completion thread copies the slot to the Plan
        values on the write stream after the snapshot's event, in pieces of ``write_piece_bytes``
        with ``write_pieces_in_flight`` at a time (so the runtime's own device-to-host copies,
        which share the copy engine, never queue behind a whole chunk), waits for the last,
        frees the slot, commits every Plan, checks every code, then sets handle.ready and calls
        on_ready. With ``write_piece_bytes=0`` put_async submits the whole D2H as one batch.
    failure before commit: anything submitted is waited for, then every live uncommitted Plan is
    aborted; failure at or after commit: wait for the submitted commits, then remove every key
    of them, so nothing of the blob stays in the store. handle.error is set and counted; a failure
    found inside put_async raises a `StoreError`, one found by the completion thread is reported
    on the handle (and in stats) only. `flush` waits for every pending write.

Read of depth K (`read_path`): latents first (one GET of every ``{hex}:lat`` of the path, all or
nothing, one H2D batch into ``target.latents``), then the window's KV as one chunk-major request
with ``atomic_group_lens = [2 * n_layers] * len(window)`` (a partial transferable prefix is a miss:
nothing is copied into the ring), then every copy run of every layer, K and V, in one H2D batch.
Both batches go on the read stream after an event on the producer stream (so the ring's zeroing
and earlier work land first); the producer stream then waits for the read's completion event
(the runtime cannot read the ring before the copies land) and the host synchronizes once before
releasing the views. Every get handle is ended on every path (transferred -> release_views, else
cancel_get_transfer), after any copy out of its values has landed.

No checksum on this tier, by decision: its values live in host DRAM (ECC on server machines) that
only the GPU's copy engines write and read, in batches at PCIe speed (about 50 GiB/s a
direction). A checksum would need the CPU to read every byte of a 3.57 GiB chunk on the hot
path (xxh3 at about 10-30 GB/s on one core: 0.15-0.4 s, against the 70 ms copy), or a checksum
kernel on the device in the middle of the batch, to guard a medium with no silent-corruption path
of its own (no disk, no socket). Values that vanish (evicted, a restarted owner) are caught as
misses (``contains``) and invalidated by the manager; the tiers whose media can corrupt (LocalDisk
files, the generic Fluxon tier) carry checksums (`cacheseek.stores.checksum`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Dict, Optional

import attrs

from cacheseek.errors import (
    ConfigError,
    CorruptValueError,
    LayoutMismatchError,
    PlanError,
    PlanTableError,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
    WriteNotCompleteError,
)
from cacheseek.plan.base import GetPlan, PlanClient, PutCommitResult, PutPlan
from cacheseek.plan.table import decode_plan_table
from cacheseek.registry import PLAN_CLIENTS, STORES, TRANSFERS
from cacheseek.kv.locators import layer_keys
from cacheseek.kv.handles import BlobHandle, ChunkNode, Tier
from cacheseek.sizes import Size, available_memory, free_bytes, parse_size
from cacheseek.sizing import SizeField
from cacheseek.stores.base import LayerPayload, RestoreTarget
from cacheseek.transfer.base import (
    AsyncTransfer,
    CopyBatch,
    Direction,
    HostMapping,
    LazyModule,
    MemoryRange,
    PendingBatch,
    TransferRuntime,
    add_note,
)

__all__ = ["PlanTierStore", "PlanTierSchema", "PlanTierStats"]

np = LazyModule("numpy")

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes between snapshot entries in a staging slot
_SLOT_ROUND = 2 << 20
_POLL_S = 0.0005  # completion thread: poll interval once a copy is due
_PIECE_POLL_S = 0.0002
_EXPECTED_GIB_S = 60.0  # first sleep of the completion thread: bytes at this rate, then poll


@dataclasses.dataclass
class PlanTierSchema:
    _target_: str = "cacheseek.stores.plan_tier.PlanTierStore"
    client: str = "embedded"
    # The embedded client's segment: a size (24GiB, 512MiB), or auto = the workload's chunks
    # below the eviction watermark, capped by free memory (cacheseek.sizing).
    segment_bytes: Any = "auto"
    prefault_threads: int = 0
    backing: str = "shared"
    hugepages: bool = True
    shm_dir: Optional[str] = None
    transfer_kind: str = "auto"
    device: Optional[str] = None
    commit_timeout_s: float = 30.0
    overlap: Optional[bool] = None
    staging_slots: int = 2
    staging_slot_bytes: Any = 0
    max_inflight_bytes: Any = 0
    write_piece_bytes: Any = "32MiB"
    write_pieces_in_flight: int = 2
    client_options: Dict[str, Any] = dataclasses.field(default_factory=dict)


@attrs.frozen(slots=True)
class PlanTierStats:
    """A snapshot of the Plan tier's counters (bytes and seconds are whole calls, wall clock).

    Warm-up: ``warmup_seconds`` (all of it), ``segment_ready_seconds`` (the client's
    ``wait_local_segments_ready``: ``map_seconds`` + ``fault_seconds`` for an embedded client,
    ``fault_method`` with ``fault_threads``, ``huge_page_bytes`` backed by 2 MiB pages),
    ``register_seconds`` and ``mappings`` (per mapping: ptr, length, generation, writable,
    register_seconds). Writes: ``put_seconds`` from put_async to ready, ``put_submit_seconds``
    spent inside put_async (the request path), ``backpressure_*`` waits for a staging slot,
    ``pending_writes`` and ``inflight_bytes`` now, ``peak_inflight_bytes``."""

    put_bytes: int = 0
    put_seconds: float = 0.0
    put_submit_seconds: float = 0.0
    puts: int = 0
    put_failures: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    reads: int = 0
    read_hits: int = 0
    read_misses: int = 0
    plans_started: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    gets_started: int = 0
    gets_transferred: int = 0
    gets_cancelled: int = 0
    values_removed: int = 0
    used_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    n_values: Optional[int] = None
    overlap: bool = False
    pending_writes: int = 0
    inflight_bytes: int = 0
    peak_inflight_bytes: int = 0
    backpressure_waits: int = 0
    backpressure_seconds: float = 0.0
    snapshot_bytes: int = 0
    write_pieces: int = 0
    staging_bytes: int = 0
    warmup_seconds: float = 0.0
    segment_ready_seconds: float = 0.0
    map_seconds: float = 0.0
    fault_seconds: float = 0.0
    fault_method: str = "none"
    fault_threads: int = 0
    huge_page_bytes: int = -1
    register_seconds: float = 0.0
    mappings: tuple = ()
    transfer: Dict[str, Any] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["mappings"] = [dict(m) for m in self.mappings]
        out.update({f"transfer_{k}": v for k, v in out.pop("transfer").items()})
        return out


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


@attrs.define(eq=False)
class _Slot:
    """A staging buffer on the runtime device (a uint8 tensor) for one in-flight write."""

    tensor: Any
    ptr: int
    nbytes: int
    busy: bool = False

    def range(self) -> MemoryRange:
        return MemoryRange(self.ptr, self.nbytes)


@attrs.define(eq=False)
class _PendingWrite:
    handle: BlobHandle
    plans: list
    snapshot: Optional[PendingBatch]
    copy: Optional[PendingBatch]  # the whole D2H, submitted by put_async (write_piece_bytes=0)
    pieces: list  # else the D2H in pieces, submitted by the completion thread
    slot: _Slot
    on_ready: Optional[Callable[[BlobHandle], None]]
    t0: float
    nbytes: int


def _split(batch: CopyBatch, piece_bytes: int) -> list[CopyBatch]:
    """``batch`` cut into pieces of about ``piece_bytes`` (copies larger than that are cut into
    sub-copies of contiguous bytes); one piece when ``piece_bytes`` is 0."""
    if piece_bytes <= 0 or batch.nbytes <= piece_bytes:
        return [batch]
    sizes = batch.sizes
    parts = -(-sizes // piece_bytes)
    idx = np.repeat(np.arange(len(sizes)), parts)
    starts = np.repeat(np.cumsum(parts) - parts, parts)
    off = (np.arange(len(idx)) - starts) * piece_bytes
    sub = np.minimum(piece_bytes, sizes[idx] - off)
    dsts, srcs, codes = batch.dsts[idx] + off, batch.srcs[idx] + off, batch.codes[idx]
    group = (np.cumsum(sub) - sub) // piece_bytes
    cuts = np.flatnonzero(np.diff(group)) + 1
    return [CopyBatch(d, s_, n, c) for d, s_, n, c in zip(
        np.split(dsts, cuts), np.split(srcs, cuts), np.split(sub, cuts), np.split(codes, cuts))]


@STORES.register("fluxon_plan", PlanTierSchema)
class PlanTierStore:
    """KV tier over a Plan client and a transfer runtime (see the module docstring).

    ``client``: a `PLAN_CLIENTS` name, built with ``segment_bytes``, ``prefault_threads``,
    ``backing``, ``hugepages``, ``shm_dir`` (where its schema has them) and ``client_options``;
    or pass a built client as ``plan_client`` (the caller then keeps owning it). ``transfer``: a
    built `TransferRuntime` (the caller keeps owning it); else ``transfer_kind`` from `TRANSFERS`
    is built for ``device`` now, or for the device of the first tensors seen.
    ``overlap``: None = on for a CUDA runtime, off for the host runtime; on needs a runtime with
    the `AsyncTransfer` capability. ``staging_slots`` x ``staging_slot_bytes`` (0: sized by the
    first chunk) of device memory hold the snapshots of in-flight writes; ``max_inflight_bytes``
    (0: no bound beyond the slots) bounds the bytes of pending writes. ``write_piece_bytes``: the
    overlapped D2H goes out in pieces of about this size, ``write_pieces_in_flight`` at a time,
    from the completion thread (0: one batch from put_async). A copy the runtime makes in the same
    direction meanwhile (a frame read back, a ``.tolist()``) shares the copy engine: behind one
    3.6 GiB batch it would wait ~70 ms, behind two pieces of 32 MiB ~1.3 ms.
    """

    accepts_device_views = True
    storage_format = "cacheseek.plan.raw.v1"  # bare bytes; shapes and dtypes come from the runtime

    def __init__(
        self,
        client: str = "embedded",
        segment_bytes: Size = 1 << 30,
        prefault_threads: int = 0,
        backing: str = "shared",
        hugepages: bool = True,
        shm_dir: Optional[str] = None,
        transfer_kind: str = "auto",
        device: Optional[str] = None,
        commit_timeout_s: float = 30.0,
        overlap: Optional[bool] = None,
        staging_slots: int = 2,
        staging_slot_bytes: Size = 0,
        max_inflight_bytes: Size = 0,
        write_piece_bytes: Size = 32 << 20,
        write_pieces_in_flight: int = 2,
        client_options: Optional[dict[str, Any]] = None,
        *,
        transfer: Optional[TransferRuntime] = None,
        plan_client: Optional[PlanClient] = None,
        geometry_bytes: Optional[tuple[int, int]] = None,
    ) -> None:
        for name, value in (("staging_slots", staging_slots), ("write_pieces_in_flight", write_pieces_in_flight)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"store.{name}", f"must be an int >= 1, got {value!r}")
        staging_slot_bytes = parse_size(staging_slot_bytes, "store.staging_slot_bytes")
        max_inflight_bytes = parse_size(max_inflight_bytes, "store.max_inflight_bytes")
        write_piece_bytes = parse_size(write_piece_bytes, "store.write_piece_bytes")
        self.commit_timeout_s = commit_timeout_s
        self.transfer_kind = transfer_kind
        self._device = device
        self._overlap_option = overlap
        self._overlap = False
        self._n_slots = staging_slots
        self._slot_bytes = staging_slot_bytes
        self._max_inflight = max_inflight_bytes
        self._piece_bytes = write_piece_bytes
        self._pieces_in_flight = write_pieces_in_flight
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._counters: dict[str, Any] = {}
        self._info_fields: dict[str, Any] = {}
        self._latent_nbytes: dict[str, int] = {}
        self._closed = False
        # write-back state: one condition guards the queue, the slots and the in-flight bytes
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[_PendingWrite] = collections.deque()
        self._slots: list[_Slot] = []
        self._inflight = 0
        self._peak_inflight = 0
        self._worker: Optional[threading.Thread] = None
        self._stopping = False
        self._write_stream: Any = None
        self._read_stream: Any = None
        if plan_client is None:
            factory = PLAN_CLIENTS.get(client)
            try:
                accepted = {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(client))}
            except KeyError:
                accepted = set()
            given = dict(
                segment_bytes=segment_bytes,
                prefault_threads=prefault_threads,
                backing=backing,
                hugepages=hugepages,
                shm_dir=shm_dir,
            )
            if geometry_bytes is not None:  # (largest value, one chunk's KV): clients size staging
                given.update(value_bytes=geometry_bytes[0], chunk_bytes=geometry_bytes[1])
            kwargs = {k: v for k, v in given.items() if k in accepted}
            kwargs.update(client_options or {})
            plan_client = factory(**kwargs)
            self._owns_client = True
        else:
            self._owns_client = False
        self._client: PlanClient = plan_client
        self._transfer: Optional[TransferRuntime] = transfer
        self._owns_transfer = False
        self._mappings: list[HostMapping] = []
        self._registered_here: list[HostMapping] = []
        self._value_ranges: list[MemoryRange] = []  # segments on the device (the HBM tier's pool)
        try:
            self._warm_up(device)
        except BaseException:
            self._teardown_transfer()
            if self._owns_client:
                self._client.close()
            raise

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]:
        """`SizedStore`: the embedded client's ``segment_bytes``, or the host staging
        (``client_options.staging_bytes``) of a client that stages writes, against free memory."""
        client = config.get("client", "embedded")
        options = config.get("client_options") or {}
        try:
            accepted = {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(client))}
        except KeyError:
            accepted = set()
        room, label = available_memory(), "free memory"
        if options.get("backing", config.get("backing")) == "shm":
            shm = options.get("shm_dir") or config.get("shm_dir") or "/dev/shm"
            shm_free = free_bytes(shm)
            if shm_free is not None and (room is None or shm_free < room):
                room, label = shm_free, f"free space in {shm}"
        fields = []
        if "segment_bytes" in accepted:
            fields.append(SizeField("segment_bytes", "segment", room=room, room_label=label,
                                    alignment=int(options.get("alignment", 256))))
        if "staging_bytes" in accepted:
            fields.append(SizeField("client_options.staging_bytes", "staging", room=room, room_label=label,
                                    alignment=256))
        return fields

    # -- warm-up --------------------------------------------------------------------------------
    def _warm_up(self, device: Optional[str]) -> None:
        """Segments ready, registered, streams made, staging allocated; every stage timed."""
        t0 = time.perf_counter()
        segments = self._client.wait_local_segments_ready()
        self._count(segment_ready_seconds=time.perf_counter() - t0)
        self._mappings = [HostMapping(s.ptr, s.length, s.generation, s.writable)
                          for s in segments if not getattr(s, "on_device", False)]
        self._value_ranges = [MemoryRange(s.ptr, s.length) for s in segments if getattr(s, "on_device", False)]
        if self._transfer is None and device is not None:
            self._transfer = self._build_transfer(device)
        if self._transfer is not None:
            self._attach_transfer(None)
        self._count(warmup_seconds=time.perf_counter() - t0)
        timers_fn = self._info("segment_timers")
        timers = timers_fn() if timers_fn is not None else None
        log.info(
            "Plan tier warm-up: %d mapping(s), %.1f GiB, ready in %.3f s (fault %.3f s %s, "
            "register %.3f s), overlap %s",
            len(self._mappings), sum(m.length for m in self._mappings) / 2**30,
            self._counters.get("warmup_seconds", 0.0), timers.fault_seconds if timers else 0.0,
            timers.fault_method if timers else "?", self._counters.get("register_seconds", 0.0),
            self._overlap,
        )

    def _build_transfer(self, device: Any) -> TransferRuntime:
        factory = TRANSFERS.get(self.transfer_kind)
        if self.transfer_kind == "auto":
            runtime = factory(device=device)
        elif "device" in inspect.signature(factory).parameters:
            runtime = factory(device=str(device))  # streams, events and threads on that GPU
        else:
            runtime = factory()
        self._owns_transfer = True
        return runtime

    def _attach_transfer(self, like: Any) -> None:
        """Register the segments with the runtime, resolve ``overlap``, make the streams and
        (with ``staging_slot_bytes``) the staging slots."""
        transfer = self._transfer
        assert transfer is not None
        self._register()
        can_async = _offers_async(transfer)
        wanted = self._overlap_option
        if wanted is None:
            wanted = can_async and getattr(transfer, "device_kind", "cpu") == "cuda"
        if wanted and not can_async:
            raise ConfigError(
                "store.overlap", f"{type(transfer).__name__} offers no streams and events",
                "set store.overlap=false or use a transfer runtime with the AsyncTransfer capability",
            )
        self._overlap = bool(wanted)
        self._info_fields["overlap"] = self._overlap
        if can_async:
            self._write_stream = transfer.new_stream()  # type: ignore[attr-defined]
            self._read_stream = transfer.new_stream()  # type: ignore[attr-defined]
        if self._overlap and self._slot_bytes > 0:
            with self._cv:
                for _ in range(self._n_slots):
                    self._slots.append(self._new_slot(self._slot_bytes, like))

    def _register(self) -> None:
        transfer = self._transfer
        if transfer is None:
            return
        entries = []
        # registrations are reference-counted by the runtime: this store unregisters exactly what
        # it registered at close, and a shared runtime keeps what another user still holds
        for m in self._mappings:
            t0 = time.perf_counter()
            transfer.register([m])
            self._registered_here.append(m)
            seconds = time.perf_counter() - t0
            self._count(register_seconds=seconds)
            entries.append(dict(ptr=m.ptr, length=m.length, generation=m.generation,
                                writable=m.writable, register_seconds=seconds))
        self._info_fields["mappings"] = tuple(entries)

    def _transfer_for(self, tensor: Any) -> TransferRuntime:
        if self._transfer is not None:
            return self._transfer
        with self._setup_lock:
            if self._transfer is None:
                device = getattr(tensor, "device", "cpu")
                log.warning(
                    "Plan tier: transfer runtime chosen from the first tensors (%s); segments are "
                    "registered now, on a request's path. Pass device= (or transfer=) to do this "
                    "at warm-up.", device,
                )
                self._transfer = self._build_transfer(device)
                self._attach_transfer(tensor)
            return self._transfer

    @property
    def transfer(self) -> Optional[TransferRuntime]:
        return self._transfer

    @property
    def plan_client(self) -> PlanClient:
        return self._client

    @property
    def overlap(self) -> bool:
        """Whether writes return before their copies land (resolved once a runtime is known)."""
        return self._overlap

    @property
    def values_on_device(self) -> bool:
        """Whether the client's values live in device memory (the HBM tier): copies in and out
        of them are D2D and the segment is a declared device range, not a registered mapping."""
        return bool(self._value_ranges)

    @property
    def _out(self) -> Direction:  # tensors -> values
        return Direction.D2D if self._value_ranges else Direction.D2H

    @property
    def _in(self) -> Direction:  # values -> tensors
        return Direction.D2D if self._value_ranges else Direction.H2D

    def _info(self, call: str) -> Any:
        """The client's `PlanClientInfo` call ``call``, or None when it does not offer it (checked
        by attribute, so proxies that delegate through ``__getattr__`` keep the capability)."""
        fn = getattr(self._client, call, None)
        return fn if callable(fn) else None

    def _arena(self) -> Optional[tuple[int, int]]:
        table_arena = self._info("table_arena")
        return table_arena() if table_arena is not None else None

    # -- counters -------------------------------------------------------------------------------
    def _count(self, **deltas: Any) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] = self._counters.get(k, 0) + v

    @property
    def stats(self) -> PlanTierStats:
        with self._lock:
            counters = dict(self._counters)
            info = dict(self._info_fields)
        with self._cv:
            pending, inflight, peak = len(self._queue), self._inflight, self._peak_inflight
            staging = sum(s.nbytes for s in self._slots)
        usage_fn, timers_fn = self._info("usage"), self._info("segment_timers")
        usage = usage_fn() if usage_fn is not None and not self._closed else None
        timers = timers_fn() if timers_fn is not None else None
        return PlanTierStats(
            **counters,
            **info,
            used_bytes=usage.used_bytes if usage else None,
            capacity_bytes=usage.capacity_bytes if usage else None,
            n_values=usage.n_values if usage else None,
            pending_writes=pending,
            inflight_bytes=inflight,
            peak_inflight_bytes=peak,
            staging_bytes=staging,
            map_seconds=getattr(timers, "map_seconds", 0.0) if timers else 0.0,
            fault_seconds=timers.fault_seconds if timers else 0.0,
            fault_method=timers.fault_method if timers else "none",
            fault_threads=getattr(timers, "fault_threads", 0) if timers else 0,
            huge_page_bytes=getattr(timers, "huge_page_bytes", -1) if timers else -1,
            transfer=self._transfer.stats.as_dict() if self._transfer is not None else {},
        )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("Plan tier store used after close()")

    # -- write ----------------------------------------------------------------------------------
    def put_async(
        self,
        locator: str,
        payload: Sequence[LayerPayload],
        *,
        tier: Tier,
        on_ready: Optional[Callable[[BlobHandle], None]] = None,
        stream: Any = None,
    ) -> BlobHandle:
        """Write one chunk's KV (per layer ``(k, v)`` views ``[1, chunk_tokens, H, D]``,
        contiguous, on the runtime device) under ``{locator}:L{i}:k/v``; ``stream``: where the
        views were produced (None: the current stream). Without overlap the handle comes back
        ready (on_ready already called); with overlap it comes back PENDING and turns ready (or
        gets ``error``) on the completion thread. Raises a `StoreError` (handle.error set) for a
        failure found before it returns."""
        self._check_open()
        layers = list(payload)
        handle = BlobHandle(tier, locator, 0, len(layers))
        t0 = time.perf_counter()
        try:
            items = []
            for i, (k, v) in enumerate(layers):
                k_key, v_key = layer_keys(locator, i)
                items += [(k_key, k), (v_key, v)]
            if not items:
                raise PlanError(f"put of {locator}: empty payload")
            handle.nbytes = sum(_nbytes(t) for _, t in items)
            self._transfer_for(items[0][1])
            if self._overlap and len(self._waves(items)) == 1:
                self._put_overlapped(handle, items, on_ready, stream, t0)
                self._count(put_submit_seconds=time.perf_counter() - t0)
                return handle
            self._put_values(items, stream=stream)
        except Exception as exc:
            self._count(put_failures=1)
            handle.error = _as_store_error(exc, f"put of {locator}")
            if handle.error is exc:
                raise
            raise handle.error from exc
        elapsed = time.perf_counter() - t0
        self._count(puts=1, put_bytes=handle.nbytes, put_seconds=elapsed, put_submit_seconds=elapsed)
        handle.ready = True
        if on_ready is not None:
            on_ready(handle)
        return handle

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        """Write one latent (a contiguous tensor on the runtime device) as the value ``locator``
        (``{hex}:lat``), synchronously. Raises a `StoreError`."""
        self._check_open()
        try:
            self._put_values([(locator, latent)], stream=stream)
        except Exception as exc:
            error = _as_store_error(exc, f"put of skeleton {locator}")
            if error is exc:
                raise
            raise error from exc
        self._latent_nbytes[locator] = _nbytes(latent)

    @staticmethod
    def _group(lengths: Sequence[int]) -> dict[int, list[int]]:
        """Item indices by value size, in first-seen order (one Plan per size)."""
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(length, []).append(i)
        return groups

    def _start_plans(
        self, keys: Sequence[str], lengths: Sequence[int], started: list[PutPlan]
    ) -> tuple[list[int], list[int], list[int]]:
        """Start one Plan per size group (appended to ``started`` as they start); returns the
        value pointers, the item indices and the sizes, all in group order."""
        dsts: list[int] = []
        order: list[int] = []
        sizes: list[int] = []
        arena = self._arena()
        for nbytes, idxs in self._group(lengths).items():
            plan, table = self._client.local_fast_put_start([keys[i] for i in idxs], nbytes)
            started.append(plan)
            self._count(plans_started=1)
            dsts += decode_plan_table(table, len(idxs), arena=arena)
            order += idxs
            sizes += [nbytes] * len(idxs)
        return dsts, order, sizes

    def _put_values(self, items: list[tuple[str, Any]], *, stream: Any) -> None:
        """Synchronous write: D2H straight from the tensors, then commit."""
        transfer = self._transfer_for(items[0][1])
        ranges = [transfer.device_range(t) for _, t in items]
        started: list[PutPlan] = []
        submitted: list[PutPlan] = []
        futures: dict[PutPlan, Future] = {}
        done: list[PutPlan] = []  # committed by earlier waves
        try:
            for wave in self._waves(items):
                sub = [items[i] for i in wave]
                sub_ranges = [ranges[i] for i in wave]
                dsts, order, sizes = self._start_plans([k for k, _ in sub], [r.length for r in sub_ranges], started)
                batch = CopyBatch.of(dsts, [sub_ranges[i].ptr for i in order], sizes, self._out)
                self._copy_now(transfer, batch, sub_ranges + self._value_ranges, producer=stream,
                               on=self._write_stream)
                self._commit(started, submitted, futures)
                done += submitted
                submitted.clear()
        except BaseException as exc:
            self._undo_put(exc, started, done + submitted, futures)
            raise

    def _waves(self, items: list[tuple[str, Any]]) -> list[list[int]]:
        """Item indices in waves of plans whose staging fits the client at once (its optional
        ``max_plan_values(value_len)``); one wave when the client stages no bytes of its own or
        everything fits. Each wave is started, copied and committed before the next starts."""
        limit = self._info("max_plan_values")
        everything = [list(range(len(items)))]
        if limit is None:
            return everything
        sizes = [_nbytes(t) for _, t in items]
        by_size: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            by_size.setdefault(n, []).append(i)
        fits = {n: int(limit(n)) for n in by_size}
        for n, cap in fits.items():
            if cap < 1:
                raise PlanError(f"the Plan client cannot stage one value of {n} bytes (raise its staging)")
        if sum(len(idxs) / fits[n] for n, idxs in by_size.items()) <= 1.0:
            return everything
        waves: list[list[int]] = [[]]
        share = 0.0
        for n, idxs in by_size.items():
            for i in idxs:
                if share + 1.0 / fits[n] > 1.0 + 1e-9:
                    waves.append([])
                    share = 0.0
                waves[-1].append(i)
                share += 1.0 / fits[n]
        return waves

    def copy_values_from(
        self, source: "PlanTierStore", keys: Sequence[str], lengths: Optional[Sequence[int]] = None
    ) -> Optional[int]:
        """Copy the published values ``keys`` of another Plan-style store into this one under the
        same keys: one get plan on ``source``, one batch straight from its values into this
        store's reserved values (H2D from a host store into device values, D2H the other way, D2D
        or H2H between two of a kind), one synchronize, then commit: publication last. How tiers
        promote and demote without a staging copy. ``lengths``: each value's byte length (default:
        what ``source`` knows of them). All or nothing: None, with nothing written, when a key is
        missing from ``source``; a `StoreError` (nothing written) on any failure. Both stores'
        memory must be known to this store's transfer runtime (the tiered store shares one).
        Returns the bytes copied."""
        self._check_open()
        source._check_open()
        transfer: Any = self._transfer
        if transfer is None:
            raise PlanError("copy between Plan stores needs a transfer runtime: build the store with "
                            "transfer= or device=")
        keys = list(keys)
        started: list[PutPlan] = []
        submitted: list[PutPlan] = []
        futures: dict[PutPlan, Future] = {}
        try:
            with source._reading(keys, [len(keys)]) as read:
                table, n = read.transfer(lengths)
                if n < len(keys):
                    return None
                srcs = decode_plan_table(table, n, arena=source._arena())
                if lengths is None:
                    lengths = source._lengths(read)
                dsts, order, sizes = self._start_plans(keys, list(lengths), started)
                batch = CopyBatch.of(dsts, [srcs[i] for i in order], sizes,
                                     _direction(source.values_on_device, self.values_on_device))
                try:
                    self._copy_now(transfer, batch, self._value_ranges + source._value_ranges,
                                   producer=None, on=self._write_stream)
                    self._commit(started, submitted, futures)
                except BaseException as exc:
                    self._undo_put(exc, started, submitted, futures)
                    raise
        except Exception as exc:
            error = _as_store_error(exc, f"copy of {len(keys)} values between Plan stores")
            if error is exc:
                raise
            raise error from exc
        for key, length in zip(keys, lengths):
            if key.endswith(":lat"):
                self._latent_nbytes[key] = int(length)
        return batch.nbytes

    def _lengths(self, read: "_Read") -> list[int]:
        """Byte lengths of a transferred read's values: the client's, else this store's records."""
        if callable(getattr(self._client, "value_lengths", None)):  # PlanValueLengths
            return [int(n) for n in self._client.value_lengths(read.plan)]
        lengths = [self._latent_nbytes.get(k) for k in read.plan.keys]
        if any(n is None for n in lengths):
            raise LayoutMismatchError("value lengths unknown: pass lengths= to copy_values_from")
        return lengths  # type: ignore[return-value]

    def _copy_now(
        self, transfer: Any, batch: CopyBatch, ranges: list[MemoryRange], *, producer: Any, on: Any
    ) -> None:
        """One batch on stream ``on`` after the ``producer`` stream's work, waited for."""
        if on is None:
            transfer.copy_batch(batch.descriptors(), stream=producer, device_ranges=ranges)
            return
        event = transfer.record_event(producer)
        try:
            transfer.copy_batch(batch, stream=on, device_ranges=ranges, after=[event])
        finally:
            transfer.release_event(event)

    def _put_overlapped(
        self,
        handle: BlobHandle,
        items: list[tuple[str, Any]],
        on_ready: Optional[Callable[[BlobHandle], None]],
        stream: Any,
        t0: float,
    ) -> None:
        """Start the Plans, snapshot the views into a staging slot on the producer stream, D2H
        from the slot on the write stream; the completion thread does the rest."""
        transfer: Any = self._transfer
        ranges = [transfer.device_range(t) for _, t in items]
        lengths = np.array([r.length for r in ranges], dtype=np.int64)
        offsets = np.zeros(len(ranges), dtype=np.int64)
        offsets[1:] = np.cumsum(-(-lengths // _ALIGN) * _ALIGN)[:-1]
        need = int(offsets[-1] + lengths[-1])
        started: list[PutPlan] = []
        batches: list[PendingBatch] = []
        slot: Optional[_Slot] = None
        try:
            dsts, order, sizes = self._start_plans([k for k, _ in items], [r.length for r in ranges], started)
            slot = self._acquire_slot(need, handle.nbytes, items[0][1])
            snap = CopyBatch.of(slot.ptr + offsets, [r.ptr for r in ranges], lengths, Direction.D2D)
            d2h = CopyBatch.of(dsts, slot.ptr + offsets[order], sizes, self._out)
            # Both batches are checked whole before the first copy goes out (DESIGN section 2),
            # although the D2H is submitted later, in pieces, from the completion thread.
            transfer.validate(snap, device_ranges=ranges + [slot.range()])
            transfer.validate(d2h, device_ranges=[slot.range()] + self._value_ranges)
            snapshot = transfer.submit_batch(snap, stream=stream, device_ranges=ranges + [slot.range()])
            batches.append(snapshot)
            pieces = _split(d2h, self._piece_bytes)
            copy: Optional[PendingBatch] = None
            if len(pieces) == 1:
                copy = transfer.submit_batch(
                    d2h, stream=self._write_stream, device_ranges=[slot.range()] + self._value_ranges,
                    after=[snapshot]
                )
                batches.append(copy)
                pieces = []
            else:  # the write stream is ordered after the snapshot now; pieces follow later
                transfer.stream_wait(self._write_stream, snapshot)
        except BaseException as exc:
            for pending in batches:
                _settle(pending, exc)
            self._undo_put(exc, started, [], {})
            if slot is not None:
                self._release_slot(slot, handle.nbytes)
            raise
        self._count(snapshot_bytes=handle.nbytes)
        self._enqueue(_PendingWrite(handle, started, snapshot, copy, pieces, slot, on_ready, t0, handle.nbytes))

    # -- staging slots and the completion thread ------------------------------------------------
    def _new_slot(self, nbytes: int, like: Any) -> _Slot:
        import torch

        size = -(-nbytes // _SLOT_ROUND) * _SLOT_ROUND
        device = getattr(like, "device", None)
        if device is None:
            kind = getattr(self._transfer, "tensor_device_type", "cpu")
            if kind == "cuda":
                device = torch.device(self._device) if self._device and ":" in str(self._device) else torch.device(
                    "cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        tensor = torch.empty(size, dtype=torch.uint8, device=device)
        return _Slot(tensor, int(tensor.data_ptr()), size)

    def _take_slot_locked(self, need: int, like: Any) -> Optional[_Slot]:
        free = [s for s in self._slots if not s.busy]
        for s in free:
            if s.nbytes >= need:
                s.busy = True
                return s
        if len(self._slots) < self._n_slots or free:
            if len(self._slots) >= self._n_slots:
                self._slots.remove(free[0])  # too small for this chunk: replaced by a larger one
            slot = self._new_slot(max(need, self._slot_bytes), like)
            slot.busy = True
            self._slots.append(slot)
            return slot
        return None

    def _acquire_slot(self, need: int, nbytes: int, like: Any) -> _Slot:
        """A free staging slot of ``need`` bytes; blocks while every slot is busy or
        ``max_inflight_bytes`` would be exceeded (backpressure)."""
        waited_from: Optional[float] = None
        deadline = time.monotonic() + self.commit_timeout_s
        with self._cv:
            while True:
                if self._closed or self._stopping:
                    raise StoreClosedError("Plan tier store closed while a write waited for a staging slot")
                bound_ok = (self._max_inflight == 0 or self._inflight == 0
                            or self._inflight + nbytes <= self._max_inflight)
                slot = self._take_slot_locked(need, like) if bound_ok else None
                if slot is not None:
                    break
                if waited_from is None:
                    waited_from = time.perf_counter()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cv.wait(timeout=remaining):
                    if time.monotonic() >= deadline:
                        raise StoreTimeoutError(
                            f"no staging slot free after {self.commit_timeout_s} s "
                            f"({len(self._queue)} writes pending, {self._inflight} B in flight)"
                        )
            self._inflight += nbytes
            self._peak_inflight = max(self._peak_inflight, self._inflight)
        if waited_from is not None:
            self._count(backpressure_waits=1, backpressure_seconds=time.perf_counter() - waited_from)
        return slot

    def _release_slot(self, slot: _Slot, nbytes: int) -> None:
        with self._cv:
            if slot.busy:
                slot.busy = False
                self._inflight -= nbytes
            self._cv.notify_all()

    def _enqueue(self, item: _PendingWrite) -> None:
        with self._cv:
            self._queue.append(item)
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="plan-tier-commit", daemon=True)
                self._worker.start()
            self._cv.notify_all()

    def _drain(self) -> None:
        """The completion thread: writes complete in submission order (one write stream). It runs
        on the transfer runtime's device (`bind_thread`), never on device 0 by default."""
        bind = getattr(self._transfer, "bind_thread", None)
        if callable(bind):
            bind()
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue[0]
            try:
                self._complete(item)
            except BaseException:  # noqa: BLE001 - the thread must outlive any one write
                log.exception("Plan tier: completing the write of %s failed", item.handle.locator)
            finally:
                with self._cv:
                    self._queue.popleft()
                    self._cv.notify_all()

    def _complete(self, item: _PendingWrite) -> None:
        handle = item.handle
        started = list(item.plans)
        submitted: list[PutPlan] = []
        futures: dict[PutPlan, Future] = {}
        try:
            try:
                if item.copy is not None:
                    item.copy.wait(poll_s=_POLL_S, expected_s=0.9 * item.nbytes / (_EXPECTED_GIB_S * 2**30))
                else:
                    self._trickle(item)
            finally:
                if item.snapshot is not None:
                    _settle(item.snapshot)
                self._release_slot(item.slot, item.nbytes)
            self._commit(started, submitted, futures)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            self._undo_put(exc, started, submitted, futures)
            self._count(put_failures=1)
            error = exc if isinstance(exc, Exception) else PlanError(repr(exc))
            handle.error = _as_store_error(error, f"put of {handle.locator}")
            log.warning("Plan tier: write of %s failed after submission: %s", handle.locator, handle.error)
            return
        self._count(puts=1, put_bytes=item.nbytes, put_seconds=time.perf_counter() - item.t0)
        handle.ready = True
        if item.on_ready is not None:
            try:
                item.on_ready(handle)
            except Exception:  # noqa: BLE001 - the write is done; the callback's failure is logged
                log.exception("Plan tier: on_ready of %s raised", handle.locator)

    def _trickle(self, item: _PendingWrite) -> None:
        """Submit the D2H pieces on the write stream, at most ``write_pieces_in_flight`` at a
        time (the first after the snapshot's event); return when every piece has landed."""
        transfer: Any = self._transfer
        in_flight: collections.deque[PendingBatch] = collections.deque()
        after = [item.snapshot] if item.snapshot is not None else []
        try:
            for piece in item.pieces:
                while len(in_flight) >= self._pieces_in_flight:
                    oldest = in_flight.popleft()
                    oldest.wait(poll_s=_PIECE_POLL_S, expected_s=0.8 * oldest.nbytes / (_EXPECTED_GIB_S * 2**30))
                in_flight.append(transfer.submit_batch(
                    piece, stream=self._write_stream, device_ranges=[item.slot.range()] + self._value_ranges,
                    after=after
                ))
                after = []
                self._count(write_pieces=1)
            while in_flight:
                in_flight.popleft().wait(poll_s=_PIECE_POLL_S)
        except BaseException as exc:
            for pending in in_flight:
                _settle(pending, exc)
            raise

    # -- commit / undo --------------------------------------------------------------------------
    def _commit(self, started: list[PutPlan], submitted: list[PutPlan], futures: dict[PutPlan, Future]) -> None:
        """Commit every started Plan (moved to ``submitted`` as its commit is called) and check
        every status and key code; raises `PlanError` naming each failure."""
        while started:
            plan = started.pop(0)
            submitted.append(plan)
            futures[plan] = self._client.local_fast_put_commit(plan)
        failures = []
        for plan in submitted:
            result = self._commit_result(plan, futures[plan])
            if not result.ok:
                bad = [f"{k}={c}" for k, c in zip(plan.keys, result.key_codes) if c]
                failures.append(
                    f"commit of {len(plan.keys)} values of {plan.value_len} B: status "
                    f"{result.status}{', key codes ' + ', '.join(bad) if bad else ''}"
                    f"{' (' + result.message + ')' if result.message else ''}"
                )
        if failures:
            raise PlanError("; ".join(failures))
        self._count(plans_committed=len(submitted))

    def _commit_result(self, plan: PutPlan, future: Future) -> PutCommitResult:
        try:
            return future.result(timeout=self.commit_timeout_s)
        except FutureTimeout as exc:
            raise StoreTimeoutError(
                f"commit of {len(plan.keys)} values not done after {self.commit_timeout_s} s"
            ) from exc

    def _undo_put(
        self,
        exc: BaseException,
        started: list[PutPlan],
        submitted: list[PutPlan],
        futures: dict[PutPlan, Future],
    ) -> None:
        """Abort every uncommitted plan; remove every key of a submitted one (after its commit
        settled; a commit call that raised counts as submitted), so that a failed write leaves
        nothing behind."""
        for plan in started:
            try:
                self._client.put_abort(plan)
                self._count(plans_aborted=1)
            except Exception as abort_error:
                add_note(exc, f"put_abort failed too: {abort_error!r}")
        for plan in submitted:
            future = futures.get(plan)
            if future is not None:
                try:
                    future.result(timeout=self.commit_timeout_s)
                except Exception:
                    pass  # its keys are removed below whatever the commit's outcome
            for key in plan.keys:
                try:
                    self._client.remove(key)
                    self._count(values_removed=1)
                except Exception as remove_error:
                    add_note(exc, f"remove({key!r}) after a failed commit failed too: {remove_error!r}")

    # -- read -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reading(self, keys: list[str], group_lens: list[int]) -> Iterator["_Read"]:
        read = _Read(self, self._client.get_start(keys, group_lens))
        self._count(gets_started=1)
        try:
            yield read
        except BaseException as exc:
            try:
                read.end()
            except Exception as end_error:
                add_note(exc, f"ending the get plan failed too: {end_error!r}")
            raise
        read.end()

    def read_path(
        self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget
    ) -> bool:
        """See `PathReadStore.read_path`. Raises `LayoutMismatchError` when the blob handles or
        the runs disagree with ``target``; `TransferError`, `PlanTableError`, `PlanError` on
        failures. Fills ``target.latents`` and ``target.kv``; publishes nothing."""
        self._check_open()
        path, window = list(path), list(window)
        t0 = time.perf_counter()
        self._count(reads=1)
        found = self._check_path(path, window, target)
        if found is None:
            self._count(read_misses=1)
            return False
        latent_keys, blobs = found
        transfer = self._transfer_for(target.kv[0][0])
        moved = self._read_window(latent_keys, blobs, target, transfer)
        if moved is None:
            self._count(read_misses=1)
            return False
        self._count(read_hits=1, get_bytes=moved, get_seconds=time.perf_counter() - t0)
        return True

    def _check_path(
        self, path: list[ChunkNode], window: list[ChunkNode], target: RestoreTarget
    ) -> Optional[tuple[list[str], list[BlobHandle]]]:
        """The path's latent keys and the window's blob handles; None on a miss (a node without
        skeleton or ready blob). Raises `LayoutMismatchError` when sizes, depths or runs disagree
        with the target."""
        n_layers, value_nbytes = target.n_layers, target.chunk_value_nbytes
        if n_layers == 0 or len(target.latents) != len(path):
            raise LayoutMismatchError(
                f"{len(target.latents)} latent targets and {n_layers} layers for a path of {len(path)}"
            )
        depths = [n.depth for n in window]
        if depths != list(target.window_depths):
            raise LayoutMismatchError(
                f"window depths {depths} differ from the target's {list(target.window_depths)}"
            )
        latent_keys = [n.skeleton.latent_locator for n in path if n.skeleton is not None]
        blobs = [n.blob for n in window if n.blob is not None and n.blob.ready]
        if len(latent_keys) != len(path) or len(blobs) != len(window):
            return None
        for blob in blobs:
            if blob.n_layers != n_layers or blob.nbytes != 2 * n_layers * value_nbytes:
                raise LayoutMismatchError(
                    f"blob {blob.locator} holds {blob.n_layers} layers in {blob.nbytes} B; the "
                    f"runtime expects {n_layers} layers of K and V of {value_nbytes} B each"
                )
        for run in target.runs:
            if run.chunk_depth not in depths or run.src_token + run.n_tokens > target.chunk_tokens:
                raise LayoutMismatchError(
                    f"copy run {run} is outside the window or a {target.chunk_tokens}-token chunk"
                )
        return latent_keys, blobs

    def _submit_read(self, transfer: Any, batch: CopyBatch, ranges: list[MemoryRange], after: list) -> Optional[PendingBatch]:
        if self._read_stream is None:  # a runtime without streams: synchronous, on the caller's stream
            transfer.copy_batch(batch.descriptors(), device_ranges=ranges)
            return None
        return transfer.submit_batch(batch, stream=self._read_stream, device_ranges=ranges, after=after)

    def _read_window(
        self, latent_keys: list[str], blobs: list[BlobHandle], target: RestoreTarget, transfer: Any
    ) -> Optional[int]:
        """Latents, then the window's KV runs into the ring, on the read stream; one synchronize;
        the producer stream waits for the copies; then every view is released. Bytes moved, or
        None on a miss (a missing latent or a partial transferable prefix: nothing is copied into
        the ring)."""
        reads: list[_Read] = []
        pendings: list[PendingBatch] = []
        producer = transfer.record_event(None) if self._read_stream is not None else None
        error: Optional[BaseException] = None
        try:
            arena = self._arena()
            lat = _Read(self, self._client.get_start(latent_keys, [len(latent_keys)]))
            reads.append(lat)
            self._count(gets_started=1)
            table, n = lat.transfer([_nbytes(t) for t in target.latents])
            if n < len(latent_keys):
                return None
            srcs = decode_plan_table(table, n, arena=arena)
            lat_batch = CopyBatch.of(
                [t.data_ptr() for t in target.latents], srcs, [_nbytes(t) for t in target.latents], self._in
            )
            lat_ranges = [transfer.device_range(t) for t in target.latents] + self._value_ranges
            pending = self._submit_read(transfer, lat_batch, lat_ranges, [producer] if producer else [])
            if pending is not None:
                pendings.append(pending)

            n_layers, tb = target.n_layers, target.token_bytes
            width = 2 * n_layers
            keys = [k for blob in blobs for i in range(n_layers) for k in layer_keys(blob.locator, i)]
            kv = _Read(self, self._client.get_start(keys, [width] * len(blobs)))
            reads.append(kv)
            self._count(gets_started=1)
            table, n = kv.transfer([target.chunk_value_nbytes] * len(keys))
            if n < len(keys):
                return None
            values = np.array(decode_plan_table(table, n, arena=arena), dtype=np.int64).reshape(len(blobs), width)
            rings = [t for pair in target.kv for t in pair]  # layer-major, K before V
            ring_ptrs = np.array([t.data_ptr() for t in rings], dtype=np.int64)
            slot = {depth: j for j, depth in enumerate(target.window_depths)}
            runs = target.runs
            run_slot = np.array([slot[r.chunk_depth] for r in runs], dtype=np.int64)
            src_off = np.array([r.src_token for r in runs], dtype=np.int64) * tb
            dst_off = np.array([r.dst_token for r in runs], dtype=np.int64) * tb
            run_bytes = np.array([r.n_tokens for r in runs], dtype=np.int64) * tb
            kv_batch = CopyBatch.of(  # chunk-major runs, then layer, then K before V
                (ring_ptrs[None, :] + dst_off[:, None]).ravel(),
                (values[run_slot] + src_off[:, None]).ravel(),
                np.repeat(run_bytes, width),
                self._in,
            )
            pending = self._submit_read(
                transfer, kv_batch, [transfer.device_range(t) for t in rings] + self._value_ranges, []
            )
            if pending is not None:
                transfer.stream_wait(None, pending)  # the runtime reads the ring after the copies
                pendings.append(pending)
            for p in pendings:
                p.wait()  # the one synchronize before the views are released
            return lat_batch.nbytes + kv_batch.nbytes
        except BaseException as exc:
            error = exc
            raise
        finally:
            for p in pendings:
                _settle(p, error)
            if producer is not None:
                transfer.release_event(producer)
            for read in reads:
                try:
                    read.end()
                except Exception as end_error:
                    if error is None:
                        raise
                    add_note(error, f"ending the get plan failed too: {end_error!r}")

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        """The latent stored under ``locator``, or None when absent. With ``like`` (a tensor on the
        runtime device), a new tensor of its shape and dtype filled with the value; without, the
        raw bytes (size from ``nbytes`` or from this store's own `put_skeleton`). Restores read
        latents through `read_path`."""
        self._check_open()
        size = _nbytes(like) if like is not None else nbytes
        size = self._latent_nbytes.get(locator) if size is None else size
        if size is None:
            raise LayoutMismatchError(f"size of latent {locator} unknown: pass like= or nbytes=")
        with self._reading([locator], [1]) as read:
            table, n = read.transfer([size] if like is not None else None)
            if n == 0:
                return None
            (src,) = self._value_pointers(read, table, [size], raw=like is None)
            if like is None:
                return self._raw(src, size)
            out = like.new_empty(like.shape)
            transfer = self._transfer_for(out)
            batch = CopyBatch.of([out.data_ptr()], [src], [size], self._in)
            self._copy_now(transfer, batch, [transfer.device_range(out)] + self._value_ranges,
                           producer=None, on=self._read_stream)
            return out

    def get_layer(
        self, handle: BlobHandle, layer: int, *, like: Optional[LayerPayload] = None
    ) -> Optional[LayerPayload]:
        """One layer's ``(k, v)``, or None when either is missing. With ``like`` (a ``(k, v)``
        pair of tensors on the runtime device) new tensors of their shapes and dtypes; without,
        raw bytes of ``handle.nbytes / (2 * n_layers)`` each (K and V of one size). The manager
        restores through `read_path`; this is the generic per-layer read."""
        self._check_open()
        size = handle.nbytes // (2 * handle.n_layers)
        sizes = [size, size] if like is None else [_nbytes(t) for t in like]
        with self._reading(list(layer_keys(handle.locator, layer)), [2]) as read:
            table, n = read.transfer(sizes if like is not None else None)
            if n < 2:
                return None
            srcs = self._value_pointers(read, table, sizes, raw=like is None)
            if like is None:
                return self._raw(srcs[0], size), self._raw(srcs[1], size)
            k, v = (t.new_empty(t.shape) for t in like)
            transfer = self._transfer_for(k)
            batch = CopyBatch.of([k.data_ptr(), v.data_ptr()], srcs, [_nbytes(k), _nbytes(v)], self._in)
            self._copy_now(transfer, batch, [transfer.device_range(k), transfer.device_range(v)] + self._value_ranges,
                           producer=None, on=self._read_stream)
            return k, v

    def _value_pointers(self, read: "_Read", table: int, sizes: Sequence[int], *, raw: bool) -> list[int]:
        """The value pointers of a transferred read of ``len(sizes)`` values, checked before any
        byte is read: a bad table is a `PlanError` naming the key. With ``raw`` (the caller reads
        ``sizes`` bytes itself, with no transfer runtime to check the addresses), each value must
        also hold exactly its size (when the client reports lengths) and lie whole inside a
        segment mapping of the client: else `CorruptValueError` naming the key."""
        keys = read.plan.keys[: len(sizes)]
        try:
            srcs = decode_plan_table(table, len(sizes), arena=self._arena())
        except PlanTableError as exc:
            raise PlanError(f"read of {keys[0]!r}: {exc}") from exc
        if not raw:
            return srcs  # the transfer runtime checks every copy against the registered mappings
        lengths_fn = getattr(self._client, "value_lengths", None)
        lengths = list(lengths_fn(read.plan)) if callable(lengths_fn) else None
        for i, (key, src, size) in enumerate(zip(keys, srcs, sizes)):
            if lengths is not None and lengths[i] != size:
                raise CorruptValueError(key, f"holds {lengths[i]} B where {size} B were written")
            spans = self._value_ranges or [m.range for m in self._mappings]
            if not any(r.contains(src, size) for r in spans):
                raise CorruptValueError(
                    key, f"[{src:#x}, +{size}) does not lie inside a segment mapping of the Plan client")
        return srcs

    def _raw(self, src: int, size: int) -> bytes:
        """The bytes of a value this store holds a view of (through the pool for device values)."""
        if self._value_ranges:  # published values were synchronized before their commit
            return bytes(self._client.value_tensor(src, size).cpu().numpy())  # type: ignore[attr-defined]
        return ctypes.string_at(src, size)

    # -- reclamation / lifetime -----------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        """Remove every K/V value of the blob (idempotent); the skeleton stays. Refuses a blob
        whose write is still in flight (`WriteNotCompleteError`). Raises `PlanError` if any
        removal fails (the caller keeps the blob)."""
        self._check_open()
        if handle.in_flight:
            raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
        errors: list[tuple[str, BaseException]] = []
        for layer in range(handle.n_layers):
            for key in layer_keys(handle.locator, layer):
                try:
                    self._client.remove(key)
                    self._count(values_removed=1)
                except Exception as exc:
                    errors.append((key, exc))
        if errors:
            key, first = errors[0]
            raise PlanError(
                f"free of {handle.locator}: {len(errors)} removals failed, first {key}: {first}"
            ) from first

    # -- capacity and existence (the manager's eviction and consistency checks) ------------------
    def usage(self) -> Any:
        """The client's `PlanUsage` (segment bytes in use, its capacity, values), or None when the
        client does not report it or the store is closed."""
        fn = self._info("usage")
        return fn() if fn is not None and not self._closed else None

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` are published, in order, copying no value: a get plan of one-key
        groups, transferred and released at once; its transferable prefix ends at the first
        missing key, and the probe resumes after it."""
        self._check_open()
        keys = list(keys)
        out = [False] * len(keys)
        i = 0
        while i < len(keys):
            rest = keys[i:]
            with self._reading(rest, [1] * len(rest)) as read:
                _, n = read.transfer()
            out[i : i + n] = [True] * n
            i += n + 1
        return out

    def free_skeleton(self, locator: str) -> None:
        """Remove a latent (idempotent); raises a `StoreError` if the removal fails."""
        self._check_open()
        try:
            self._client.remove(locator)
        except Exception as exc:
            error = _as_store_error(exc, f"remove of skeleton {locator}")
            if error is exc:
                raise
            raise error from exc
        self._count(values_removed=1)
        self._latent_nbytes.pop(locator, None)

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every pending write has committed or failed (a failure is on its handle and
        in `stats`; nothing is raised). Returns at once without overlap. Bounded: at most
        ``timeout_s`` seconds (default: ``commit_timeout_s`` per pending write, at least 4 of them);
        `StoreTimeoutError` past it, naming how many writes are pending (they go on)."""
        with self._cv:
            bound = timeout_s if timeout_s is not None else self.commit_timeout_s * max(4, len(self._queue) + 1)
            deadline = time.monotonic() + bound
            while self._queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(
                        f"Plan tier: {len(self._queue)} writes still pending after {bound:.1f} s "
                        "(a stuck copy or commit?)")
                self._cv.wait(timeout=min(remaining, 1.0))

    def close(self) -> None:
        """Flush, stop the completion thread, destroy the streams, drop the staging slots,
        unregister the segments, close what this store built. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._cv:
                self._stopping = True
                self._cv.notify_all()
            if self._worker is not None:
                self._worker.join(timeout=self.commit_timeout_s)
                if self._worker.is_alive():
                    # Never tear streams, registrations or the client down under a live worker.
                    raise StoreTimeoutError(
                        f"Plan tier: the completion thread did not stop within {self.commit_timeout_s} s; "
                        "streams, registrations and the client are left as they are")
            try:
                self._teardown_transfer()
            finally:
                if self._owns_client:
                    self._client.close()

    def _teardown_transfer(self) -> None:
        transfer: Any = self._transfer
        with self._cv:
            self._slots.clear()
        if transfer is None:
            return
        try:
            for stream in (self._write_stream, self._read_stream):
                if stream is not None:
                    try:
                        transfer.destroy_stream(stream)
                    except Exception as exc:  # noqa: BLE001 - teardown goes on
                        log.warning("Plan tier: destroying a stream failed: %s", exc)
            self._write_stream = self._read_stream = None
            transfer.unregister(self._registered_here)
        finally:
            if self._owns_transfer:
                transfer.close()

    def __repr__(self) -> str:
        return (f"PlanTierStore(client={type(self._client).__name__}, transfer={self._transfer!r}, "
                f"overlap={self._overlap})")


class _Read:
    """One get plan of a read: ``transfer()`` once, then ``end()`` releases or cancels it."""

    def __init__(self, store: PlanTierStore, plan: GetPlan) -> None:
        self._store = store
        self.plan = plan
        self.transferred = False
        self.ended = False

    def transfer(self, expected: Optional[Sequence[int]] = None) -> tuple[int, int]:
        """``(table, n_transferable)``. With ``expected`` (the byte length of each key's target),
        every transferable value is checked against its target before anything is copied:
        `LayoutMismatchError` names the first that differs (the plan is still ended by `end`)."""
        table, n = self._store._client.get_transfer(self.plan)
        self.transferred = True
        self._store._count(gets_transferred=1)
        if expected is not None and n:
            self._check_lengths(list(expected)[:n])
        return table, n

    def _check_lengths(self, expected: list[int]) -> None:
        client, keys = self._store._client, self.plan.keys
        if callable(getattr(client, "value_lengths", None)):  # PlanValueLengths (a Protocol isinstance costs ~0.3 ms)
            lengths = list(client.value_lengths(self.plan))
        else:  # the store's own records of what it wrote (latents; KV sizes are on the blob)
            lengths = [self._store._latent_nbytes.get(k, want) for k, want in zip(keys, expected)]
        for key, have, want in zip(keys, lengths, expected):
            if have != want:
                raise LayoutMismatchError(
                    f"value {key} holds {have} B but its restore target takes {want} B: the stored "
                    f"layout differs from the runtime's (nothing was copied)"
                )

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.transferred:
            self._store._client.release_views(self.plan)
        else:
            self._store._client.cancel_get_transfer(self.plan)
            self._store._count(gets_cancelled=1)


def _direction(src_on_device: bool, dst_on_device: bool) -> Direction:
    return {(False, True): Direction.H2D, (True, False): Direction.D2H,
            (True, True): Direction.D2D, (False, False): Direction.H2H}[(src_on_device, dst_on_device)]


_ASYNC_CALLS = tuple(n for n in AsyncTransfer.__dict__ if not n.startswith("_"))


def _offers_async(transfer: Any) -> bool:
    """The `AsyncTransfer` capability, checked by attribute (Python 3.12's Protocol isinstance
    ignores ``__getattr__``, so a delegating proxy would lose the capability)."""
    return all(callable(getattr(transfer, name, None)) for name in _ASYNC_CALLS)


def _settle(pending: Optional[PendingBatch], error: Optional[BaseException] = None) -> None:
    """Wait for a batch on a failure path; its own failure becomes a note on ``error``."""
    if pending is None:
        return
    try:
        pending.wait()
    except Exception as wait_error:  # noqa: BLE001
        if error is not None:
            add_note(error, f"waiting for a submitted batch failed too: {wait_error!r}")


def _as_store_error(exc: Exception, what: str) -> Exception:
    """``exc`` when it already is a `StoreError`; else a `PlanError` naming the cause (a transfer,
    table or layout error, or a payload that is not a tensor pair)."""
    if isinstance(exc, StoreError):
        return exc
    return PlanError(f"{what} failed: {type(exc).__name__}: {exc}")
