"""Small values copied out of a store's memory into host memory the caller owns.

A restored chunk's frames (13.7 MiB at 480p) are read on every served chunk and consumed on the
host (their digest, then the PIL images), so the copy out of the store's memory is on the request
path. Two copies were on it per read of the HBM tier: a pageable device-to-host copy (CUDA stages
it through a bounce buffer and the caller's current stream is synchronized, so it waits for any
work queued there) into a fresh allocation, then ``bytes`` of that (a second fresh allocation,
page-faulted as it is written). Here:

- `from_device`: a CUDA view lands in a pinned host block of torch's caching host allocator (the
  same block comes back read after read once the previous value is dropped: no page faults), by
  one asynchronous copy on a side stream of the view's device, synchronized alone (no unrelated
  work waits); a CPU view (a pool in host memory, ``device=cpu``) is copied once into owned memory;
- `from_host`: ``size`` bytes at a host address, into a pinned block the same way where CUDA is in
  use in this process (the Plan tier's values on a GPU host), else one ``bytes`` copy.

Each returns memory the caller owns, valid after the store's views are released: a flat uint8
CPU tensor (pinned) where CUDA is in use, else ``bytes`` (as the Plan tier's raw reads always
returned: a CPU-only process sees no change). Not part of any store: the Plan tier's reader calls
it for raw reads.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

__all__ = ["from_device", "from_host"]

_streams: dict[Any, Any] = {}  # device -> the side stream of raw reads
_lock = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


def from_device(view: torch.Tensor) -> Any:
    """The bytes of ``view`` (a contiguous uint8 tensor whose writes were synchronized before it
    was published), owned by the caller; see the module docstring."""
    if view.device.type != "cuda":
        return bytes(view.detach().reshape(-1).numpy())
    out = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=True)
    stream = _side_stream(view.device)
    with torch.cuda.stream(stream):
        out.copy_(view.reshape(-1), non_blocking=True)
    stream.synchronize()
    return out


def from_host(ptr: int, size: int) -> Any:
    """``size`` bytes at host address ``ptr`` (readable for the call) as an owned buffer."""
    if size > 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
        out = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        ctypes.memmove(out.data_ptr(), ptr, size)
        return out
    return ctypes.string_at(ptr, size)
