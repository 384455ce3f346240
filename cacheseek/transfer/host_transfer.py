"""`HostTransferRuntime`: the transfer contract on plain host memory (``ctypes.memmove``).

For CPU runtimes (CI, CPU-only users): "device ranges" are the bytes of CPU tensors, host
mappings are a Plan store's segments. Every copy is done at submission, so ``synchronize`` has
nothing to wait for, streams are tokens and every event is complete when it is recorded;
validation, registration bookkeeping and stats are those of every runtime.
"""

from __future__ import annotations

import ctypes
from typing import Any

from cacheseek.registry import TRANSFERS
from cacheseek.transfer.base import SubmitFailed, TransferRuntimeBase
from cacheseek.transfer.batch import CopyBatch
from cacheseek.transfer.memory import HostMapping
from cacheseek.transfer.registrations import Registration

__all__ = ["HostTransferRuntime"]


@TRANSFERS.register("host")
class HostTransferRuntime(TransferRuntimeBase):
    """Copies with memmove between registered host mappings and declared CPU-tensor ranges."""

    device_kind = "cpu"
    tensor_device_type = "cpu"

    def _register_one(self, mapping: HostMapping) -> tuple[bool, bool]:
        return True, not mapping.writable

    def _unregister_one(self, registration: Registration) -> None:
        return None

    def _submit(self, batch: CopyBatch, stream: Any) -> None:
        memmove = ctypes.memmove
        for i, (dst, src, n) in enumerate(zip(batch.dsts.tolist(), batch.srcs.tolist(), batch.sizes.tolist())):
            try:
                memmove(dst, src, n)
            except Exception as exc:  # memmove raises only on bad arguments
                raise SubmitFailed(i, exc) from exc

    def _synchronize(self, stream: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"HostTransferRuntime(registered={len(self.registered())})"
