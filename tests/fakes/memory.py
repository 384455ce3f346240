"""`FakeMemory`: where an address lives for a `FakeCudart`, and which copies it allows.

"Device memory" is ordinary host memory the test declares (`alloc`, `add_device_range`), so
bytes really move on a CPU machine. Host memory counts once registered (`register`, as
``cudaHostRegister``: an overlap answers ``cudaErrorHostMemoryAlreadyRegistered``; a range in
``readonly_ranges`` refuses default flags, like a read-only MAP_SHARED mapping on the H200, and
accepts ``cudaHostRegisterReadOnly``).

With ``strict`` (default) `check_copy` refuses a copy whose source or destination is neither
registered host memory nor declared device memory, whose kind contradicts where they live, or
that writes a read-only registration. A host side must lie inside ONE registration: a range that
crosses from one registration into the next (two pieces of a segment registered in pieces) is
refused like unregistered memory, as CUDA treats it as not pinned; so tests prove the runtime
cut such a copy at the joint (`cacheseek.transfer.joints`). ``unknown_is_device=True`` treats every address that is
not registered host memory as device memory (convenient when CPU tensors stand in for CUDA
tensors). Not thread-safe by itself: the fake calls it under its own mutex.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from fakes.cudart_types import (

    cudaError_t,
    cudaHostRegisterReadOnly,
    cudaMemcpyKind,
    cudaMemoryType,
    cudaPointerAttributes,
)

__all__ = ["FakeMemory"]

_EXPECTED = {  # kind -> (where the source lives, where the destination lives)
    cudaMemcpyKind.cudaMemcpyHostToHost: ("host", "host"),
    cudaMemcpyKind.cudaMemcpyHostToDevice: ("host", "device"),
    cudaMemcpyKind.cudaMemcpyDeviceToHost: ("device", "host"),
    cudaMemcpyKind.cudaMemcpyDeviceToDevice: ("device", "device"),
}


class FakeMemory:
    """Registered host ranges (``registered``: ptr -> (length, flags)) and declared device ranges."""

    def __init__(self, *, strict: bool = True, unknown_is_device: bool = False) -> None:
        self.strict = strict
        self.unknown_is_device = unknown_is_device
        self.readonly_ranges: list[tuple[int, int]] = []
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (length, flags)
        self._device: list[tuple[int, int, int]] = []  # (ptr, length, device)
        self._buffers: list[Any] = []

    def alloc(self, nbytes: int, *, device: int = 0) -> int:
        """``nbytes`` of fake device memory (zeroed host memory); returns its address."""
        buf = (ctypes.c_char * nbytes)()
        self._buffers.append(buf)
        ptr = ctypes.addressof(buf)
        self._device.append((ptr, nbytes, device))
        return ptr

    def add_device_range(self, ptr: int, nbytes: int, *, device: int = 0) -> None:
        """Treat existing memory (e.g. a CPU tensor's bytes) as device memory."""
        self._device.append((ptr, nbytes, device))

    def register(self, ptr: int, size: int, flags: int) -> cudaError_t:
        for start, (length, _) in self.registered.items():
            if start < ptr + size and ptr < start + length:
                return cudaError_t.cudaErrorHostMemoryAlreadyRegistered
        if not flags & cudaHostRegisterReadOnly:
            for start, length in self.readonly_ranges:
                if start < ptr + size and ptr < start + length:
                    return cudaError_t.cudaErrorInvalidValue
        self.registered[ptr] = (size, flags)
        return cudaError_t.cudaSuccess

    def unregister(self, ptr: int) -> cudaError_t:
        if self.registered.pop(ptr, None) is None:
            return cudaError_t.cudaErrorHostMemoryNotRegistered
        return cudaError_t.cudaSuccess

    def host_registration(self, ptr: int, nbytes: int) -> Optional[tuple[int, int, int]]:
        """``(start, length, flags)`` of the registration holding the range, or None."""
        for start, (length, flags) in self.registered.items():
            if start <= ptr and ptr + nbytes <= start + length:
                return start, length, flags
        return None

    def device_of(self, ptr: int, nbytes: int) -> Optional[int]:
        for start, length, device in self._device:
            if start <= ptr and ptr + nbytes <= start + length:
                return device
        return None

    def where(self, ptr: int, nbytes: int) -> str:
        """"device", "host" (inside one registration) or "unregistered" (also a range that
        touches registered memory without lying inside one registration: it spans two)."""
        if self.device_of(ptr, nbytes) is not None:
            return "device"
        if self.host_registration(ptr, nbytes) is not None:
            return "host"
        if any(start < ptr + nbytes and ptr < start + length for start, (length, _) in self.registered.items()):
            return "unregistered"
        return "device" if self.unknown_is_device else "unregistered"

    def pointer_attributes(self, ptr: int) -> cudaPointerAttributes:
        where = self.where(ptr, 1)
        if where == "device":
            return cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeDevice, self.device_of(ptr, 1) or 0)
        if where == "host":
            return cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeHost)
        return cudaPointerAttributes(cudaMemoryType.cudaMemoryTypeUnregistered)

    def check_copy(self, dst: int, src: int, n: int, kind: Optional[cudaMemcpyKind]) -> bool:
        """May ``n`` bytes go from ``src`` to ``dst`` as ``kind`` (None: any)? (module docstring)"""
        if n <= 0 or not dst or not src:
            return False
        if not self.strict:
            return True
        s, d = self.where(src, n), self.where(dst, n)
        if "unregistered" in (s, d):
            return False
        reg = self.host_registration(dst, n)
        if d == "host" and reg is not None and reg[2] & cudaHostRegisterReadOnly:
            return False
        if kind is None or kind == cudaMemcpyKind.cudaMemcpyDefault:
            return True
        return (s, d) == _EXPECTED[cudaMemcpyKind(kind)]
