"""`KernelPolicy`: which batches the range-copy kernel (`cacheseek.transfer.copy_kernel`) takes
on a CUDA runtime, the kernel of each device (built on first use there: a kernel lives in one
context), and its launches.

The policy: at least ``min_copies`` copies, every one device-to-device, or host-to-device
averaging at most ``h2d_max_mean_bytes`` (where the device reads registered host memory at its
host address), all 16-byte aligned: the batches the copy engines serve worst. ``mode``: None =
that policy where the kernel can be built (NVRTC; off for good, with ``unavailable`` saying why,
once it cannot), False = never, True = the policy, and the kernel must build.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import TransferError
from cacheseek.transfer.base import SubmitFailed
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.copy_kernel import CudaRangeKernel, RangeKernel, aligned, range_tables

__all__ = ["KernelPolicy"]

log = logging.getLogger("cacheseek.transfer.cuda_transfer")


class KernelPolicy:
    """The range-copy kernel's share of one runtime's batches (see the module docstring).
    ``device``: binds the calling thread to the runtime's device and returns it; ``given``: a
    kernel a test injects (used on every device)."""

    def __init__(self, cudart: Any, *, mode: Optional[bool], given: Optional[RangeKernel], min_copies: int,
                 h2d_max_mean_bytes: int, device: Callable[[], int]) -> None:
        for name, value, least in (("kernel_min_copies", min_copies, 1),
                                   ("kernel_h2d_max_mean_bytes", h2d_max_mean_bytes, 0)):
            if not isinstance(value, int) or value < least:
                raise TransferError(f"{name} must be an int >= {least}, got {value!r}")
        self._rt = cudart
        self._mode = mode
        self._given = given
        self.min_copies = min_copies
        self.h2d_max_mean_bytes = h2d_max_mean_bytes
        self._device = device
        self._kernels: dict[int, RangeKernel] = {}  # per device
        self.last: Optional[RangeKernel] = given  # the kernel last used
        self.unavailable: Optional[str] = None  # why the policy is off in auto mode
        self.batches = 0
        if mode and self.last is None:
            self.last = self._device_kernel()

    def _device_kernel(self) -> RangeKernel:
        """The kernel of the device copies go to now, built on first use there; the given one."""
        if self._given is not None:
            return self._given
        device = self._device()
        kernel = self._kernels.get(device)
        if kernel is None:
            kernel = self._kernels[device] = CudaRangeKernel(self._rt, device)
        return kernel

    def kernel_for(self, batch: CopyBatch) -> Optional[RangeKernel]:
        """The range-copy kernel when the policy gives it ``batch``, else None."""
        if self._mode is False or len(batch) < self.min_copies:
            return None
        codes = batch.codes
        d2d = codes == Direction.D2D.code
        if not d2d.all():
            h2d = codes == Direction.H2D.code
            if not (h2d | d2d).all() or int(batch.sizes[h2d].mean()) > self.h2d_max_mean_bytes:
                return None
        if not aligned(batch.dsts, batch.srcs, batch.sizes):
            return None
        try:
            kernel = self.last = self._device_kernel()
        except TransferError as exc:
            self._mode = False
            self.unavailable = str(exc)
            log.info("range-copy kernel off: %s", exc)
            return None
        if not d2d.all() and not kernel.host_readable:
            return None
        return kernel

    def submit(self, kernel: RangeKernel, batch: CopyBatch, stream: int) -> None:
        """Launch ``kernel`` over ``batch`` on ``stream``, one launch per table of copies."""
        for k, table in enumerate(range_tables(batch.dsts, batch.srcs, batch.sizes)):
            try:
                kernel.launch(table, stream)
            except TransferError as exc:
                raise SubmitFailed(-1 if k else 0, exc) from exc
        self.batches += 1
