"""Transfer runtimes: validated batches of copies between registered host memory and device memory.

Registered in `cacheseek.registry.TRANSFERS`:

- ``host``: `HostTransferRuntime` (memmove; CPU runtimes, CI);
- ``cuda``: `CudaTransferRuntime` (cuda-bindings, imported only when one is built);
- ``auto``: `auto_transfer_runtime`, the CUDA runtime when ``device`` is a CUDA device, else host.

Importing this package needs neither torch nor CUDA.
"""

from __future__ import annotations

from typing import Any, Optional

from cacheseek.registry import TRANSFERS
from cacheseek.transfer.batch import CopyDescriptor, Direction
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.protocol import TransferRuntime
from cacheseek.transfer.stats import DirectionStats, TransferStats
from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
from cacheseek.transfer.host_transfer import HostTransferRuntime

__all__ = ["CopyDescriptor", "Direction", "DirectionStats", "HostMapping", "MemoryRange", "TransferRuntime",
           "TransferStats", "HostTransferRuntime", "CudaTransferRuntime", "auto_transfer_runtime"]


def auto_transfer_runtime(
    device: Any = "cpu", *, use_batch_api: Optional[bool] = None, copy_kernel: Optional[bool] = None
) -> TransferRuntime:
    """The transfer runtime for tensors on ``device`` (a string such as "cuda:0" or a torch
    device): `CudaTransferRuntime` for CUDA (bound to ``cuda:N`` when the device names an
    index; ``use_batch_api`` and ``copy_kernel`` as it documents), `HostTransferRuntime`
    otherwise."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    if kind == "cuda":
        return CudaTransferRuntime(use_batch_api=use_batch_api, copy_kernel=copy_kernel, device=str(device))
    return HostTransferRuntime()


TRANSFERS.register("auto")(auto_transfer_runtime)
