"""`CudaTransferRuntime`: the transfer contract on CUDA, through cuda-bindings' ``cudart``.

- Registration: ``cudaHostRegister`` with default flags; on failure the sticky last error is
  cleared (``cudaGetLastError``) and a read-only mapping is retried with
  ``cudaHostRegisterReadOnly`` (a read-only MAP_SHARED mapping of a /dev/shm file registers only
  that way). ``cudaErrorHostMemoryAlreadyRegistered`` is success; such a registration belongs to
  someone else and is never unregistered here.
- Copies go on the stream given (None: the caller's current torch CUDA stream). Where the bindings
  offer ``cudaMemcpyBatchAsync`` and the stream is not the legacy default stream (which that call
  refuses), the batch is a few calls (`MemcpyBatch`: 32 copies first, so the engine starts
  while the rest is converted, then doubling up to ``max_batch``); otherwise one
  ``cudaMemcpyAsync`` per copy. `copy_batch` then synchronizes the stream once; `submit_batch` records an event instead.
- Streams of its own (`new_stream`) are created with ``cudaStreamNonBlocking``: they never wait
  for the legacy default stream (where PyTorch computes by default) nor block it, so copies on
  them overlap compute. Ordering across streams is explicit: events (``cudaEventRecord``,
  ``cudaStreamWaitEvent``), created with ``cudaEventDisableTiming``.
- Device ranges not declared by the caller are checked with ``cudaPointerGetAttributes``.
- The range-copy kernel (`cacheseek.transfer.copy_kernel`) takes the batches that the copy
  engines serve worst (`KernelPolicy`: ``kernel_min_copies``, ``kernel_h2d_max_mean_bytes``,
  ``copy_kernel``). It is one launch per 1024 copies instead of a descriptor each.

``cudart`` is injectable (tests/fakes/cudart.py `FakeCudart` in CPU tests); the real module
is imported only when none is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import RegistrationError, TransferError
from cacheseek.registry import TRANSFERS
from cacheseek.transfer.base import SubmitFailed, TransferRuntimeBase
from cacheseek.transfer.batch import DIRECTIONS, CopyBatch, Direction
from cacheseek.transfer.copy_kernel import RangeKernel
from cacheseek.transfer.cuda_bindings import coerce_stream, device_index, import_cudart, torch_current_stream
from cacheseek.transfer.idle_events import IdleEvents
from cacheseek.transfer.kernel_policy import KernelPolicy
from cacheseek.transfer.memcpy_batch import MemcpyBatch
from cacheseek.transfer.memory import HostMapping
from cacheseek.transfer.pending import Event
from cacheseek.transfer.registrations import Registration

__all__ = ["CudaTransferRuntime"]

log = logging.getLogger(__name__)

_LEGACY_STREAMS = (0, 1)  # the NULL stream and cudaStreamLegacy


@TRANSFERS.register("cuda", objects=("cudart", "current_stream", "tensor_device_type", "device", "range_kernel"))
class CudaTransferRuntime(TransferRuntimeBase):
    """Batched copies between registered host mappings and CUDA memory.

    ``cudart``: the bindings module (None: import cuda-bindings). ``current_stream``: returns the
    raw handle used when ``copy_batch`` gets no stream (None: torch's current stream).
    ``use_batch_api``: None = where offered, False = never, True = required.
    ``tensor_device_type``: the torch device type of device tensors ("cuda"; tests that run
    the fake cudart over CPU memory pass "cpu"). ``max_batch``: copies per batched call.
    ``device``: the runtime's device (``"cuda:N"``, ``N`` or None for the calling thread's
    current one). With an index, every call that creates or uses CUDA state here (streams,
    events, registrations, submissions, waits) first makes that device current on the calling
    thread (``cudaSetDevice``, per thread and cheap), and worker threads call `bind_thread` when
    they start, so no context is ever created on another GPU (device 0 by default).
    """

    device_kind = "cuda"

    def __init__(
        self,
        *,
        cudart: Any = None,
        current_stream: Optional[Callable[[], int]] = None,
        use_batch_api: Optional[bool] = None,
        tensor_device_type: str = "cuda",
        max_batch: int = 4096,
        device: Any = None,
        copy_kernel: Optional[bool] = None,
        kernel_min_copies: int = 8,
        kernel_h2d_max_mean_bytes: int = 0,
        range_kernel: Optional[RangeKernel] = None,
    ) -> None:
        super().__init__()
        self.device_index = device_index(device)
        if not isinstance(max_batch, int) or max_batch < 1:
            raise TransferError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self._rt = cudart if cudart is not None else import_cudart()
        self._current_stream = current_stream or torch_current_stream
        self.tensor_device_type = tensor_device_type
        err = self._rt.cudaError_t
        self._ok = err.cudaSuccess
        self._already = err.cudaErrorHostMemoryAlreadyRegistered
        self._not_ready = getattr(err, "cudaErrorNotReady", None)
        batch_fn = None if use_batch_api is False else getattr(self._rt, "cudaMemcpyBatchAsync", None)
        if use_batch_api and batch_fn is None:
            raise TransferError("use_batch_api=True but these cuda bindings lack cudaMemcpyBatchAsync")
        self._batch = None if batch_fn is None else MemcpyBatch(
            self._rt, batch_fn, max_batch, name=self._name, clear=self._clear_last_error, synchronize=self._synchronize)
        kind = self._rt.cudaMemcpyKind
        by_direction = {Direction.H2D: kind.cudaMemcpyHostToDevice, Direction.D2H: kind.cudaMemcpyDeviceToHost,
                        Direction.H2H: kind.cudaMemcpyHostToHost, Direction.D2D: kind.cudaMemcpyDeviceToDevice}
        self._kind_by_code = [by_direction[d] for d in DIRECTIONS]  # indexed by Direction.code
        self._stream_flags = getattr(self._rt, "cudaStreamNonBlocking", 1)
        self._event_flags = getattr(self._rt, "cudaEventDisableTiming", 2)
        self._idle = IdleEvents()  # released events kept for reuse
        # auto mode builds the real kernel only over the real bindings (an injected cudart is a
        # test's fake: it gets the kernel it is given, or none)
        self._kernels = KernelPolicy(
            self._rt, mode=copy_kernel if (cudart is None or range_kernel is not None or copy_kernel) else False,
            given=range_kernel if copy_kernel is not False else None, min_copies=kernel_min_copies,
            h2d_max_mean_bytes=kernel_h2d_max_mean_bytes, device=self._bound_device)

    def bind_thread(self) -> None:
        """Make the runtime's device current on the calling thread (no-op without an index)."""
        if self.device_index is not None:
            set_device = getattr(self._rt, "cudaSetDevice", None)
            if set_device is not None:
                self._check(set_device(self.device_index)[0], f"cudaSetDevice({self.device_index})")

    def _bound_device(self) -> int:
        """The device copies go to now (the runtime's, else the thread's current one), the
        calling thread bound to it."""
        self.bind_thread()
        return self._current_device()

    @property
    def range_kernel(self) -> Optional[RangeKernel]:
        """The range-copy kernel last used (None: none yet, or off)."""
        return self._kernels.last

    @property
    def kernel_batches(self) -> int:
        """Batches the range-copy kernel took."""
        return self._kernels.batches

    @property
    def kernel_min_copies(self) -> int:
        return self._kernels.min_copies

    @property
    def kernel_h2d_max_mean_bytes(self) -> int:
        return self._kernels.h2d_max_mean_bytes

    @property
    def kernel_unavailable(self) -> Optional[str]:
        """Why the range-copy kernel is off in auto mode (None: it is not)."""
        return self._kernels.unavailable

    @property
    def batch_api(self) -> bool:
        """True while batches on non-legacy streams go through ``cudaMemcpyBatchAsync``."""
        return self._batch is not None

    # -- helpers --------------------------------------------------------------------------------
    def _name(self, err: Any) -> str:
        try:
            return self._rt.cudaGetErrorName(err)[1].decode()
        except Exception:
            return str(err)

    def _clear_last_error(self) -> None:
        self._rt.cudaGetLastError()

    # -- registration ---------------------------------------------------------------------------
    def _register_one(self, mapping: HostMapping) -> tuple[bool, bool]:
        self.bind_thread()
        rt = self._rt
        (err,) = rt.cudaHostRegister(mapping.ptr, mapping.length, rt.cudaHostRegisterDefault)[:1]
        if err == self._ok:
            return True, False
        self._clear_last_error()
        if err == self._already:
            return False, not mapping.writable
        if mapping.writable:
            raise RegistrationError(f"cudaHostRegister of writable mapping {mapping} failed: {self._name(err)}")
        (err_ro,) = rt.cudaHostRegister(mapping.ptr, mapping.length, rt.cudaHostRegisterReadOnly)[:1]
        if err_ro == self._ok:
            return True, True
        self._clear_last_error()
        if err_ro == self._already:
            return False, True
        raise RegistrationError(f"cudaHostRegister of read-only mapping {mapping} failed: default flags "
                                f"{self._name(err)}, read-only flags {self._name(err_ro)}")

    def _unregister_one(self, registration: Registration) -> None:
        (err,) = self._rt.cudaHostUnregister(registration.mapping.ptr)[:1]
        if err != self._ok:
            self._clear_last_error()
            raise RegistrationError(f"cudaHostUnregister of {registration.mapping} failed: {self._name(err)}")

    def _is_device_memory(self, ptr: int, nbytes: int) -> bool:
        device = None
        for p in (ptr, ptr + nbytes - 1):
            err, attrs = self._rt.cudaPointerGetAttributes(p)[:2]
            if err != self._ok:
                self._clear_last_error()
                return False
            if attrs.type != self._rt.cudaMemoryType.cudaMemoryTypeDevice:
                return False
            if device is not None and attrs.device != device:
                return False
            device = attrs.device
        return True

    # -- copies ---------------------------------------------------------------------------------
    def _resolve_stream(self, stream: Any) -> int:
        handle = coerce_stream(stream)
        return int(self._current_stream()) if handle is None else handle

    def fast_on(self, batch: CopyBatch, stream: Any = None) -> bool:
        """Whether ``batch`` submitted on ``stream`` (None: the caller's current stream) runs as
        fast as on a stream of the runtime's own: the range-copy kernel takes it, or the batch
        API is offered there (the legacy default stream refuses it). A restore then goes straight
        on the producer stream, ordered by the stream itself, with no events to make and wait
        for."""
        if self._kernels.kernel_for(batch) is not None:
            return True
        return self._batch is not None and self._resolve_stream(stream) not in _LEGACY_STREAMS

    def _submit(self, batch: CopyBatch, stream: int) -> None:
        self.bind_thread()
        kernel = self._kernels.kernel_for(batch)
        if kernel is not None:
            return self._kernels.submit(kernel, batch, stream)
        if self._batch is not None and stream not in _LEGACY_STREAMS:
            left = self._batch.submit(batch, stream)
            if left is None:
                return
            self._batch = None  # the driver does not support the call: the loop takes over for good
            return self._submit_loop(batch, stream, start=left)
        self._submit_loop(batch, stream)

    def _submit_loop(self, batch: CopyBatch, stream: int, start: int = 0) -> None:
        memcpy = self._rt.cudaMemcpyAsync
        kinds = self._kind_by_code
        dsts, srcs, sizes, codes = (a[start:].tolist() for a in (batch.dsts, batch.srcs, batch.sizes, batch.codes))
        n = len(batch)
        for j, (dst, src, size, code) in enumerate(zip(dsts, srcs, sizes, codes)):
            (err,) = memcpy(dst, src, size, kinds[code], stream)[:1]
            if err != self._ok:
                self._clear_last_error()
                i = start + j
                raise SubmitFailed(i, TransferError(f"cudaMemcpyAsync {i} of {n} ({batch.direction(i).value}, "
                                                    f"{size} B) failed: {self._name(err)}"))

    # -- streams and events ---------------------------------------------------------------------
    def _check(self, err: Any, what: str) -> None:
        if err != self._ok:
            self._clear_last_error()
            raise TransferError(f"{what} failed: {self._name(err)}")

    def _new_stream(self) -> int:
        self.bind_thread()
        err, stream = self._rt.cudaStreamCreateWithFlags(self._stream_flags)[:2]
        self._check(err, "cudaStreamCreateWithFlags(cudaStreamNonBlocking)")
        return int(stream)

    def _destroy_stream(self, stream: Any) -> None:
        self._check(self._rt.cudaStreamDestroy(stream)[0], "cudaStreamDestroy")

    def _new_event(self) -> Any:
        """A kept event of the current device (`IdleEvents`), else a new one."""
        self.bind_thread()
        device = self._current_device()
        event = self._idle.take(device)
        if event is not None:
            return event
        err, event = self._rt.cudaEventCreateWithFlags(self._event_flags)[:2]
        self._check(err, "cudaEventCreateWithFlags(cudaEventDisableTiming)")
        self._idle.made(event, device)
        return event

    def _current_device(self) -> int:
        if self.device_index is not None:
            return self.device_index
        err, device = self._rt.cudaGetDevice()[:2]
        self._check(err, "cudaGetDevice")
        return int(device)

    @property
    def idle_events(self) -> int:
        """Released events kept for reuse now (`cacheseek.transfer.idle_events`)."""
        return len(self._idle)

    def _record(self, event: Any, stream: Any) -> None:
        self._check(self._rt.cudaEventRecord(event, stream)[0], "cudaEventRecord")

    def _stream_wait_event(self, stream: Any, event: Any) -> None:
        self._check(self._rt.cudaStreamWaitEvent(stream, event, 0)[0], "cudaStreamWaitEvent")

    def _event_query(self, event: Event) -> bool:
        if event.released or event.handle is None:
            return True
        err = self._rt.cudaEventQuery(event.handle)[0]
        if err == self._ok:
            return True
        if self._not_ready is not None and err == self._not_ready:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def _event_synchronize(self, event: Event) -> None:
        if event.released or event.handle is None:
            return
        self._check(self._rt.cudaEventSynchronize(event.handle)[0], "cudaEventSynchronize")

    def _destroy_event(self, event: Any) -> None:
        if not self._idle.give(event) and self._rt.cudaEventDestroy(event)[0] != self._ok:
            self._clear_last_error()

    def close(self) -> None:
        """Destroy the kept events, then what every runtime does (`TransferRuntimeBase.close`)."""
        for event in self._idle.drain():  # events released from now on are destroyed at once
            if self._rt.cudaEventDestroy(event)[0] != self._ok:
                self._clear_last_error()
        super().close()

    def _synchronize(self, stream: int) -> None:
        (err,) = self._rt.cudaStreamSynchronize(stream)[:1]
        if err != self._ok:
            raise TransferError(f"cudaStreamSynchronize failed: {self._name(err)}")

    def __repr__(self) -> str:
        return (f"CudaTransferRuntime(batch_api={self.batch_api}, kernel={self._kernels.last!r}, "
                f"registered={len(self.registered())})")
