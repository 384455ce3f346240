"""`TransferRuntimeBase`: the batch contract every transfer runtime shares, and `SubmitFailed`,
the error its subclasses raise from ``_submit``.

The base class owns the parts that are the same for every runtime: the registration bookkeeping
(`RegistrationTable`, whole or in pieces), the cut of copies at the joints between registrations
(`split_at_joints`) and the whole-batch check (`validate_batch`), both before anything is
submitted, synchronize-on-failure, streams and events, and the stats (`CopyCounters`). A subclass moves the bytes through the hooks listed
in the class docstring. The lifecycles are written where the seams are: synchronous batches in
`cacheseek.transfer.protocol`, asynchronous ones in `cacheseek.transfer.pending`, registrations
in `cacheseek.transfer.registrations`.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from cacheseek.errors import TransferError, add_note
from cacheseek.transfer.batch import BatchLike, CopyBatch, Direction
from cacheseek.transfer.joints import split_at_joints
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.pending import Event, PendingBatch
from cacheseek.transfer.registrations import Registration, RegistrationTable
from cacheseek.transfer.stats import CopyCounters, TransferStats
from cacheseek.transfer.validation import validate_batch

__all__ = ["TransferRuntimeBase", "SubmitFailed"]


class SubmitFailed(Exception):
    """Raised by a runtime's ``_submit`` when a submission call fails. ``submitted`` is how many
    copies may already be in flight (-1 when unknown); ``cause`` is the error to report."""

    def __init__(self, submitted: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.submitted = submitted
        self.cause = cause


class TransferRuntimeBase(abc.ABC):
    """The batch contract shared by every runtime (`TransferRuntime` and `AsyncTransfer`).
    Subclasses move the bytes:

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
        self._registrations = RegistrationTable()
        self._counters = CopyCounters()
        self._stream_lock = threading.Lock()
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
        with self._stream_lock:
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

    # -- registration (RegistrationTable) -------------------------------------------------------
    def register(self, mappings: Sequence[HostMapping]) -> None:
        self._check_open()
        self._registrations.register(mappings, self._register_one)

    def register_in_pieces(self, mapping: HostMapping, piece_bytes: Optional[int], *,
                           before_piece: Optional[Callable[[HostMapping], None]] = None,
                           after_piece: Optional[Callable[[HostMapping], None]] = None) -> None:
        """`register` one mapping as consecutive pieces of at most ``piece_bytes`` (None or 0: in
        one call), each its own registration; ``before_piece(piece)`` runs before each (pre-fault
        it), ``after_piece(piece)`` between two (a pause). One user of the mapping, as `register`;
        `unregister` undoes every piece. On a failure nothing of the mapping stays registered
        (`RegistrationError` names the piece). Copies that span a joint are cut at submission."""
        self._check_open()
        self._registrations.register([mapping], self._register_one, unregister_one=self._unregister_one,
                                     piece_bytes=piece_bytes, before_piece=before_piece, after_piece=after_piece)

    def registered_pieces(self, mapping: HostMapping) -> tuple[HostMapping, ...]:
        """The registrations behind ``mapping`` now (one: whole; none: not registered)."""
        return self._registrations.pieces(mapping)

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        self._registrations.unregister(mappings, self._unregister_one)

    def users(self, mapping: HostMapping) -> int:
        """How many `register` calls of ``mapping`` are not yet matched by `unregister` (0: none)."""
        return self._registrations.users(mapping)

    def registered(self) -> list[HostMapping]:
        """The mappings registered now, in address order."""
        return self._registrations.registered()

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
    def copy_batch(self, descriptors: BatchLike, *, stream: Any = None, device_ranges: Sequence[MemoryRange] = (),
                   after: Sequence[Union[Event, PendingBatch]] = ()) -> None:
        batch, handle = self._prepare(descriptors, stream, device_ranges, after)
        if not len(batch):
            return
        t0 = time.perf_counter()
        self._submit_or_raise(batch, handle)
        self._synchronize(handle)
        self._record_dirs(batch.by_direction(), time.perf_counter() - t0)

    def submit_batch(self, batch: BatchLike, *, stream: Any = None, device_ranges: Sequence[MemoryRange] = (),
                     after: Sequence[Union[Event, PendingBatch]] = ()) -> PendingBatch:
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

    def validate(self, descriptors: BatchLike, *, device_ranges: Sequence[MemoryRange] = ()) -> None:
        """Check a whole batch without submitting anything (for callers that submit it later, in
        pieces or on another thread). Raises `TransferError`."""
        self._check_open()
        self._validate(CopyBatch.coerce(descriptors), device_ranges)

    def _validate(self, batch: CopyBatch, device_ranges: Sequence[MemoryRange]) -> CopyBatch:
        """``batch`` cut at the joints between registrations, then checked whole; the cut batch
        is what gets submitted (one place for every runtime: `cacheseek.transfer.joints`)."""
        hosts = self._registrations.index()
        batch = split_at_joints(batch, hosts)
        validate_batch(batch, hosts, device_ranges, self._is_device_memory)
        return batch

    def _prepare(self, descriptors: BatchLike, stream: Any, device_ranges: Sequence[MemoryRange],
                 after: Sequence[Union[Event, PendingBatch]]) -> tuple[CopyBatch, Any]:
        """What every submission does first: the whole batch cut at the joints and validated,
        then ``stream`` resolved and ordered after every ``after`` event. Nothing is submitted
        here. Returns the batch to submit (the cut one)."""
        self._check_open()
        batch = self._validate(CopyBatch.coerce(descriptors), device_ranges)
        handle = self._resolve_stream(stream)
        for ev in after:
            self.stream_wait(handle, ev)
        return batch, handle

    def _submit_or_raise(self, batch: CopyBatch, handle: Any) -> None:
        """``_submit``; on `SubmitFailed`, synchronize what went out, then raise `TransferError`."""
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

    # -- stats ----------------------------------------------------------------------------------
    def _record_dirs(self, per_dir: dict[Direction, tuple[int, int]], seconds: float) -> None:
        self._counters.add(per_dir, seconds)

    @property
    def stats(self) -> TransferStats:
        n, nbytes, seconds = self._registrations.totals()
        return self._counters.snapshot(n_registered=n, registered_bytes=nbytes, register_seconds=seconds,
                                       registered_pieces=self._registrations.n_pieces())

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{type(self).__name__} used after close()")

    def close(self) -> None:
        if self._closed:
            return
        self._registrations.drop_all(self._unregister_one)
        self._closed = True
