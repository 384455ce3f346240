"""`FakeCudart`: a pure-Python stand-in for the cuda-bindings ``cudart`` calls CacheSeek uses.

Same call shapes and return tuples as ``cuda.bindings.runtime`` (13.x; ``batch_api="12"`` mimics
the 12.8 batch call that also returns a failing index; ``batch_api=None`` has no batch call),
with the value types of `fakes.cudart_types`. The fake is assembled from three
parts, each documented where it lives:

- `FakeMemory` (``memory``): where an address lives (declared device memory, registered host
  memory), registration, and which copies are allowed (``strict``, ``unknown_is_device``,
  ``readonly_ranges``);
- `FakeStreams` (``streams``): copies queued per stream and performed only when waited for,
  events as queue positions, ``cudaEventQuery`` answering not-ready ``not_ready_queries`` times;
- `CallLog` (``call_log``): every call in ``calls`` (and the optional shared ``log``), and the
  faults armed with `fail`.

On top of them this class keeps the sticky last error (``last_error``, set by a failing call
and cleared by ``cudaGetLastError``) and the batch call's own rules (it refuses the legacy
stream and a missing source access order). One re-entrant ``mutex`` guards the parts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

from fakes import cudart_types as types
from fakes.cudart_faults import CallLog, FakeCall
from fakes.cudart_types import cudaError_t, cudaMemcpyKind, cudaMemcpySrcAccessOrder
from fakes.memory import FakeMemory
from fakes.streams import FakeStreams

__all__ = ["FakeCudart"]

_OK = cudaError_t.cudaSuccess
_INVALID = cudaError_t.cudaErrorInvalidValue
_LEGACY = (0, 1)


class FakeCudart:
    """A fake ``cudart`` module. See the module docstring for what it models."""

    cudaError_t = types.cudaError_t
    cudaMemcpyKind = types.cudaMemcpyKind
    cudaMemoryType = types.cudaMemoryType
    cudaMemcpySrcAccessOrder = types.cudaMemcpySrcAccessOrder
    cudaMemcpyFlags = types.cudaMemcpyFlags
    cudaMemcpyAttributes = types.cudaMemcpyAttributes
    cudaPointerAttributes = types.cudaPointerAttributes
    cudaHostRegisterDefault = types.cudaHostRegisterDefault
    cudaHostRegisterPortable = types.cudaHostRegisterPortable
    cudaHostRegisterMapped = types.cudaHostRegisterMapped
    cudaHostRegisterReadOnly = types.cudaHostRegisterReadOnly
    cudaStreamDefault = types.cudaStreamDefault
    cudaStreamNonBlocking = types.cudaStreamNonBlocking
    cudaEventDefault = types.cudaEventDefault
    cudaEventDisableTiming = types.cudaEventDisableTiming

    def __init__(
        self,
        *,
        batch_api: Optional[str] = "13",
        strict: bool = True,
        unknown_is_device: bool = False,
        log: Optional[list] = None,
        not_ready_queries: int = 1,
    ) -> None:
        if batch_api not in ("13", "12", None):
            raise ValueError(f"batch_api must be '13', '12' or None, got {batch_api!r}")
        self.memory = FakeMemory(strict=strict, unknown_is_device=unknown_is_device)
        self.streams = FakeStreams()
        self.call_log = CallLog(log)
        self.calls = self.call_log.calls
        self.device_log = self.call_log.device_log
        self.readonly_ranges = self.memory.readonly_ranges
        self.not_ready_queries = not_ready_queries
        self.last_error = _OK
        self.mutex = threading.RLock()
        if batch_api == "13":
            self.cudaMemcpyBatchAsync = self._batch13
        elif batch_api == "12":
            self.cudaMemcpyBatchAsync = self._batch12

    # -- test controls --------------------------------------------------------------------------
    @property
    def strict(self) -> bool:
        return self.memory.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self.memory.strict = value

    @property
    def unknown_is_device(self) -> bool:
        return self.memory.unknown_is_device

    @unknown_is_device.setter
    def unknown_is_device(self, value: bool) -> None:
        self.memory.unknown_is_device = value

    def fail(self, name: str, error: cudaError_t = _INVALID, *, nth: int = 1, times: int = 1) -> None:
        """Make the ``nth`` next call of ``name`` (and the ``times - 1`` after it) return ``error``."""
        self.call_log.fail(name, error, nth=nth, times=times)

    def device_alloc(self, nbytes: int, *, device: int = 0) -> int:
        """Allocate ``nbytes`` of fake device memory (zeroed host memory) and return its address."""
        return self.memory.alloc(nbytes, device=device)

    def add_device_range(self, ptr: int, nbytes: int, *, device: int = 0) -> None:
        """Treat existing memory (e.g. a CPU tensor's bytes) as device memory."""
        self.memory.add_device_range(ptr, nbytes, device=device)

    def calls_named(self, name: str) -> list[FakeCall]:
        return self.call_log.named(name)

    def pending(self, stream: Optional[int] = None) -> int:
        """Copies submitted and not yet performed (on ``stream``, or on every stream)."""
        with self.mutex:
            return self.streams.pending(stream)

    def is_registered(self, ptr: int) -> bool:
        return ptr in self.memory.registered

    def live_streams(self) -> list[int]:
        with self.mutex:
            return self.streams.live_streams()

    def live_events(self) -> int:
        """Events created and not destroyed (a leak check for tests)."""
        with self.mutex:
            return self.streams.live_events()

    # -- internals ------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> cudaError_t:
        """Log the call; the armed fault's error (made the last error), else success."""
        with self.mutex:
            err = self.call_log.record(name, args)
            return _OK if err is None else self._error(err)

    def _error(self, err: cudaError_t) -> cudaError_t:
        self.last_error = err
        return err

    # -- the cudart surface ---------------------------------------------------------------------
    def cudaSetDevice(self, device: int) -> tuple[cudaError_t]:
        """Per thread, as CUDA's: later calls of this thread are recorded on ``device``."""
        with self.mutex:
            self.call_log.set_device(device)
        return (self._call("cudaSetDevice", device),)

    def cudaGetDevice(self) -> tuple[cudaError_t, int]:
        with self.mutex:
            device = self.call_log.device()
        return self._call("cudaGetDevice"), device

    def cudaGetLastError(self) -> tuple[cudaError_t]:
        self.calls.append(FakeCall("cudaGetLastError", ()))
        err, self.last_error = self.last_error, _OK
        return (err,)

    def cudaPeekAtLastError(self) -> tuple[cudaError_t]:
        return (self.last_error,)

    def cudaGetErrorName(self, err: Any) -> tuple[cudaError_t, bytes]:
        return _OK, cudaError_t(int(err)).name.encode()

    def cudaGetErrorString(self, err: Any) -> tuple[cudaError_t, bytes]:
        return _OK, f"fake {cudaError_t(int(err)).name}".encode()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> tuple[cudaError_t]:
        err = self._call("cudaHostRegister", ptr, size, flags)
        if err != _OK:
            return (err,)
        err = self.memory.register(ptr, size, flags)
        return (err if err == _OK else self._error(err),)

    def cudaHostUnregister(self, ptr: int) -> tuple[cudaError_t]:
        err = self._call("cudaHostUnregister", ptr)
        if err != _OK:
            return (err,)
        err = self.memory.unregister(ptr)
        return (err if err == _OK else self._error(err),)

    def cudaPointerGetAttributes(self, ptr: int) -> tuple[cudaError_t, Any]:
        err = self._call("cudaPointerGetAttributes", ptr)
        if err != _OK:
            return err, None
        return _OK, self.memory.pointer_attributes(ptr)

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: Any, stream: int
    ) -> tuple[cudaError_t]:
        err = self._call("cudaMemcpyAsync", dst, src, count, cudaMemcpyKind(int(kind)), stream)
        if err != _OK:
            return (err,)
        if not self.memory.check_copy(dst, src, count, cudaMemcpyKind(int(kind))):
            return (self._error(_INVALID),)
        with self.mutex:
            self.streams.enqueue(stream, [(dst, src, count)])
        return (_OK,)

    def _batch(
        self,
        dsts: Sequence[int],
        srcs: Sequence[int],
        sizes: Sequence[int],
        count: int,
        attrs_: Sequence[Any],
        attrs_idxs: Sequence[int],
        num_attrs: int,
        stream: int,
    ) -> tuple[cudaError_t, int]:
        args = (tuple(dsts), tuple(srcs), tuple(sizes), count, num_attrs, stream)
        err = self._call("cudaMemcpyBatchAsync", *args)
        if err != _OK:
            return err, 0
        if stream in _LEGACY or not (len(dsts) == len(srcs) == len(sizes) == count) or count == 0:
            return self._error(_INVALID), 0
        if num_attrs < 1 or len(attrs_) != num_attrs or list(attrs_idxs)[:1] != [0]:
            return self._error(_INVALID), 0
        invalid = cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderInvalid
        if any(a.srcAccessOrder == invalid for a in attrs_):
            return self._error(_INVALID), 0
        for i, (d, s, n) in enumerate(zip(dsts, srcs, sizes)):
            if not self.memory.check_copy(d, s, n, None):
                return self._error(_INVALID), i
        with self.mutex:
            self.streams.enqueue(stream, list(zip(dsts, srcs, sizes)))
        return _OK, 0

    def _batch13(self, dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream):
        """cudaMemcpyBatchAsync(dsts, srcs, sizes, size_t count, attrs, attrsIdxs, size_t numAttrs, stream)

        As in cuda-bindings 13.x: returns ``(err,)``."""
        return (self._batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)[0],)

    def _batch12(self, dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream):
        """cudaMemcpyBatchAsync(dsts, srcs, sizes, size_t count, attrs, attrsIdxs, size_t numAttrs, hStream)

        As in cuda-bindings 12.8: returns ``(err, failIdx)``."""
        return self._batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)

    def cudaStreamSynchronize(self, stream: int) -> tuple[cudaError_t]:
        err = self._call("cudaStreamSynchronize", stream)
        if err != _OK:
            return (err,)
        with self.mutex:
            self.streams.execute(stream)
        return (_OK,)

    def cudaDeviceSynchronize(self) -> tuple[cudaError_t]:
        err = self._call("cudaDeviceSynchronize")
        if err != _OK:
            return (err,)
        with self.mutex:
            self.streams.execute_all()
        return (_OK,)

    # -- streams and events ---------------------------------------------------------------------
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[cudaError_t, int]:
        err = self._call("cudaStreamCreateWithFlags", flags)
        if err != _OK:
            return err, 0
        with self.mutex:
            return _OK, self.streams.create(flags)

    def cudaStreamDestroy(self, stream: int) -> tuple[cudaError_t]:
        err = self._call("cudaStreamDestroy", stream)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self.streams.destroy(stream):  # destroying a stream lets its queued work finish
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
        return (_OK,)

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[cudaError_t, Any]:
        err = self._call("cudaEventCreateWithFlags", flags)
        if err != _OK:
            return err, None
        with self.mutex:
            return _OK, self.streams.new_event(flags)

    def _on_live_event(self, name: str, event: Any, *args: Any) -> cudaError_t:
        """Log the call; an armed fault's error, invalid handle for a dead event, else success.
        The caller holds the mutex."""
        err = self._call(name, *args)
        if err != _OK:
            return err
        if not self.streams.is_live(event):
            return self._error(cudaError_t.cudaErrorInvalidResourceHandle)
        return _OK

    def cudaEventRecord(self, event: Any, stream: int) -> tuple[cudaError_t]:
        with self.mutex:
            err = self._on_live_event("cudaEventRecord", event, event, stream)
            if err == _OK:
                self.streams.record(event, stream)
        return (err,)

    def cudaStreamWaitEvent(self, stream: int, event: Any, flags: int = 0) -> tuple[cudaError_t]:
        with self.mutex:
            err = self._on_live_event("cudaStreamWaitEvent", event, stream, event, flags)
            if err == _OK:
                self.streams.reach(event)  # eagerly: the waiting stream's later copies see its bytes
        return (err,)

    def cudaEventQuery(self, event: Any) -> tuple[cudaError_t]:
        with self.mutex:
            err = self._on_live_event("cudaEventQuery", event, event)
            if err == _OK and not self.streams.query(event, self.not_ready_queries):
                return (cudaError_t.cudaErrorNotReady,)
        return (err,)

    def cudaEventSynchronize(self, event: Any) -> tuple[cudaError_t]:
        with self.mutex:
            err = self._on_live_event("cudaEventSynchronize", event, event)
            if err == _OK:
                self.streams.reach(event)
        return (err,)

    def cudaEventDestroy(self, event: Any) -> tuple[cudaError_t]:
        with self.mutex:
            err = self._on_live_event("cudaEventDestroy", event, event)
            if err == _OK:
                self.streams.destroy_event(event)
        return (err,)
