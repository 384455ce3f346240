"""`CallLog`: what a `FakeCudart` was asked, and the faults a test armed for it.

Every call is recorded in ``calls`` (and appended to an optional shared ``log`` as
``("cudart", name, args)``, so a test can interleave it with its own events), with the device
the calling thread had set (``device_log``, for tests of device binding). `fail` arms an error
for the n-th next call of a function; `record` answers it. Not thread-safe by itself: the fake
calls it under its own mutex.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import attrs

from fakes.cudart_types import cudaError_t

__all__ = ["FakeCall", "Fault", "CallLog"]


@attrs.frozen(slots=True)
class FakeCall:
    name: str
    args: tuple


@attrs.define
class Fault:
    """``error`` for calls of ``name``: after ``skip`` more calls, the next ``remaining``."""

    name: str
    error: cudaError_t
    skip: int
    remaining: int


class CallLog:
    """The calls made so far (``calls``, ``device_log``, the shared ``log``) and the armed faults."""

    def __init__(self, log: Optional[list] = None) -> None:
        self.calls: list[FakeCall] = []
        self.log = log
        self.device_log: list[tuple[str, Optional[int]]] = []  # (call, the calling thread's device)
        self._thread_device: dict[int, int] = {}  # thread ident -> device set by cudaSetDevice
        self._faults: list[Fault] = []

    def fail(self, name: str, error: cudaError_t, *, nth: int = 1, times: int = 1) -> None:
        """Make the ``nth`` next call of ``name`` (and the ``times - 1`` after it) fail with ``error``."""
        self._faults.append(Fault(name, cudaError_t(error), nth - 1, times))

    def set_device(self, device: int) -> None:
        """The calling thread's device from now on (``cudaSetDevice``: per thread)."""
        self._thread_device[threading.get_ident()] = int(device)

    def device(self) -> int:
        """The calling thread's device (0 until it calls ``cudaSetDevice``)."""
        return self._thread_device.get(threading.get_ident(), 0)

    def record(self, name: str, args: tuple[Any, ...]) -> Optional[cudaError_t]:
        """Log one call; the error of the fault armed for it, or None."""
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
            return fault.error
        return None

    def named(self, name: str) -> list[FakeCall]:
        return [c for c in self.calls if c.name == name]
