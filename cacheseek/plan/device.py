"""`DevicePlanClient` (Plan client ``device``): the embedded Plan store with its values in a pool
of the runtime device's memory: a CUDA tensor on a GPU (HBM), a CPU tensor with ``device="cpu"``.

It is the HBM tier's value store. Everything but the segment is `EmbeddedPlanClient`'s, inherited
unchanged: the key index, the first-fit allocator, the reader counts (a remove frees a value's
bytes only when its last reader has released its views), the FXPLANV1 tables (kept in host
memory: the caller decodes them on the host) and the lifecycles of `cacheseek.plan.base`. The
segment is one ``torch.empty(capacity, uint8, device)`` allocated by
``wait_local_segments_ready`` and reported with ``on_device=True``: the Plan tier declares it as
a device range and copies in and out of it device to device, never registers it with the host.

Capacity: ``segment_bytes`` > 0, or ``capacity_fraction`` of the device's free memory when the
client is built (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo).
A reservation that does not fit raises `StoreFullError`, as the embedded store does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cacheseek.errors import ConfigError, PlanError
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import device_free_bytes

__all__ = ["DevicePlanClient", "device_pool_bytes", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(device: Any) -> Any:
    """``device`` as a torch device; a bare "cuda" becomes the current CUDA device."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_pool_bytes(segment_bytes: int, capacity_fraction: float, device: Any) -> int:
    """The pool size: ``segment_bytes`` when > 0, else ``capacity_fraction`` of free memory."""
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 0:
        raise ConfigError("store.capacity_bytes", f"must be an int >= 0, got {segment_bytes!r}")
    fraction_ok = isinstance(capacity_fraction, (int, float)) and not isinstance(capacity_fraction, bool)
    if not fraction_ok or not 0.0 <= capacity_fraction < 1.0:
        raise ConfigError("store.capacity_fraction", f"must be a number in [0, 1), got {capacity_fraction!r}")
    if segment_bytes > 0:
        if capacity_fraction:
            raise ConfigError("store.capacity_fraction", "is set together with store.capacity_bytes",
                              "give one of them")
        return segment_bytes
    if not capacity_fraction:
        raise ConfigError("store.capacity_bytes", "the HBM pool has no size",
                          "set store.capacity_bytes (bytes) or store.capacity_fraction (of free memory)")
    return int(device_free_bytes(device) * capacity_fraction)


class _DeviceSegment:
    """The value pool: one uint8 tensor on the device; the segment timers of an embedded one."""

    def __init__(self, length: int, device: Any) -> None:
        t0 = time.perf_counter()
        self.tensor: Any = torch.empty(length, dtype=torch.uint8, device=device)
        self.ptr = int(self.tensor.data_ptr())
        self.length = length
        self.map_seconds = time.perf_counter() - t0
        self.fault_seconds = 0.0
        self.fault_method = "none"
        self.threads = 0
        self.huge_bytes = -1

    def close(self) -> None:
        self.tensor = None


@PLAN_CLIENTS.register("device")
class DevicePlanClient(EmbeddedPlanClient):
    """The embedded Plan store over a device-memory pool (see the module docstring)."""

    _client_name = "device Plan store"
    _on_device = True

    def __init__(
        self,
        segment_bytes: int = 0,
        capacity_fraction: float = 0.0,
        device: Any = "cpu",
        alignment: int = 256,
        table_arena_bytes: int = 1 << 20,
    ) -> None:
        self.device = resolve_device(device)
        size = device_pool_bytes(segment_bytes, capacity_fraction, self.device)
        if size < alignment:
            raise ConfigError("store.capacity_bytes", f"the HBM pool would hold {size} B",
                              f"give at least {alignment} B")
        super().__init__(size, backing="private", hugepages=False, alignment=alignment,
                         table_arena_bytes=table_arena_bytes, prefault=False)

    def _new_segment(self, prefault: bool) -> _DeviceSegment:  # device memory: nothing to fault
        seg = _DeviceSegment(self.segment_bytes, self.device)
        log.info("device Plan pool: %.2f GiB on %s in %.3f s", seg.length / 2**30, self.device, seg.map_seconds)
        return seg

    def value_tensor(self, ptr: int, nbytes: int) -> Any:
        """A uint8 view of ``nbytes`` of the pool at address ``ptr`` (a value pointer this client
        handed out, while the caller holds it). Raises `PlanError` outside the pool."""
        with self._lock:
            seg = self._ensure_segment()
            off = ptr - seg.ptr
            if off < 0 or nbytes <= 0 or off + nbytes > seg.length:
                raise PlanError(f"[{ptr:#x}, +{nbytes}) is not inside the device pool")
            return seg.tensor[off : off + nbytes]
