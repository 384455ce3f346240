"""Warm-up and registration: `TransferLink`, the Plan tier's hold on its client's segments and on
its transfer runtime, made once when the store is built and kept until it closes.

Warm-up (construction, never a request's first write): the Plan client's segments are made ready
(an embedded client maps and pre-faults its segment here: 2 MiB pages where allowed, else libc
``madvise(MADV_POPULATE_WRITE)`` from several threads), each host mapping is registered with the
transfer runtime once, ``overlap`` is resolved, the runtime's write and read streams are made and
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
    warm_up(device)        segments ready and timed; attached when a runtime or device is known
    transfer_for(tensor)   the runtime, attached now if it was not (once, under a lock)
    close()                streams destroyed, exactly the mappings registered here unregistered
                           (a shared runtime keeps what another user holds), a runtime built
                           here closed

Streams: writes go on the write stream, reads on the read stream (both the runtime's own,
non-blocking on CUDA, so ``cudaMemcpyBatchAsync`` takes them and compute on the legacy stream is
not serialized with them). A runtime without the `AsyncTransfer` capability has no streams:
both are None and copies are synchronous on the caller's stream.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from cacheseek.errors import ConfigError
from cacheseek.plan.base import PlanClient, SegmentMapping
from cacheseek.registry import TRANSFERS
from cacheseek.stores.plan_tier.client import ClientCalls
from cacheseek.stores.plan_tier.stats import Counters
from cacheseek.transfer.batch import Direction
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.protocol import AsyncTransfer, TransferRuntime

__all__ = ["TransferLink", "offers_async"]

log = logging.getLogger(__package__)

_ASYNC_CALLS = tuple(n for n in AsyncTransfer.__dict__ if not n.startswith("_"))


def offers_async(transfer: Any) -> bool:
    """The `AsyncTransfer` capability, checked by attribute (Python 3.12's Protocol isinstance
    ignores ``__getattr__``, so a delegating proxy would lose the capability)."""
    return all(callable(getattr(transfer, name, None)) for name in _ASYNC_CALLS)


class TransferLink:
    """``client``'s segments registered with ``transfer`` (a runtime the caller keeps owning), or
    with a ``transfer_kind`` runtime built here for ``device``; see the module docstring.
    ``overlap``: None = on for a CUDA runtime with streams, off otherwise."""

    def __init__(
        self,
        client: PlanClient,
        transfer: Optional[TransferRuntime],
        *,
        transfer_kind: str,
        device: Optional[str],
        overlap: Optional[bool],
        counters: Counters,
        on_attach: Callable[[Any], None],
        piece_bytes: int = 0,
        piece_pause_s: float = 0.0,
        yield_to: Optional[Callable[[], float]] = None,
    ) -> None:
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
        self._overlap = False
        self._counters = counters
        self._on_attach = on_attach
        self._setup_lock = threading.Lock()
        self._mappings: list[HostMapping] = []
        self._registered_here: list[HostMapping] = []
        self.value_ranges: list[MemoryRange] = []  # segments on the device (the HBM tier's pool)
        self.write_stream: Any = None
        self.read_stream: Any = None
        self.fast_on: Optional[Callable[[Any], bool]] = None  # the runtime's, resolved at attach

    # -- what the roles read --------------------------------------------------------------------
    @property
    def transfer(self) -> Optional[TransferRuntime]:
        return self._transfer

    @property
    def overlap(self) -> bool:
        """Whether writes return before their copies land (resolved once a runtime is known)."""
        return self._overlap

    @property
    def value_spans(self) -> list[MemoryRange]:
        """Where the client's values live: its device pool, else its host mappings."""
        return self.value_ranges or [m.range for m in self._mappings]

    @property
    def values_on_device(self) -> bool:
        """Whether the client's values live in device memory (the HBM tier): copies in and out
        of them are D2D and the segment is a declared device range, not a registered mapping."""
        return bool(self.value_ranges)

    @property
    def to_values(self) -> Direction:  # tensors -> values
        return Direction.D2D if self.value_ranges else Direction.D2H

    @property
    def from_values(self) -> Direction:  # values -> tensors
        return Direction.D2D if self.value_ranges else Direction.H2D

    # -- warm-up --------------------------------------------------------------------------------
    def warm_up(self, device: Optional[str]) -> None:
        """Segments ready, registered (faulted piece by piece where the client and the runtime
        allow: module docstring), streams made, staging allocated; every stage timed."""
        self._yield_now()  # a session starting (the first one, normally) goes first
        t0 = time.perf_counter()
        if self._transfer is None and device is not None:
            self._transfer = self._build_transfer(device)
        map_only, fault_range = self.calls.map_local_segments, self.calls.fault_local_range
        if map_only is not None and fault_range is not None and self._in_pieces():
            self._fault_range = fault_range  # faulted in _register, a piece before its registration
            self._set_segments(map_only())
            self._counters.count(segment_ready_seconds=time.perf_counter() - t0)
        else:
            self._set_segments(self.client.wait_local_segments_ready())
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
        log.info(
            "Plan tier warm-up: %d mapping(s), %.1f GiB, ready in %.3f s (fault %.3f s %s, "
            "register %.3f s), overlap %s",
            len(self._mappings), sum(m.length for m in self._mappings) / 2**30,
            self._counters.get("warmup_seconds", 0.0), timers.fault_seconds if timers else 0.0,
            timers.fault_method if timers else "?", self._counters.get("register_seconds", 0.0),
            self._overlap,
        )

    def _yield_now(self) -> None:
        """Wait while a session is starting (a background warm-up's ``yield_to``), counted."""
        if self._yield_to is not None:
            waited = self._yield_to()
            if waited > 0:
                self._counters.count(warmup_yields=1, warmup_yield_seconds=waited)

    def _set_segments(self, segments: list[SegmentMapping]) -> None:
        self._mappings = [HostMapping(s.ptr, s.length, s.generation, s.writable)
                          for s in segments if not getattr(s, "on_device", False)]
        self.value_ranges = [MemoryRange(s.ptr, s.length) for s in segments if getattr(s, "on_device", False)]

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
        ``on_attach(like)``."""
        transfer = self._transfer
        assert transfer is not None
        self._register()
        can_async = offers_async(transfer)
        wanted = self._overlap_option
        if wanted is None:
            wanted = can_async and getattr(transfer, "device_kind", "cpu") == "cuda"
        if wanted and not can_async:
            raise ConfigError(
                "store.overlap", f"{type(transfer).__name__} offers no streams and events",
                "set store.overlap=false or use a transfer runtime with the AsyncTransfer capability",
            )
        self._overlap = bool(wanted)
        self.fast_on = getattr(transfer, "fast_on", None)
        self._counters.note(overlap=self._overlap)
        if can_async:
            self.write_stream = transfer.new_stream()  # type: ignore[attr-defined]
            self.read_stream = transfer.new_stream()  # type: ignore[attr-defined]
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
        for m in self._mappings:
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

    def transfer_for(self, tensor: Any) -> TransferRuntime:
        """The runtime; chosen from ``tensor``'s device and attached now if none was known."""
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
                self._attach(tensor)
            return self._transfer

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
            for stream in (self.write_stream, self.read_stream):
                if stream is not None:
                    try:
                        transfer.destroy_stream(stream)
                    except Exception as exc:  # noqa: BLE001 - teardown goes on
                        log.warning("Plan tier: destroying a stream failed: %s", exc)
            self.write_stream = self.read_stream = None
            transfer.unregister(self._registered_here)
        finally:
            if self._owns_transfer:
                transfer.close()

    def __repr__(self) -> str:
        return f"TransferLink(transfer={self._transfer!r}, overlap={self._overlap})"
