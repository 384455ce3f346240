"""`FakeCudart`: a pure-Python stand-in for the cuda-bindings ``cudart`` calls CacheSeek uses.

Same call shapes and return tuples as ``cuda.bindings.runtime`` (13.x; ``batch_api="12"`` mimics
the 12.8 batch call that also returns a failing index; ``batch_api=None`` has no batch call).
"Device memory" is ordinary host memory that the test declares (`device_alloc`,
`add_device_range`), so bytes really move and round trips can be checked on a CPU machine.

What it models, so tests see the bugs a GPU would show:
- copies are queued per stream at submission and performed only by ``cudaStreamSynchronize``
  (or ``cudaDeviceSynchronize``): reading a destination before the synchronize sees old bytes;
- events mark a stream's queue position (``cudaEventRecord``); ``cudaEventSynchronize``, and
  ``cudaStreamWaitEvent`` (eagerly), perform the marked stream's copies up to that position;
  ``cudaEventQuery`` answers ``cudaErrorNotReady`` ``not_ready_queries`` times for an event with
  copies still queued before it, then performs them (the device "progresses" when polled);
  streams made by ``cudaStreamCreateWithFlags`` get handles from 1000 up;
- a failing call sets the last error, which stays until ``cudaGetLastError`` clears it;
- a range listed in ``readonly_ranges`` refuses default-flag registration (invalid value), like a
  read-only MAP_SHARED mapping on the H200, and accepts ``cudaHostRegisterReadOnly``;
- overlapping registrations answer ``cudaErrorHostMemoryAlreadyRegistered``;
- with ``strict`` (default), a copy whose source or destination is neither registered host
  memory nor declared device memory, or whose kind contradicts where they live, or that writes a
  read-only registration, fails with invalid value; the batch call refuses the legacy stream.
  ``unknown_is_device=True`` treats every address that is not registered host memory as device
  memory (convenient when CPU tensors stand in for CUDA tensors).

Every call is recorded in ``calls`` (and appended to an optional shared ``log`` as
``("cudart", name, args)``). `fail` arms an error for the n-th next call of a function.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
from collections.abc import Sequence
from typing import Any, Optional

import attrs

__all__ = ["FakeCudart", "FakeCall", "FakeEvent"]


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidResourceHandle = 400
    cudaErrorNotReady = 600
    cudaErrorCallRequiresNewerDriver = 36
    cudaErrorIllegalAddress = 700
    cudaErrorHostMemoryAlreadyRegistered = 712
    cudaErrorHostMemoryNotRegistered = 713
    cudaErrorLaunchFailure = 719
    cudaErrorNotSupported = 801
    cudaErrorUnknown = 999


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaMemoryType(enum.IntEnum):
    cudaMemoryTypeUnregistered = 0
    cudaMemoryTypeHost = 1
    cudaMemoryTypeDevice = 2
    cudaMemoryTypeManaged = 3


class cudaMemcpySrcAccessOrder(enum.IntEnum):
    cudaMemcpySrcAccessOrderInvalid = 0
    cudaMemcpySrcAccessOrderStream = 1
    cudaMemcpySrcAccessOrderDuringApiCall = 2
    cudaMemcpySrcAccessOrderAny = 3


class cudaMemcpyFlags(enum.IntEnum):
    cudaMemcpyFlagDefault = 0
    cudaMemcpyFlagPreferOverlapWithCompute = 1


class cudaMemcpyAttributes:
    def __init__(self) -> None:
        self.srcAccessOrder = cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderInvalid
        self.flags = cudaMemcpyFlags.cudaMemcpyFlagDefault
        self.srcLocHint = None
        self.dstLocHint = None


class cudaPointerAttributes:
    def __init__(self, type: cudaMemoryType, device: int = 0) -> None:
        self.type = type
        self.device = device
        self.devicePointer = 0
        self.hostPointer = 0


class FakeEvent:
    """A fake ``cudaEvent_t``: the stream and queue position of its last record."""

    _ids = itertools.count(1)

    def __init__(self, flags: int) -> None:
        self.id = next(self._ids)
        self.flags = flags
        self.stream: Optional[int] = None
        self.pos = 0
        self.queries = 0
        self.destroyed = False

    def __repr__(self) -> str:
        return f"FakeEvent({self.id}, stream={self.stream}, pos={self.pos})"


@attrs.frozen(slots=True)
class FakeCall:
    name: str
    args: tuple


@attrs.define
class _Fault:
    name: str
    error: cudaError_t
    skip: int
    remaining: int


_OK = cudaError_t.cudaSuccess
_INVALID = cudaError_t.cudaErrorInvalidValue
_LEGACY = (0, 1)


class FakeCudart:
    """A fake ``cudart`` module. See the module docstring for what it models."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaMemoryType = cudaMemoryType
    cudaMemcpySrcAccessOrder = cudaMemcpySrcAccessOrder
    cudaMemcpyFlags = cudaMemcpyFlags
    cudaMemcpyAttributes = cudaMemcpyAttributes
    cudaPointerAttributes = cudaPointerAttributes
    cudaHostRegisterDefault = 0
    cudaHostRegisterPortable = 1
    cudaHostRegisterMapped = 2
    cudaHostRegisterReadOnly = 8
    cudaStreamDefault = 0
    cudaStreamNonBlocking = 1
    cudaEventDefault = 0
    cudaEventDisableTiming = 2

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
        self.calls: list[FakeCall] = []
        self.log = log
        self.strict = strict
        self.unknown_is_device = unknown_is_device
        self.last_error = _OK
        self.readonly_ranges: list[tuple[int, int]] = []
        self._faults: list[_Fault] = []
        self._registered: dict[int, tuple[int, int]] = {}  # ptr -> (length, flags)
        self._device: list[tuple[int, int, int]] = []  # (ptr, length, device)
        self._buffers: list[Any] = []
        self._queues: dict[int, list[tuple[int, int, int, int]]] = {}  # (seq, dst, src, n)
        self._seq: dict[int, int] = {}
        self._streams: dict[int, int] = {}  # created stream -> flags
        self._next_stream = 1000
        self.not_ready_queries = not_ready_queries
        self._events: set[FakeEvent] = set()
        self.mutex = threading.RLock()
        self._thread_device: dict[int, int] = {}  # thread ident -> device set by cudaSetDevice
        self.device_log: list[tuple[str, Optional[int]]] = []  # (call, the calling thread's device)
        if batch_api == "13":
            self.cudaMemcpyBatchAsync = self._batch13
        elif batch_api == "12":
            self.cudaMemcpyBatchAsync = self._batch12

    # -- test controls --------------------------------------------------------------------------
    def fail(self, name: str, error: cudaError_t = _INVALID, *, nth: int = 1, times: int = 1) -> None:
        """Make the ``nth`` next call of ``name`` (and the ``times - 1`` after it) return ``error``."""
        self._faults.append(_Fault(name, cudaError_t(error), nth - 1, times))

    def device_alloc(self, nbytes: int, *, device: int = 0) -> int:
        """Allocate ``nbytes`` of fake device memory (zeroed host memory) and return its address."""
        buf = (ctypes.c_char * nbytes)()
        self._buffers.append(buf)
        ptr = ctypes.addressof(buf)
        self._device.append((ptr, nbytes, device))
        return ptr

    def add_device_range(self, ptr: int, nbytes: int, *, device: int = 0) -> None:
        """Treat existing memory (e.g. a CPU tensor's bytes) as device memory."""
        self._device.append((ptr, nbytes, device))

    def calls_named(self, name: str) -> list[FakeCall]:
        return [c for c in self.calls if c.name == name]

    def pending(self, stream: Optional[int] = None) -> int:
        """Copies submitted and not yet performed (on ``stream``, or on every stream)."""
        with self.mutex:
            if stream is None:
                return sum(len(q) for q in self._queues.values())
            return len(self._queues.get(stream, []))

    def is_registered(self, ptr: int) -> bool:
        return ptr in self._registered

    def cudaSetDevice(self, device: int) -> tuple[cudaError_t]:
        """Per thread, as CUDA's: later calls of this thread are recorded on ``device``."""
        with self.mutex:
            self._thread_device[threading.get_ident()] = int(device)
        return (self._call("cudaSetDevice", device),)

    # -- internals ------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> cudaError_t:
        with self.mutex:
            return self._call_locked(name, *args)

    def _call_locked(self, name: str, *args: Any) -> cudaError_t:
        self.calls.append(FakeCall(name, args))
        self.device_log.append((name, self._thread_device.get(threading.get_ident())))
        if self.log is not None:
            self.log.append(("cudart", name, args))
        for fault in self._faults:
            if fault.name != name or fault.remaining <= 0:
                continue
            if fault.skip > 0:
                fault.skip -= 1
                continue
            fault.remaining -= 1
            return self._error(fault.error)
        return _OK

    def _enqueue(self, stream: int, copies: Sequence[tuple[int, int, int]]) -> None:
        queue = self._queues.setdefault(stream, [])
        for dst, src, n in copies:
            seq = self._seq.get(stream, 0)
            self._seq[stream] = seq + 1
            queue.append((seq, dst, src, n))

    def _execute(self, stream: int, upto: Optional[int] = None) -> None:
        """Perform ``stream``'s queued copies (those before queue position ``upto``)."""
        queue = self._queues.get(stream, [])
        while queue and (upto is None or queue[0][0] < upto):
            _, dst, src, n = queue.pop(0)
            ctypes.memmove(dst, src, n)
        if not queue:
            self._queues.pop(stream, None)

    def _error(self, err: cudaError_t) -> cudaError_t:
        self.last_error = err
        return err

    def _host_reg(self, ptr: int, nbytes: int) -> Optional[tuple[int, int, int]]:
        for start, (length, flags) in self._registered.items():
            if start <= ptr and ptr + nbytes <= start + length:
                return start, length, flags
        return None

    def _device_of(self, ptr: int, nbytes: int) -> Optional[int]:
        for start, length, device in self._device:
            if start <= ptr and ptr + nbytes <= start + length:
                return device
        return None

    def _where(self, ptr: int, nbytes: int) -> str:
        if self._device_of(ptr, nbytes) is not None:
            return "device"
        if self._host_reg(ptr, nbytes) is not None:
            return "host"
        return "device" if self.unknown_is_device else "unregistered"

    def _check_copy(self, dst: int, src: int, n: int, kind: Optional[cudaMemcpyKind]) -> bool:
        if n <= 0 or not dst or not src:
            return False
        if not self.strict:
            return True
        s, d = self._where(src, n), self._where(dst, n)
        if "unregistered" in (s, d):
            return False
        reg = self._host_reg(dst, n)
        if d == "host" and reg is not None and reg[2] & self.cudaHostRegisterReadOnly:
            return False
        if kind is None or kind == cudaMemcpyKind.cudaMemcpyDefault:
            return True
        expected = {
            cudaMemcpyKind.cudaMemcpyHostToHost: ("host", "host"),
            cudaMemcpyKind.cudaMemcpyHostToDevice: ("host", "device"),
            cudaMemcpyKind.cudaMemcpyDeviceToHost: ("device", "host"),
            cudaMemcpyKind.cudaMemcpyDeviceToDevice: ("device", "device"),
        }[cudaMemcpyKind(kind)]
        return (s, d) == expected

    # -- the cudart surface ---------------------------------------------------------------------
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
        for start, (length, _) in self._registered.items():
            if start < ptr + size and ptr < start + length:
                return (self._error(cudaError_t.cudaErrorHostMemoryAlreadyRegistered),)
        if not flags & self.cudaHostRegisterReadOnly:
            for start, length in self.readonly_ranges:
                if start < ptr + size and ptr < start + length:
                    return (self._error(_INVALID),)
        self._registered[ptr] = (size, flags)
        return (_OK,)

    def cudaHostUnregister(self, ptr: int) -> tuple[cudaError_t]:
        err = self._call("cudaHostUnregister", ptr)
        if err != _OK:
            return (err,)
        if self._registered.pop(ptr, None) is None:
            return (self._error(cudaError_t.cudaErrorHostMemoryNotRegistered),)
        return (_OK,)

    def cudaPointerGetAttributes(self, ptr: int) -> tuple[cudaError_t, Any]:
        err = self._call("cudaPointerGetAttributes", ptr)
        if err != _OK:
            return err, None
        where = self._where(ptr, 1)
        if where == "device":
            device = self._device_of(ptr, 1) or 0
            return _OK, cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeDevice, device)
        if where == "host":
            return _OK, cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeHost)
        return _OK, cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeUnregistered)

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: Any, stream: int
    ) -> tuple[cudaError_t]:
        err = self._call("cudaMemcpyAsync", dst, src, count, cudaMemcpyKind(int(kind)), stream)
        if err != _OK:
            return (err,)
        if not self._check_copy(dst, src, count, cudaMemcpyKind(int(kind))):
            return (self._error(_INVALID),)
        with self.mutex:
            self._enqueue(stream, [(dst, src, count)])
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
            if not self._check_copy(d, s, n, None):
                return self._error(_INVALID), i
        with self.mutex:
            self._enqueue(stream, list(zip(dsts, srcs, sizes)))
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
            self._execute(stream)
        return (_OK,)

    def cudaDeviceSynchronize(self) -> tuple[cudaError_t]:
        err = self._call("cudaDeviceSynchronize")
        if err != _OK:
            return (err,)
        with self.mutex:
            for stream in list(self._queues):
                self._execute(stream)
        return (_OK,)

    # -- streams and events ---------------------------------------------------------------------
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[cudaError_t, int]:
        err = self._call("cudaStreamCreateWithFlags", flags)
        if err != _OK:
            return err, 0
        with self.mutex:
            handle = self._next_stream
            self._next_stream += 1
            self._streams[handle] = int(flags)
        return _OK, handle

    def cudaStreamDestroy(self, stream: int) -> tuple[cudaError_t]:
        err = self._call("cudaStreamDestroy", stream)
        if err != _OK:
            return (err,)
        with self.mutex:
            if self._streams.pop(stream, None) is None:
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            self._execute(stream)  # destroying a stream lets its queued work finish
        return (_OK,)

    def live_streams(self) -> list[int]:
        with self.mutex:
            return sorted(self._streams)

    def cudaEventCreateWithFlags(self, flags: int) -> tuple[cudaError_t, Any]:
        err = self._call("cudaEventCreateWithFlags", flags)
        if err != _OK:
            return err, None
        with self.mutex:
            event = FakeEvent(int(flags))
            self._events.add(event)
        return _OK, event

    def _live_event(self, event: Any) -> bool:
        return isinstance(event, FakeEvent) and not event.destroyed

    def cudaEventRecord(self, event: Any, stream: int) -> tuple[cudaError_t]:
        err = self._call("cudaEventRecord", event, stream)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self._live_event(event):
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            event.stream = stream
            event.pos = self._seq.get(stream, 0)
            event.queries = 0
        return (_OK,)

    def _pending_before(self, event: FakeEvent) -> bool:
        queue = self._queues.get(event.stream, []) if event.stream is not None else []
        return bool(queue) and queue[0][0] < event.pos

    def cudaStreamWaitEvent(self, stream: int, event: Any, flags: int = 0) -> tuple[cudaError_t]:
        err = self._call("cudaStreamWaitEvent", stream, event, flags)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self._live_event(event):
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            if event.stream is not None:
                self._execute(event.stream, event.pos)
        return (_OK,)

    def cudaEventQuery(self, event: Any) -> tuple[cudaError_t]:
        err = self._call("cudaEventQuery", event)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self._live_event(event):
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            if self._pending_before(event):
                if event.queries < self.not_ready_queries:
                    event.queries += 1
                    return (cudaError_t.cudaErrorNotReady,)
                self._execute(event.stream, event.pos)
        return (_OK,)

    def cudaEventSynchronize(self, event: Any) -> tuple[cudaError_t]:
        err = self._call("cudaEventSynchronize", event)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self._live_event(event):
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            if event.stream is not None:
                self._execute(event.stream, event.pos)
        return (_OK,)

    def cudaEventDestroy(self, event: Any) -> tuple[cudaError_t]:
        err = self._call("cudaEventDestroy", event)
        if err != _OK:
            return (err,)
        with self.mutex:
            if not self._live_event(event):
                return (self._error(cudaError_t.cudaErrorInvalidResourceHandle),)
            event.destroyed = True
            self._events.discard(event)
        return (_OK,)

    def live_events(self) -> int:
        """Events created and not destroyed (a leak check for tests)."""
        with self.mutex:
            return len(self._events)
