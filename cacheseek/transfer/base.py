"""The transfer seam: copy descriptors and batches, host mappings, streams and events, and the
`TransferRuntime` / `AsyncTransfer` Protocols.

A transfer runtime moves bytes between two kinds of memory:

- *host mappings*: ranges of host memory (a Plan store's segments) registered once with
  `register`, deduplicated by ``(ptr, length, generation)``; a read-only mapping can only be a
  copy source;
- *device ranges*: the memory of the runtime's tensors (CUDA tensors for the CUDA runtime, CPU
  tensors for the host runtime), declared per batch with ``device_ranges`` (build them with
  `TransferRuntime.device_range`).

``Direction`` states where each side lives: ``H2D`` reads a host mapping and writes a device
range, ``D2H`` the reverse, ``H2H`` copies between host mappings, ``D2D`` between device ranges
(a snapshot of the live ring into a staging buffer). The same contract holds for every runtime,
whatever the physical memory behind a "device" range.

A batch is a sequence of `CopyDescriptor` values or a `CopyBatch` (the same copies as numpy
arrays: built and validated without a Python object per copy, which matters for thousands of
small copies).

Synchronous batch lifecycle (`TransferRuntime.copy_batch`)::

    validate every copy (positive size, each range inside a registered mapping or a declared
    device range, direction consistent, destinations disjoint)   -> TransferError, nothing submitted
    submit every copy on the stream (one batched call where offered, else one call per copy)
    synchronize the stream once                                   -> returns: every byte has landed
    a submission failed after earlier ones went out: synchronize, then raise TransferError

So when ``copy_batch`` returns or raises, no copy of that batch is still in flight: the caller may
commit, abort or release the memory behind it.

Asynchronous batch lifecycle (capability `AsyncTransfer`, offered by `TransferRuntimeBase`)::

    new_stream()                          -> a stream of the runtime's own (CUDA: non-blocking, so
                                             it neither waits for nor blocks the legacy stream)
    record_event(stream)                  -> an `Event` marking everything submitted on it so far
    submit_batch(batch, stream=s, after=[events or pending batches])
        validates like copy_batch (TransferError, nothing submitted), makes ``s`` wait for every
        ``after`` event, submits, records a completion event -> `PendingBatch` (nothing waited)
        a submission failure synchronizes ``s`` before raising, so nothing of it is in flight
    stream_wait(stream, pending_or_event) -> later work on ``stream`` starts after it (no host wait)
    PendingBatch.done() / .wait()         -> query / block until every copy has landed; wait()
                                             records the stats and frees the event; idempotent
    release_event(event), destroy_stream(stream)

Registration lifecycle: reference-counted per ``(ptr, length, generation)``. ``register(m)``
registers on the first call and counts every call ("already registered" by someone outside this
runtime is success, and never undone); ``unregister(m)`` drops one count and unregisters on the
last (an unknown mapping is ignored); ``close()`` unregisters everything at once. So two users of
one runtime (two Plan tiers over one segment) each register and unregister their own mappings,
and the first to close cannot unregister memory the other still uses. Thread-safe: concurrent
``register`` calls of one mapping make one registration (the others wait for it). Unregister a
mapping before the memory behind it is unmapped.
"""

from __future__ import annotations

import abc
import bisect
import enum
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

import attrs

from cacheseek.errors import TransferError, TransferTimeoutError


class LazyModule:
    """A module imported at its first attribute access (importing a backend costs nothing;
    numpy is needed only once copies are built)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        module = self.__dict__["_module"]
        if module is None:
            import importlib

            module = self.__dict__["_module"] = importlib.import_module(self.__dict__["_name"])
        return getattr(module, attr)


np = LazyModule("numpy")

__all__ = [
    "Direction",
    "CopyDescriptor",
    "CopyBatch",
    "HostMapping",
    "MemoryRange",
    "DirectionStats",
    "TransferStats",
    "TransferRuntime",
    "AsyncTransfer",
    "Event",
    "PendingBatch",
    "TransferRuntimeBase",
    "SubmitFailed",
    "Registration",
]


class Direction(str, enum.Enum):
    """Where a copy's source and destination live: H(ost mapping) or D(evice range)."""

    H2D = "h2d"
    D2H = "d2h"
    H2H = "h2h"
    D2D = "d2d"

    @property
    def src_on_device(self) -> bool:
        return self in (Direction.D2H, Direction.D2D)

    @property
    def dst_on_device(self) -> bool:
        return self in (Direction.H2D, Direction.D2D)

    @property
    def code(self) -> int:
        return _DIRECTIONS.index(self)


_DIRECTIONS = (Direction.H2D, Direction.D2H, Direction.H2H, Direction.D2D)


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


def _int64(values: Any, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim == 0 and n is not None:
        arr = np.full(n, int(arr), dtype=np.int64)
    return np.ascontiguousarray(arr.reshape(-1))


@attrs.frozen(slots=True, eq=False)
class CopyBatch:
    """A batch of copies as int64 arrays (``dsts``, ``srcs``, ``sizes``) and direction codes
    (`Direction.code`), one entry per copy. Build with `of` (one direction), `from_descriptors`
    or `concat`; the arrays are not copied again on submission."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray
    codes: np.ndarray

    @classmethod
    def of(cls, dsts: Any, srcs: Any, sizes: Any, direction: Direction) -> "CopyBatch":
        d = _int64(dsts)
        s = _int64(srcs, len(d))
        n = _int64(sizes, len(d))
        if not len(d) == len(s) == len(n):
            raise TransferError(f"copy batch arrays differ in length: {len(d)}, {len(s)}, {len(n)}")
        return cls(d, s, n, np.full(len(d), Direction(direction).code, dtype=np.int8))

    @classmethod
    def from_descriptors(cls, descriptors: Sequence[CopyDescriptor]) -> "CopyBatch":
        for i, d in enumerate(descriptors):
            if not isinstance(d, CopyDescriptor):
                raise TransferError(f"descriptor {i} is a {type(d).__name__}, not a CopyDescriptor")
        return cls(
            _int64([d.dst for d in descriptors]),
            _int64([d.src for d in descriptors]),
            _int64([d.nbytes for d in descriptors]),
            np.array([d.direction.code for d in descriptors], dtype=np.int8),
        )

    @classmethod
    def coerce(cls, batch: Union["CopyBatch", Sequence[CopyDescriptor]]) -> "CopyBatch":
        return batch if isinstance(batch, CopyBatch) else cls.from_descriptors(list(batch))

    @classmethod
    def concat(cls, batches: Sequence["CopyBatch"]) -> "CopyBatch":
        batches = list(batches)
        if not batches:
            return cls.of([], [], [], Direction.H2D)
        return cls(*(np.concatenate([getattr(b, f) for b in batches]) for f in ("dsts", "srcs", "sizes", "codes")))

    def __len__(self) -> int:
        return len(self.dsts)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def direction(self, i: int) -> Direction:
        return _DIRECTIONS[int(self.codes[i])]

    def descriptors(self) -> list[CopyDescriptor]:
        """The copies as `CopyDescriptor` values (tests, diagnostics)."""
        return [
            CopyDescriptor(int(d), int(s), int(n), _DIRECTIONS[int(c)])
            for d, s, n, c in zip(self.dsts, self.srcs, self.sizes, self.codes)
        ]

    def by_direction(self) -> dict[Direction, tuple[int, int]]:
        """``{direction: (bytes, copies)}`` of the directions present."""
        nbytes = np.bincount(self.codes, weights=self.sizes, minlength=len(_DIRECTIONS))
        copies = np.bincount(self.codes, minlength=len(_DIRECTIONS))
        return {d: (int(nbytes[i]), int(copies[i])) for i, d in enumerate(_DIRECTIONS) if copies[i]}


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
    """Totals for one direction: bytes copied, wall seconds of the batches, copies submitted.
    An asynchronous batch counts from its submission to the wait that saw it complete."""

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
    d2d: DirectionStats = DirectionStats()
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


BatchLike = Union[CopyBatch, Sequence[CopyDescriptor]]


@runtime_checkable
class TransferRuntime(Protocol):
    """Moves bytes between registered host mappings and device ranges, in validated batches.

    ``device_kind`` is ``"cpu"`` or ``"cuda"``: the kind of tensors whose memory the runtime
    treats as device ranges (see `device_range`).
    """

    device_kind: str

    def register(self, mappings: Sequence[HostMapping]) -> None:
        """Register each mapping once (dedup by ``(ptr, length, generation)``) and count this call
        as one user of it; a read-only mapping falls back to a read-only registration; already
        registered is success. Raises `RegistrationError` naming the mapping that failed;
        mappings before it stay registered (and counted)."""
        ...

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        """Drop one user of each mapping; the last user's call unregisters it (unknown mappings
        are ignored)."""
        ...

    def device_range(self, tensor: Any) -> MemoryRange:
        """The bytes of a contiguous tensor of this runtime's device kind, to declare in a batch's
        ``device_ranges``. Raises `TransferError` for a tensor of another device or layout."""
        ...

    def copy_batch(
        self,
        descriptors: BatchLike,
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


@attrs.define(eq=False)
class Event:
    """A runtime's marker on a stream (see the module docstring); made by `record_event` or by
    `submit_batch`. ``handle`` is the runtime's own (a CUDA event, or None when the host runtime
    has nothing to wait for)."""

    handle: Any
    stream: Any
    released: bool = False


class PendingBatch:
    """A submitted batch: ``done()`` asks, ``wait()`` blocks until every copy has landed (then
    records the runtime's stats and frees the event). ``wait`` is idempotent and thread-safe; a
    failed wait raises `TransferError` every time it is called. Every wait is bounded (``timeout_s``,
    default the runtime's ``wait_timeout_s``): past it, `TransferTimeoutError`, and the batch stays
    pending (its buffers are still in use: the caller must not free them; a later wait may
    succeed)."""

    def __init__(self, runtime: "TransferRuntimeBase", batch: CopyBatch, stream: Any, event: Event, t0: float) -> None:
        self._runtime = runtime
        self._per_dir = batch.by_direction()
        self.nbytes = batch.nbytes
        self.copies = len(batch)
        self.stream = stream
        self.event = event
        self.submitted_at = t0
        self.completed_at: Optional[float] = None
        self._error: Optional[TransferError] = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        with self._lock:
            if self.completed_at is not None or self._error is not None:
                return True
            return self._runtime._event_query(self.event)

    def wait(self, *, poll_s: Optional[float] = None, expected_s: float = 0.0,
             timeout_s: Optional[float] = None) -> None:
        """Block until the batch has landed, at most ``timeout_s`` seconds (default the runtime's
        ``wait_timeout_s``). ``poll_s``: the interval between queries (default: from 20 us,
        doubling up to 1 ms); ``expected_s``: sleep that long first. Polling keeps the
        interpreter free for other threads whatever the bindings do with the GIL, and bounds the
        wait (a blocking synchronize could not be)."""
        bound = self._runtime.wait_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._error is not None:
                raise self._error
            if self.completed_at is not None:
                return
            try:
                deadline = time.monotonic() + bound
                if expected_s > 0:
                    time.sleep(min(expected_s, bound))
                interval = poll_s if poll_s is not None else 2e-5
                while not self._runtime._event_query(self.event):
                    if time.monotonic() >= deadline:
                        raise TransferTimeoutError(
                            f"a batch of {self.copies} copies ({self.nbytes} bytes) has not landed after "
                            f"{bound} s; its buffers are still in use (raise the transfer runtime's "
                            "wait_timeout_s if the device is that slow)")
                    time.sleep(interval)
                    if poll_s is None:
                        interval = min(interval * 2, 1e-3)
                self._runtime._event_synchronize(self.event)
            except TransferTimeoutError:
                raise
            except TransferError as exc:
                self._error = exc
                self._runtime.release_event(self.event)
                raise
            self.completed_at = time.perf_counter()
            self._runtime.release_event(self.event)
            self._runtime._record_dirs(self._per_dir, self.completed_at - self.submitted_at)

    @property
    def seconds(self) -> Optional[float]:
        return None if self.completed_at is None else self.completed_at - self.submitted_at


@runtime_checkable
class AsyncTransfer(Protocol):
    """Capability: streams, events and batches that return before they land (module docstring)."""

    def new_stream(self) -> Any: ...

    def destroy_stream(self, stream: Any) -> None: ...

    def current_stream(self, stream: Any = None) -> Any:
        """``stream`` resolved to the runtime's handle; None: the caller's current stream."""
        ...

    def record_event(self, stream: Any = None) -> Event: ...

    def release_event(self, event: Event) -> None: ...

    def stream_wait(self, stream: Any, event: Union[Event, PendingBatch]) -> None: ...

    def submit_batch(
        self,
        batch: BatchLike,
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
        after: Sequence[Union[Event, PendingBatch]] = (),
    ) -> PendingBatch: ...


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
    validation (vectorized), synchronize-on-failure, streams and events, and stats. Subclasses
    move the bytes:

    - ``_register_one(mapping) -> (owned, read_only)`` and ``_unregister_one(registration)``;
    - ``_submit(batch, stream)`` submits every copy of a `CopyBatch`, raising `SubmitFailed`;
    - ``_synchronize(stream)`` waits for the stream, raising `TransferError`;
    - ``_resolve_stream(stream)`` and ``_is_device_memory(ptr, nbytes)`` (undeclared ranges);
    - streams and events: ``_new_stream``, ``_destroy_stream``, ``_new_event``, ``_record``,
      ``_stream_wait_event``, ``_event_query``, ``_event_synchronize``, ``_destroy_event``.
      The defaults suit a runtime whose copies are done at submission (nothing to wait for).
    """

    device_kind: str = "cpu"
    tensor_device_type: str = "cpu"
    wait_timeout_s: float = 120.0  # the bound of `PendingBatch.wait`; settable per runtime

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registrations: dict[tuple[int, int, int], Registration] = {}
        self._users: dict[tuple[int, int, int], int] = {}  # register calls not yet unregistered
        self._registering: set[tuple[int, int, int]] = set()
        self._reg_cond = threading.Condition(self._lock)
        self._host_index: list[tuple[int, Registration]] = []  # sorted by ptr
        self._host_arrays = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
        self._dir_stats = {d: DirectionStats() for d in Direction}
        self._batches = 0
        self._register_seconds = 0.0
        self._register_timings: list[tuple[HostMapping, float]] = []
        self._streams = 0
        self._closed = False

    # -- subclass hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _register_one(self, mapping: HostMapping) -> tuple[bool, bool]: ...

    @abc.abstractmethod
    def _unregister_one(self, registration: Registration) -> None: ...

    @abc.abstractmethod
    def _submit(self, batch: CopyBatch, stream: Any) -> None: ...

    @abc.abstractmethod
    def _synchronize(self, stream: Any) -> None: ...

    def _resolve_stream(self, stream: Any) -> Any:
        return stream

    def _is_device_memory(self, ptr: int, nbytes: int) -> bool:
        return False

    def _new_stream(self) -> Any:
        with self._lock:
            self._streams += 1
            return -self._streams  # a token: copies are done at submission

    def _destroy_stream(self, stream: Any) -> None:
        return None

    def _new_event(self) -> Any:
        return None

    def _record(self, event: Any, stream: Any) -> None:
        return None

    def _stream_wait_event(self, stream: Any, event: Any) -> None:
        return None

    def _event_query(self, event: Event) -> bool:
        return True

    def _event_synchronize(self, event: Event) -> None:
        return None

    def _destroy_event(self, event: Any) -> None:
        return None

    def bind_thread(self) -> None:
        """Make this runtime's device current on the calling thread; worker threads that use the
        runtime call it when they start. Nothing to do for a host runtime."""

    # -- registration ---------------------------------------------------------------------------
    def register(self, mappings: Sequence[HostMapping]) -> None:
        self._check_open()
        for mapping in mappings:
            if not isinstance(mapping, HostMapping):
                raise TypeError(f"register takes HostMapping values, got {type(mapping).__name__}")
            key = mapping.key
            with self._reg_cond:
                while key in self._registering:  # another thread is registering it now
                    self._reg_cond.wait()
                if key in self._registrations:
                    self._users[key] += 1
                    continue
                self._registering.add(key)
            t0 = time.perf_counter()
            try:
                owned, read_only = self._register_one(mapping)
            except BaseException:
                with self._reg_cond:
                    self._registering.discard(key)
                    self._reg_cond.notify_all()
                raise
            reg = Registration(mapping, owned, read_only)
            with self._reg_cond:
                seconds = time.perf_counter() - t0
                self._register_seconds += seconds
                self._register_timings.append((mapping, seconds))
                self._registrations[key] = reg
                self._users[key] = 1
                self._registering.discard(key)
                self._rebuild_index()
                self._reg_cond.notify_all()

    def register_timings(self) -> list[tuple[HostMapping, float]]:
        """``(mapping, seconds)`` of every registration this runtime made, in order."""
        with self._lock:
            return list(self._register_timings)

    def users(self, mapping: HostMapping) -> int:
        """How many `register` calls of ``mapping`` are not yet matched by `unregister` (0: none)."""
        with self._lock:
            return self._users.get(mapping.key, 0)

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        self._drop_registrations(mappings, force=False)

    def _drop_registrations(self, mappings: Sequence[HostMapping], *, force: bool) -> None:
        """One count off each mapping (``force``: all of them); unregister at zero."""
        errors: list[BaseException] = []
        for mapping in mappings:
            with self._lock:
                key = mapping.key
                if key not in self._registrations:
                    continue
                self._users[key] -= 1
                if self._users[key] > 0 and not force:
                    continue  # another user still needs it
                self._users.pop(key, None)
                reg = self._registrations.pop(key)
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
        self._host_arrays = (
            np.array([r.mapping.ptr for _, r in self._host_index], dtype=np.int64),
            np.array([r.mapping.ptr + r.mapping.length for _, r in self._host_index], dtype=np.int64),
            np.array([r.mapping.writable for _, r in self._host_index], dtype=bool),
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

    # -- streams and events (AsyncTransfer) -----------------------------------------------------
    def new_stream(self) -> Any:
        self._check_open()
        return self._new_stream()

    def destroy_stream(self, stream: Any) -> None:
        if stream is not None:
            self._destroy_stream(stream)

    def current_stream(self, stream: Any = None) -> Any:
        return self._resolve_stream(stream)

    def record_event(self, stream: Any = None) -> Event:
        self._check_open()
        handle = self._resolve_stream(stream)
        event = Event(self._new_event(), handle)
        try:
            self._record(event.handle, handle)
        except BaseException:
            self.release_event(event)
            raise
        return event

    def release_event(self, event: Event) -> None:
        """Free an event (idempotent); pending work it marks goes on."""
        if event.released:
            return
        event.released = True
        if event.handle is not None:
            self._destroy_event(event.handle)

    def stream_wait(self, stream: Any, event: Union[Event, PendingBatch]) -> None:
        """Later work on ``stream`` waits for ``event`` (an `Event` or a `PendingBatch`)."""
        ev = event.event if isinstance(event, PendingBatch) else event
        if ev.released or ev.handle is None:
            return  # released: it was waited for already; None: nothing to wait for
        self._stream_wait_event(self._resolve_stream(stream), ev.handle)

    # -- copies ---------------------------------------------------------------------------------
    def copy_batch(
        self,
        descriptors: BatchLike,
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
        after: Sequence[Union[Event, PendingBatch]] = (),
    ) -> None:
        batch, handle = self._prepare(descriptors, stream, device_ranges, after)
        if not len(batch):
            return
        t0 = time.perf_counter()
        self._submit_or_raise(batch, handle)
        self._synchronize(handle)
        self._record_dirs(batch.by_direction(), time.perf_counter() - t0)

    def submit_batch(
        self,
        batch: BatchLike,
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
        after: Sequence[Union[Event, PendingBatch]] = (),
    ) -> PendingBatch:
        """Validate, order ``stream`` after every ``after`` event, submit, record a completion
        event; return without waiting. Raises `TransferError` (nothing of the batch in flight)."""
        batch, handle = self._prepare(batch, stream, device_ranges, after)
        t0 = time.perf_counter()
        if len(batch):
            self._submit_or_raise(batch, handle)
        event = Event(self._new_event(), handle)
        try:
            self._record(event.handle, handle)
        except BaseException:
            try:
                self._synchronize(handle)
            finally:
                self.release_event(event)
            raise
        return PendingBatch(self, batch, handle, event, t0)

    def _prepare(
        self,
        descriptors: BatchLike,
        stream: Any,
        device_ranges: Sequence[MemoryRange],
        after: Sequence[Union[Event, PendingBatch]],
    ) -> tuple[CopyBatch, Any]:
        """What every submission does first: the whole batch validated, then ``stream`` resolved
        and ordered after every ``after`` event. Nothing is submitted here."""
        self._check_open()
        batch = CopyBatch.coerce(descriptors)
        self._validate(batch, device_ranges)
        handle = self._resolve_stream(stream)
        for ev in after:
            self.stream_wait(handle, ev)
        return batch, handle

    def _submit_or_raise(self, batch: CopyBatch, handle: Any) -> None:
        try:
            self._submit(batch, handle)
        except SubmitFailed as failed:
            if failed.submitted != 0:
                try:
                    self._synchronize(handle)
                except TransferError as sync_error:
                    add_note(failed.cause, f"and the synchronize after it failed too: {sync_error}")
            if isinstance(failed.cause, TransferError):
                raise failed.cause
            raise TransferError(f"copy submission failed: {failed.cause}") from failed.cause

    def validate(self, descriptors: BatchLike, *, device_ranges: Sequence[MemoryRange] = ()) -> None:
        """Check a whole batch without submitting anything (for callers that submit it later, in
        pieces or on another thread). Raises `TransferError`."""
        self._check_open()
        self._validate(CopyBatch.coerce(descriptors), device_ranges)

    def _validate(self, batch: CopyBatch, device_ranges: Sequence[MemoryRange]) -> None:
        """Every copy of ``batch`` checked at once (numpy); the few that fail the fast check are
        re-checked one by one (overlapping ranges, undeclared device memory) before raising."""
        n = len(batch)
        if n == 0:
            return
        dsts, srcs, sizes, codes = batch.dsts, batch.srcs, batch.sizes, batch.codes
        bad = np.flatnonzero((sizes <= 0) | (dsts <= 0) | (srcs <= 0))
        if len(bad):
            i = int(bad[0])
            raise TransferError(
                f"descriptor {i}: dst {int(dsts[i]):#x}, src {int(srcs[i]):#x}, {int(sizes[i])} B: "
                "addresses and size must be positive; nothing of the batch was submitted"
            )
        with self._lock:
            host_index = list(self._host_index)
            h_starts, h_ends, h_writable = self._host_arrays
        devs = sorted(((r.ptr, r) for r in device_ranges), key=lambda e: e[0])
        d_starts = np.array([p for p, _ in devs], dtype=np.int64)
        d_ends = np.array([r.end for _, r in devs], dtype=np.int64)
        src_dev = (codes == Direction.D2H.code) | (codes == Direction.D2D.code)
        dst_dev = (codes == Direction.H2D.code) | (codes == Direction.D2D.code)
        for side, ptrs, on_dev, write in (("src", srcs, src_dev, False), ("dst", dsts, dst_dev, True)):
            ok = np.empty(n, dtype=bool)
            ok[on_dev] = _inside(d_starts, d_ends, ptrs[on_dev], sizes[on_dev])[0]
            host = ~on_dev
            inside, idx = _inside(h_starts, h_ends, ptrs[host], sizes[host])
            if write and len(idx):
                inside &= h_writable[np.clip(idx, 0, None)] if len(h_writable) else False
            ok[host] = inside
            for i in np.flatnonzero(~ok):
                i = int(i)
                ptr, nbytes = int(ptrs[i]), int(sizes[i])
                if on_dev[i]:
                    good = _find(devs, [p for p, _ in devs], ptr, nbytes) is not None or self._is_device_memory(
                        ptr, nbytes
                    )
                    where = "a declared device range"
                else:
                    reg = _find(host_index, [p for p, _ in host_index], ptr, nbytes, key=lambda r: r.mapping.range)
                    good = reg is not None and (not write or reg.mapping.writable)
                    where = ("a writable " if write else "a ") + "registered host mapping"
                if not good:
                    raise TransferError(
                        f"descriptor {i} ({batch.direction(i).value}): {side} [{ptr:#x}, +{nbytes}) is "
                        f"not inside {where}; nothing of the batch was submitted"
                    )
        if n > 1:
            order = np.argsort(dsts, kind="stable")
            starts, ends = dsts[order], dsts[order] + sizes[order]
            clash = np.flatnonzero(starts[1:] < ends[:-1])
            if len(clash):
                raise TransferError(
                    f"descriptors overlap at destination {int(starts[int(clash[0]) + 1]):#x}; "
                    "nothing of the batch was submitted"
                )

    def _record_dirs(self, per_dir: dict[Direction, tuple[int, int]], seconds: float) -> None:
        total = sum(b for b, _ in per_dir.values())
        with self._lock:
            self._batches += 1
            for direction, (nbytes, copies) in per_dir.items():
                s = self._dir_stats[direction]
                share = seconds * nbytes / total if total else 0.0
                self._dir_stats[direction] = DirectionStats(s.bytes + nbytes, s.seconds + share, s.copies + copies)

    @property
    def stats(self) -> TransferStats:
        with self._lock:
            regs = list(self._registrations.values())
            return TransferStats(
                h2d=self._dir_stats[Direction.H2D],
                d2h=self._dir_stats[Direction.D2H],
                h2h=self._dir_stats[Direction.H2H],
                d2d=self._dir_stats[Direction.D2D],
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
        self._drop_registrations(mappings, force=True)
        self._closed = True


def _inside(starts: np.ndarray, ends: np.ndarray, ptrs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per copy: does ``[ptr, ptr + size)`` lie in the range that starts last at or before ptr?
    (ranges sorted by start). Returns ``(inside, index of that range or -1)``."""
    if len(ptrs) == 0:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    if len(starts) == 0:
        return np.zeros(len(ptrs), dtype=bool), np.full(len(ptrs), -1, dtype=np.int64)
    idx = np.searchsorted(starts, ptrs, side="right") - 1
    inside = (idx >= 0) & (ptrs + sizes <= ends[np.clip(idx, 0, None)])
    return inside, idx


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
