"""The Plan tier's hold on its client and its segments: the client built from its registry name
(`ClientOptions`, `build_client`) with its optional calls (`ClientCalls`) and chunk records
(`client_records`) resolved once; `TransferLink`, the client's segments registered with the
transfer runtime, made once when the store is built and kept until it closes; what the read and
write paths get from it (`ValueMemory`, `Attached`) and the one way they copy (`copy_now`).

Warm-up (construction, never a request's first write): the Plan client's segments are made ready
(an embedded client maps and pre-faults its segment here: 2 MiB pages where allowed, else libc
``madvise(MADV_POPULATE_WRITE)`` from several threads), each host mapping is registered with the
transfer runtime once, ``overlap`` is resolved, the runtime's write and read streams are made and, with overlap,
``on_attach(like)`` runs (the store allocates its staging slots there). Every stage is timed into
the counters (ready, register per mapping, total). Without a runtime or a ``device``, the runtime
is chosen from the device of the first tensors seen (`transfer_for`) and that first request pays
the registration.

In pieces (``piece_bytes`` > 0, a runtime with ``register_in_pieces``): each mapping is registered
as consecutive pieces of at most ``piece_bytes``, one driver call each, so no call holds the
driver's and the mmap locks for long (one ``cudaHostRegister`` of 24 GiB holds them for about
0.4 s, and the runtime's own ``cudaMalloc`` calls wait behind it). With a client that offers
`PlanSegmentPieces` the loop interleaves: fault a piece, register it, pause ``piece_pause_s``
(a background warm-up: the request's allocations get the locks), the next piece; so registration
starts at once instead of after the whole fault. Before each piece ``yield_to`` (a background
warm-up's `SessionStarts.wait_clear`) holds the loop while a session is starting, so the new
runtime's allocations never queue behind a registration (``warmup_yields``,
``warmup_yield_seconds``; not part of ``register_seconds``). A registration in one call, or a
fault by ``wait_local_segments_ready``, has no such point. Copies that span two pieces are cut by the
transfer runtime (`cacheseek.transfer.joints`).

Lifecycle::

    TransferLink(...)      nothing touched yet
    warm_up(device)        segments ready and timed (``values``: a `ValueMemory`); attached
                           when a runtime or device is known
    attached_for(tensor)   `Attached`: the runtime, its streams and the values, attached now if
                           it was not (once, under a lock)
    close()                streams destroyed, exactly the mappings registered here unregistered
                           (a shared runtime keeps what another user holds), a runtime built
                           here closed

Streams: writes go on the write stream, reads on the read stream (both the runtime's own,
non-blocking on CUDA, so ``cudaMemcpyBatchAsync`` takes them and compute on the legacy stream is
not serialized with them). A runtime without the `AsyncTransfer` capability has no streams:
both are None and copies are synchronous on the caller's stream.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import attrs
import torch

from cacheseek.errors import ConfigError
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.plan.base import PlanClient, SegmentMapping
from cacheseek.registry import PLAN_CLIENTS, TRANSFERS
from cacheseek.sizes import AUTO, available_memory, free_bytes
from cacheseek.sizing import UNFITTED, SizeField
from cacheseek.stores.plan_tier.stats import Counters
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.protocol import AsyncTransfer, TransferRuntime

__all__ = ["Attached", "ClientCalls", "ClientOptions", "TransferLink", "ValueMemory", "build_client",
           "client_fields", "client_records", "client_size_fields", "copy_now", "direction", "given_options", "nbytes", "offered",
           "offers_async"]

log = logging.getLogger(__package__)

_ASYNC_CALLS = tuple(n for n in AsyncTransfer.__dict__ if not n.startswith("_"))


# -- the client ---------------------------------------------------------------------------------


def client_fields(name: str) -> set[str]:
    """The option names the client ``name``'s schema takes."""
    return {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(name)) if f.name != "_target_"}


def _options_schema() -> type:
    """Every Plan client's options in one dataclass (``store.client_options.*``), so that Hydra
    checks their types whichever client is chosen: a field per option of any client, typed as
    that client's schema types it (``Any`` where two disagree), None where the client's own
    default holds."""
    types: dict[str, Any] = {}
    for name in PLAN_CLIENTS.names():
        for f in dataclasses.fields(PLAN_CLIENTS.schema(name)):
            if f.name != "_target_":
                types[f.name] = f.type if types.get(f.name, f.type) == f.type else Any
    return dataclasses.make_dataclass("ClientOptions", [
        (name, Any if typ is Any else Optional[typ], dataclasses.field(default=None))
        for name, typ in sorted(types.items())])


ClientOptions = _options_schema()
ClientOptions.__module__ = __name__


def given_options(options: Union[ClientOptions, dict[str, Any], None]) -> dict[str, Any]:
    """The options given (not None) in a `ClientOptions` or a plain dict of them."""
    items = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})
    return {k: v for k, v in items.items() if v is not None}


def build_client(name: str, given: dict[str, Any], options: Union[ClientOptions, dict[str, Any], None], *,
                 geometry_bytes: Optional[tuple[int, int]] = None) -> PlanClient:
    """The `PLAN_CLIENTS` entry ``name``, built with those of ``given`` that its schema takes,
    then every option given (the store's ``client_options``). A ``segment_bytes`` of ``"auto"``
    left unfitted (a store built directly: no workload to fit it to) is `UNFITTED`'s;
    ``geometry_bytes`` (largest value, one chunk's KV) lets clients size their staging."""
    segment_bytes = given.get("segment_bytes")
    if isinstance(segment_bytes, str) and segment_bytes.strip().lower() == AUTO:
        given = {**given, "segment_bytes": UNFITTED["segment"]}
    if geometry_bytes is not None:
        given = {**given, "value_bytes": geometry_bytes[0], "chunk_bytes": geometry_bytes[1]}
    accepted = client_fields(name)
    kwargs = {k: v for k, v in given.items() if k in accepted}
    kwargs.update(given_options(options))
    for key in sorted(set(kwargs) - accepted):
        raise ConfigError(f"store.client_options.{key}", f"the {name!r} Plan client has no option {key!r}",
                          f"use one of: {', '.join(sorted(accepted))}")
    return PLAN_CLIENTS.get(name)(**kwargs)


def client_size_fields(config: dict[str, Any]) -> list[SizeField]:
    """The store's `SizedStore` fields: the embedded client's ``segment_bytes``, or the host
    staging (``client_options.staging_bytes``) of a client that stages writes, against free
    memory (or the free space of ``shm_dir`` for a shared-memory backing, when less)."""
    options = given_options(config.get("client_options"))
    accepted = client_fields(config.get("client", "embedded"))
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


def client_records(client: Any) -> ChunkRecords:
    """The chunk records ``client`` offers (`PlanSharedRecords`: a Fluxon cluster's), or
    `NO_RECORDS` (an embedded client lives in one process). Read by attribute, like `ClientCalls`,
    so proxies that delegate through ``__getattr__`` keep them."""
    records = getattr(client, "records", None)
    return records if isinstance(records, ChunkRecords) else NO_RECORDS


def offered(client: Any, call: str) -> Optional[Callable[..., Any]]:
    """The client's optional call ``call``, or None when it does not offer it."""
    fn = getattr(client, call, None)
    return fn if callable(fn) else None


@attrs.frozen
class ClientCalls:
    """The optional calls of one Plan client (`PlanClientInfo`, `PlanSegmentPieces`,
    `PlanValueLengths`, ``max_plan_values``), each None where the client does not offer it. Probed by attribute, so
    that proxies delegating through ``__getattr__`` keep them (a Protocol ``isinstance`` would
    miss them)."""

    table_arena: Optional[Callable[[], Optional[tuple[int, int]]]] = None
    usage: Optional[Callable[[], Any]] = None
    segment_timers: Optional[Callable[[], Any]] = None
    max_plan_values: Optional[Callable[[int], int]] = None
    map_local_segments: Optional[Callable[[], list]] = None
    fault_local_range: Optional[Callable[[int, int], None]] = None
    value_lengths: Optional[Callable[[Any], Sequence[int]]] = None

    @classmethod
    def of(cls, client: Any) -> "ClientCalls":
        return cls(**{f.name: offered(client, f.name) for f in attrs.fields(cls)})

    def arena(self) -> Optional[tuple[int, int]]:
        """Where the client's plan tables live now (checked by `decode_plan_table`), when it says."""
        return self.table_arena() if self.table_arena is not None else None


# -- what the paths get from the link -----------------------------------------------------------


def nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def direction(src_on_device: bool, dst_on_device: bool) -> Direction:
    return {(False, True): Direction.H2D, (True, False): Direction.D2H,
            (True, True): Direction.D2D, (False, False): Direction.H2H}[(src_on_device, dst_on_device)]


def copy_now(transfer: Any, batch: CopyBatch, ranges: list[MemoryRange], *, producer: Any, on: Optional[Any]) -> None:
    """One batch on stream ``on`` after the ``producer`` stream's work, waited for (on a runtime
    without streams, ``on`` is None: synchronous on the producer stream)."""
    if on is None:
        transfer.copy_batch(batch.descriptors(), stream=producer, device_ranges=ranges)
        return
    event = transfer.record_event(producer)
    try:
        transfer.copy_batch(batch, stream=on, device_ranges=ranges, after=[event])
    finally:
        transfer.release_event(event)


@attrs.frozen(slots=True)
class ValueMemory:
    """Where the client's values live, known once its segments are ready: ``ranges``, its
    device pool (the HBM tier's), else ``mappings``, its host mappings."""

    ranges: tuple[MemoryRange, ...] = ()
    mappings: tuple[HostMapping, ...] = ()

    @property
    def on_device(self) -> bool:
        """Copies in and out of device values are D2D; the pool is a declared device range."""
        return bool(self.ranges)

    @property
    def device_ranges(self) -> list[MemoryRange]:
        """What a batch touching the values declares besides its own tensors."""
        return list(self.ranges)

    @property
    def spans(self) -> list[MemoryRange]:
        return list(self.ranges) or [m.range for m in self.mappings]

    @property
    def to_values(self) -> Direction:  # tensors -> values
        return Direction.D2D if self.ranges else Direction.D2H

    @property
    def from_values(self) -> Direction:  # values -> tensors
        return Direction.D2D if self.ranges else Direction.H2D


@attrs.frozen(slots=True)
class Attached:
    """The link once attached: ``transfer``, its ``write_stream`` and ``read_stream`` (None on a
    runtime without streams), its ``fast_on`` (None when it has none), ``overlap`` and the
    ``values``: everything the read and write paths copy with."""

    transfer: Any
    values: ValueMemory
    overlap: bool = False
    write_stream: Any = None
    read_stream: Any = None
    fast_on: Optional[Callable[[Any], bool]] = None


def offers_async(transfer: Any) -> bool:
    """The `AsyncTransfer` capability, checked by attribute (Python 3.12's Protocol isinstance
    ignores ``__getattr__``, so a delegating proxy would lose the capability)."""
    return all(callable(getattr(transfer, name, None)) for name in _ASYNC_CALLS)


# -- the link -----------------------------------------------------------------------------------


class TransferLink:
    """``client``'s segments registered with ``transfer`` (a runtime the caller keeps owning), or
    with a ``transfer_kind`` runtime built here for ``device``; see the module docstring.
    ``overlap``: None = on for a CUDA runtime with streams, off otherwise."""

    def __init__(self, client: PlanClient, transfer: Optional[TransferRuntime], *, transfer_kind: str,
                 device: Optional[str], overlap: Optional[bool], counters: Counters, on_attach: Callable[[Any], None],
                 piece_bytes: int = 0, piece_pause_s: float = 0.0,
                 yield_to: Optional[Callable[[], float]] = None) -> None:
        self.client = client
        self.calls = ClientCalls.of(client)
        self.piece_bytes = piece_bytes
        self.piece_pause_s = piece_pause_s
        self._yield_to = yield_to  # blocks while sessions start; seconds waited
        self._fault_range: Optional[Callable[[int, int], None]] = None  # set while faulting piece by piece
        self.transfer_kind = transfer_kind
        self._transfer = transfer
        self._owns_transfer = False
        self._device = device
        self._overlap_option = overlap
        self._counters = counters
        self._on_attach = on_attach
        self._setup_lock = threading.Lock()
        self._registered_here: list[HostMapping] = []
        self.values = ValueMemory()
        self.attached: Optional[Attached] = None

    @property
    def transfer(self) -> Optional[TransferRuntime]:
        return self._transfer

    @property
    def overlap(self) -> bool:
        """Whether writes return before their copies land (resolved once a runtime is known)."""
        return self.attached is not None and self.attached.overlap

    # -- warm-up --------------------------------------------------------------------------------
    def warm_up(self, device: Optional[str]) -> None:
        """Segments ready, registered (faulted piece by piece where the client and the runtime
        allow: module docstring), streams made, staging allocated; every stage timed."""
        self._yield_now()  # a session starting (the first one, normally) goes first
        t0 = time.perf_counter()
        if self._transfer is None and device is not None:
            self._transfer = self._build_transfer(device)
        map_only, fault_range = self.calls.map_local_segments, self.calls.fault_local_range
        in_pieces = map_only is not None and fault_range is not None and self._in_pieces()
        if in_pieces:
            self._fault_range = fault_range  # faulted in _register, a piece before its registration
        self._set_segments(map_only() if in_pieces else self.client.wait_local_segments_ready())
        self._counters.count(segment_ready_seconds=time.perf_counter() - t0)
        try:
            if self._transfer is not None:
                self._attach(None)
        finally:
            self._fault_range = None
        if map_only is not None and fault_range is not None:
            self.client.wait_local_segments_ready()  # faults what no piece did (nothing, normally)
        self._counters.count(warmup_seconds=time.perf_counter() - t0)
        timers_fn = self.calls.segment_timers
        timers = timers_fn() if timers_fn is not None else None
        mappings = self.values.mappings
        log.info(
            "Plan tier warm-up: %d mapping(s), %.1f GiB, ready in %.3f s (fault %.3f s %s, "
            "register %.3f s), overlap %s",
            len(mappings), sum(m.length for m in mappings) / 2**30,
            self._counters.get("warmup_seconds", 0.0), timers.fault_seconds if timers else 0.0,
            timers.fault_method if timers else "?", self._counters.get("register_seconds", 0.0),
            self.overlap,
        )

    def _yield_now(self) -> None:
        """Wait while a session is starting (a background warm-up's ``yield_to``), counted."""
        if self._yield_to is not None:
            waited = self._yield_to()
            if waited > 0:
                self._counters.count(warmup_yields=1, warmup_yield_seconds=waited)

    def _set_segments(self, segments: list[SegmentMapping]) -> None:
        self.values = ValueMemory(
            tuple(MemoryRange(s.ptr, s.length) for s in segments if getattr(s, "on_device", False)),
            tuple(HostMapping(s.ptr, s.length, s.generation, s.writable)
                  for s in segments if not getattr(s, "on_device", False)))

    def _in_pieces(self) -> bool:
        """Whether mappings are registered in pieces: a size is set and the runtime offers it."""
        return bool(self.piece_bytes) and callable(getattr(self._transfer, "register_in_pieces", None))

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

    def _attach(self, like: Any) -> None:
        """Register the segments with the runtime, resolve ``overlap``, make the streams, then
        (with overlap) ``on_attach(like)``."""
        transfer = self._transfer
        assert transfer is not None
        self._register()
        can_async = offers_async(transfer)
        wanted = self._overlap_option
        if wanted is None:
            wanted = can_async and getattr(transfer, "device_kind", "cpu") == "cuda"
        if wanted and not can_async:
            raise ConfigError("store.overlap", f"{type(transfer).__name__} offers no streams and events",
                              "set store.overlap=false or use a transfer runtime with the AsyncTransfer capability")
        self._counters.note(overlap=bool(wanted))
        streams = (transfer.new_stream(), transfer.new_stream()) if can_async else (None, None)  # type: ignore[attr-defined]
        self.attached = Attached(transfer, self.values, bool(wanted), *streams,
                                 fast_on=getattr(transfer, "fast_on", None))
        if self.attached.overlap:
            self._on_attach(like)

    def _register(self) -> None:
        transfer = self._transfer
        if transfer is None:
            return
        entries = []
        faulting = [0.0]  # seconds spent faulting pieces inside the registration loop
        fault_range = self._fault_range

        def before_piece(piece: HostMapping) -> None:
            self._yield_now()  # a session starting: its allocations go first
            if fault_range is not None:
                t = time.perf_counter()
                fault_range(piece.ptr, piece.length)
                faulting[0] += time.perf_counter() - t

        def pause(_piece: HostMapping) -> None:
            time.sleep(self.piece_pause_s)  # sleeps without the GIL: the request thread's allocations go first

        # registrations are reference-counted by the runtime: this link unregisters exactly what
        # it registered at close, and a shared runtime keeps what another user still holds
        for m in self.values.mappings:
            t0, faulted_before = time.perf_counter(), faulting[0]
            yielded_before = self._counters.get("warmup_yield_seconds", 0.0)
            if self._in_pieces():
                transfer.register_in_pieces(  # type: ignore[attr-defined]
                    m, self.piece_bytes,
                    before_piece=before_piece if fault_range is not None or self._yield_to is not None else None,
                    after_piece=pause if self.piece_pause_s > 0 else None)
                pieces = len(transfer.registered_pieces(m))  # type: ignore[attr-defined]
            else:
                transfer.register([m])
                pieces = 1
            self._registered_here.append(m)
            fault_s = faulting[0] - faulted_before
            seconds = time.perf_counter() - t0 - fault_s
            seconds -= self._counters.get("warmup_yield_seconds", 0.0) - yielded_before
            self._counters.count(register_seconds=seconds, segment_ready_seconds=fault_s, register_pieces=pieces)
            entries.append(dict(ptr=m.ptr, length=m.length, generation=m.generation,
                                writable=m.writable, register_seconds=seconds, pieces=pieces))
        self._counters.note(mappings=tuple(entries))

    def attached_for(self, tensor: Any) -> Attached:
        """`Attached`; the runtime chosen from ``tensor``'s device and attached now if none was
        known."""
        if self.attached is not None:
            return self.attached
        with self._setup_lock:
            if self.attached is None:
                device = getattr(tensor, "device", "cpu")
                log.warning(
                    "Plan tier: transfer runtime chosen from the first tensors (%s); segments are "
                    "registered now, on a request's path. Pass device= (or transfer=) to do this "
                    "at warm-up.", device,
                )
                self._transfer = self._build_transfer(device)
                self._attach(tensor)
            assert self.attached is not None
            return self.attached

    def staging_tensor(self, nbytes: int, like: Any) -> Any:
        """A uint8 tensor of ``nbytes`` on ``like``'s device, else on the runtime's device."""
        device = getattr(like, "device", None)
        if device is None:
            kind = getattr(self._transfer, "tensor_device_type", "cpu")
            if kind == "cuda":
                device = torch.device(self._device) if self._device and ":" in str(self._device) else torch.device(
                    "cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the streams, unregister what was registered here, close a runtime built here."""
        transfer: Any = self._transfer
        if transfer is None:
            return
        try:
            attached = self.attached
            for stream in (attached.write_stream, attached.read_stream) if attached is not None else ():
                if stream is not None:
                    try:
                        transfer.destroy_stream(stream)
                    except Exception as exc:  # noqa: BLE001 - teardown goes on
                        log.warning("Plan tier: destroying a stream failed: %s", exc)
            if attached is not None:
                self.attached = attrs.evolve(attached, write_stream=None, read_stream=None)
            transfer.unregister(self._registered_here)
        finally:
            if self._owns_transfer:
                transfer.close()

    def __repr__(self) -> str:
        return f"TransferLink(transfer={self._transfer!r}, overlap={self.overlap})"
