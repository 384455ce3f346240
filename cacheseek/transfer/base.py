"""The transfer seam: immutable copy descriptors, host mappings, and the `TransferRuntime` Protocol.

A transfer runtime moves bytes between two kinds of memory:

- *host mappings*: ranges of host memory (a Plan store's segments) registered once with
  `register`, deduplicated by ``(ptr, length, generation)``; a read-only mapping can only be a
  copy source;
- *device ranges*: the memory of the runtime's tensors (CUDA tensors for the CUDA runtime, CPU
  tensors for the host runtime), declared per batch with ``device_ranges`` (build them with
  `TransferRuntime.device_range`).

``Direction`` states where each side lives: ``H2D`` reads a host mapping and writes a device
range, ``D2H`` the reverse, ``H2H`` copies between host mappings. The same contract holds for
every runtime, whatever the physical memory behind a "device" range.

Batch lifecycle (`TransferRuntime.copy_batch`)::

    validate every descriptor (positive size, each range inside a registered mapping or a declared
    device range, direction consistent, destinations disjoint)   -> TransferError, nothing submitted
    submit every copy on the stream (one batched call where offered, else one call per copy)
    synchronize the stream once                                   -> returns: every byte has landed
    a submission failed after earlier ones went out: synchronize, then raise TransferError

So when ``copy_batch`` returns or raises, no copy of that batch is still in flight: the caller may
commit, abort or release the memory behind it.

Registration lifecycle: ``register(m)`` -> registered (idempotent for the same
``(ptr, length, generation)``; "already registered" by someone else is success) ->
``unregister(m)`` or ``close()``. Unregister a mapping before the memory behind it is unmapped.
"""

from __future__ import annotations

import abc
import bisect
import enum
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import attrs

from cacheseek.errors import TransferError

__all__ = [
    "Direction",
    "CopyDescriptor",
    "HostMapping",
    "MemoryRange",
    "DirectionStats",
    "TransferStats",
    "TransferRuntime",
    "TransferRuntimeBase",
    "SubmitFailed",
    "Registration",
]


class Direction(str, enum.Enum):
    """Where a copy's source and destination live: H(ost mapping) or D(evice range)."""

    H2D = "h2d"
    D2H = "d2h"
    H2H = "h2h"

    @property
    def src_on_device(self) -> bool:
        return self is Direction.D2H

    @property
    def dst_on_device(self) -> bool:
        return self is Direction.H2D


def _positive_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _non_negative_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(slots=True)
class CopyDescriptor:
    """Copy ``nbytes`` bytes from address ``src`` to address ``dst``; both ranges are raw
    addresses in this process (device addresses for device ranges)."""

    dst: int = attrs.field(validator=_positive_int)
    src: int = attrs.field(validator=_positive_int)
    nbytes: int = attrs.field(validator=_positive_int)
    direction: Direction = attrs.field(converter=Direction)

    @property
    def dst_end(self) -> int:
        return self.dst + self.nbytes

    @property
    def src_end(self) -> int:
        return self.src + self.nbytes


@attrs.frozen(slots=True)
class MemoryRange:
    """``length`` bytes at address ``ptr``."""

    ptr: int = attrs.field(validator=_positive_int)
    length: int = attrs.field(validator=_positive_int)

    @property
    def end(self) -> int:
        return self.ptr + self.length

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.end


@attrs.frozen(slots=True)
class HostMapping:
    """A host memory range a Plan store owns: ``length`` bytes at ``ptr``. ``generation`` changes
    when the store recreates the segment (a new registration even at the same address);
    ``writable`` is False for a read-only mapping (a copy source only)."""

    ptr: int = attrs.field(validator=_positive_int)
    length: int = attrs.field(validator=_positive_int)
    generation: int = attrs.field(validator=_non_negative_int)
    writable: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @property
    def key(self) -> tuple[int, int, int]:
        """The deduplication key of a registration."""
        return (self.ptr, self.length, self.generation)

    @property
    def range(self) -> MemoryRange:
        return MemoryRange(self.ptr, self.length)


@attrs.frozen(slots=True)
class DirectionStats:
    """Totals for one direction: bytes copied, wall seconds of the batches, copies submitted."""

    bytes: int = 0
    seconds: float = 0.0
    copies: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


@attrs.frozen(slots=True)
class TransferStats:
    """A snapshot of a runtime's counters. A mixed batch's seconds are split by bytes."""

    h2d: DirectionStats = DirectionStats()
    d2h: DirectionStats = DirectionStats()
    h2h: DirectionStats = DirectionStats()
    batches: int = 0
    n_registered: int = 0
    registered_bytes: int = 0
    register_seconds: float = 0.0

    def direction(self, direction: Direction) -> DirectionStats:
        return getattr(self, direction.value)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for d in Direction:
            s = self.direction(d)
            out[f"{d.value}_bytes"] = s.bytes
            out[f"{d.value}_seconds"] = s.seconds
            out[f"{d.value}_copies"] = s.copies
        out.update(
            batches=self.batches,
            n_registered=self.n_registered,
            registered_bytes=self.registered_bytes,
            register_seconds=self.register_seconds,
        )
        return out


@runtime_checkable
class TransferRuntime(Protocol):
    """Moves bytes between registered host mappings and device ranges, in validated batches.

    ``device_kind`` is ``"cpu"`` or ``"cuda"``: the kind of tensors whose memory the runtime
    treats as device ranges (see `device_range`).
    """

    device_kind: str

    def register(self, mappings: Sequence[HostMapping]) -> None:
        """Register each mapping once (dedup by ``(ptr, length, generation)``); a read-only
        mapping falls back to a read-only registration; already registered is success. Raises
        `RegistrationError` naming the mapping that failed; mappings before it stay registered."""
        ...

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        """Drop registrations made by `register` (unknown mappings are ignored)."""
        ...

    def device_range(self, tensor: Any) -> MemoryRange:
        """The bytes of a contiguous tensor of this runtime's device kind, to declare in a batch's
        ``device_ranges``. Raises `TransferError` for a tensor of another device or layout."""
        ...

    def copy_batch(
        self,
        descriptors: Sequence[CopyDescriptor],
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
    ) -> None:
        """Validate the whole batch, submit it on ``stream`` (None: the caller's current stream),
        synchronize once. Raises `TransferError`; on return or raise nothing is in flight."""
        ...

    @property
    def stats(self) -> TransferStats: ...

    def close(self) -> None:
        """Unregister everything this runtime registered. Idempotent."""
        ...


def coerce_stream(stream: Optional[Any]) -> Optional[int]:
    """A raw stream handle from None, an int, or an object with ``cuda_stream`` (a torch stream)."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    raise TypeError(
        f"stream must be None, an int handle or a torch stream, got {type(stream).__name__}"
    )


class SubmitFailed(Exception):
    """Raised by a runtime's ``_submit`` when a submission call fails. ``submitted`` is how many
    copies may already be in flight (-1 when unknown); ``cause`` is the error to report."""

    def __init__(self, submitted: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.submitted = submitted
        self.cause = cause


@attrs.frozen(slots=True)
class Registration:
    mapping: HostMapping
    owned: bool  # False: someone else had registered it ("already registered"); never unregistered
    read_only: bool


class TransferRuntimeBase(abc.ABC):
    """The batch contract shared by every runtime: registration bookkeeping, whole-batch
    validation, synchronize-on-failure and stats. Subclasses move the bytes:

    - ``_register_one(mapping) -> (owned, read_only)`` and ``_unregister_one(registration)``;
    - ``_submit(descriptors, stream)`` submits every copy, raising `SubmitFailed`;
    - ``_synchronize(stream)`` waits for the stream, raising `TransferError`;
    - ``_resolve_stream(stream)`` and ``_is_device_memory(ptr, nbytes)`` (undeclared ranges).
    """

    device_kind: str = "cpu"
    tensor_device_type: str = "cpu"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registrations: dict[tuple[int, int, int], Registration] = {}
        self._host_index: list[tuple[int, Registration]] = []  # sorted by ptr
        self._dir_stats = {d: DirectionStats() for d in Direction}
        self._batches = 0
        self._register_seconds = 0.0
        self._closed = False

    # -- subclass hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _register_one(self, mapping: HostMapping) -> tuple[bool, bool]: ...

    @abc.abstractmethod
    def _unregister_one(self, registration: Registration) -> None: ...

    @abc.abstractmethod
    def _submit(self, descriptors: Sequence[CopyDescriptor], stream: Any) -> None: ...

    @abc.abstractmethod
    def _synchronize(self, stream: Any) -> None: ...

    def _resolve_stream(self, stream: Any) -> Any:
        return stream

    def _is_device_memory(self, ptr: int, nbytes: int) -> bool:
        return False

    # -- registration ---------------------------------------------------------------------------
    def register(self, mappings: Sequence[HostMapping]) -> None:
        self._check_open()
        for mapping in mappings:
            if not isinstance(mapping, HostMapping):
                raise TypeError(f"register takes HostMapping values, got {type(mapping).__name__}")
            with self._lock:
                if mapping.key in self._registrations:
                    continue
            t0 = time.perf_counter()
            owned, read_only = self._register_one(mapping)
            reg = Registration(mapping, owned, read_only)
            with self._lock:
                self._register_seconds += time.perf_counter() - t0
                self._registrations[mapping.key] = reg
                self._rebuild_index()

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        errors: list[BaseException] = []
        for mapping in mappings:
            with self._lock:
                reg = self._registrations.pop(mapping.key, None)
                self._rebuild_index()
            if reg is not None and reg.owned:
                try:
                    self._unregister_one(reg)
                except TransferError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def registered(self) -> list[HostMapping]:
        """The mappings registered now, in address order."""
        with self._lock:
            return [reg.mapping for _, reg in self._host_index]

    def _rebuild_index(self) -> None:
        self._host_index = sorted(
            ((r.mapping.ptr, r) for r in self._registrations.values()), key=lambda e: e[0]
        )

    # -- device ranges --------------------------------------------------------------------------
    def device_range(self, tensor: Any) -> MemoryRange:
        device = getattr(getattr(tensor, "device", None), "type", None)
        if device != self.tensor_device_type:
            raise TransferError(
                f"{type(self).__name__} copies {self.tensor_device_type} tensors, got a tensor on "
                f"{device!r} (choose the transfer runtime from the runtime's device)"
            )
        if not tensor.is_contiguous():
            raise TransferError("device tensors must be contiguous (got a strided view)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= 0:
            raise TransferError("device tensor is empty")
        return MemoryRange(int(tensor.data_ptr()), nbytes)

    # -- copies ---------------------------------------------------------------------------------
    def copy_batch(
        self,
        descriptors: Sequence[CopyDescriptor],
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
    ) -> None:
        self._check_open()
        descriptors = list(descriptors)
        if not descriptors:
            return
        self._validate(descriptors, device_ranges)
        handle = self._resolve_stream(stream)
        t0 = time.perf_counter()
        try:
            self._submit(descriptors, handle)
        except SubmitFailed as failed:
            if failed.submitted != 0:
                try:
                    self._synchronize(handle)
                except TransferError as sync_error:
                    add_note(failed.cause, f"and the synchronize after it failed too: {sync_error}")
            if isinstance(failed.cause, TransferError):
                raise failed.cause
            raise TransferError(f"copy submission failed: {failed.cause}") from failed.cause
        self._synchronize(handle)
        self._record(descriptors, time.perf_counter() - t0)

    def _validate(
        self, descriptors: list[CopyDescriptor], device_ranges: Sequence[MemoryRange]
    ) -> None:
        with self._lock:
            host_index = list(self._host_index)
        host_starts = [ptr for ptr, _ in host_index]
        devs = sorted(((r.ptr, r) for r in device_ranges), key=lambda e: e[0])
        dev_starts = [ptr for ptr, _ in devs]
        for i, d in enumerate(descriptors):
            if not isinstance(d, CopyDescriptor):
                raise TransferError(f"descriptor {i} is a {type(d).__name__}, not a CopyDescriptor")
            for side, ptr, on_device, write in (
                ("src", d.src, d.direction.src_on_device, False),
                ("dst", d.dst, d.direction.dst_on_device, True),
            ):
                if on_device:
                    ok = _find(devs, dev_starts, ptr, d.nbytes) is not None or self._is_device_memory(
                        ptr, d.nbytes
                    )
                    where = "a declared device range"
                else:
                    reg = _find(host_index, host_starts, ptr, d.nbytes, key=lambda r: r.mapping.range)
                    ok = reg is not None and (not write or reg.mapping.writable)
                    where = ("a writable " if write else "a ") + "registered host mapping"
                if not ok:
                    raise TransferError(
                        f"descriptor {i} ({d.direction.value}): {side} [{ptr:#x}, +{d.nbytes}) is not "
                        f"inside {where}; nothing of the batch was submitted"
                    )
        ordered = sorted(descriptors, key=lambda d: d.dst)
        for prev, cur in zip(ordered, ordered[1:]):
            if cur.dst < prev.dst_end:
                raise TransferError(
                    f"descriptors overlap at destination {cur.dst:#x}; "
                    "nothing of the batch was submitted"
                )

    def _record(self, descriptors: list[CopyDescriptor], seconds: float) -> None:
        per_dir: dict[Direction, list[int]] = {}
        for d in descriptors:
            acc = per_dir.setdefault(d.direction, [0, 0])
            acc[0] += d.nbytes
            acc[1] += 1
        total = sum(b for b, _ in per_dir.values())
        with self._lock:
            self._batches += 1
            for direction, (nbytes, copies) in per_dir.items():
                s = self._dir_stats[direction]
                self._dir_stats[direction] = DirectionStats(
                    s.bytes + nbytes, s.seconds + seconds * nbytes / total, s.copies + copies
                )

    @property
    def stats(self) -> TransferStats:
        with self._lock:
            regs = list(self._registrations.values())
            return TransferStats(
                h2d=self._dir_stats[Direction.H2D],
                d2h=self._dir_stats[Direction.D2H],
                h2h=self._dir_stats[Direction.H2H],
                batches=self._batches,
                n_registered=len(regs),
                registered_bytes=sum(r.mapping.length for r in regs),
                register_seconds=self._register_seconds,
            )

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{type(self).__name__} used after close()")

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            mappings = [r.mapping for r in self._registrations.values()]
        self.unregister(mappings)
        self._closed = True


def _find(index: list, starts: list[int], ptr: int, nbytes: int, key=None):
    """The entry of a ptr-sorted index whose range holds ``[ptr, ptr + nbytes)``, or None."""
    i = bisect.bisect_right(starts, ptr) - 1
    while i >= 0:
        entry = index[i][1]
        rng = key(entry) if key is not None else entry
        if rng.contains(ptr, nbytes):
            return entry
        i -= 1
    return None


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` where Python offers it (3.11+)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
