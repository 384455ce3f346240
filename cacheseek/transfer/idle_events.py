"""`IdleEvents`: released CUDA events kept for reuse, per device.

Why: creating an event costs the driver tens of microseconds, and a restore that lasts a few
milliseconds made two. A released event may still be pending; recording it again is allowed (a
wait already queued keeps the earlier record), so a released event can serve the next batch. An
event is kept only for the device it was made on (a module, a stream and an event live in one
context), and at most ``limit`` a device.

    pool = IdleEvents(limit=16)
    pool.take(device) -> event | None    a kept event of that device, or None: make one
    pool.made(event, device)             a new event: remember its device
    pool.give(event) -> bool             kept; False: the caller destroys it (unknown, full, draining)
    pool.drain() -> list                 every kept event, for the caller to destroy; gives refused after
    len(pool)                            events kept now

Thread-safe: list and dict operations of one step each, under the interpreter's lock.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["IdleEvents", "IDLE_EVENTS"]

IDLE_EVENTS = 16  # kept per device by default


class IdleEvents:
    """See the module docstring."""

    def __init__(self, limit: int = IDLE_EVENTS) -> None:
        self.limit = limit
        self._kept: dict[int, list[Any]] = {}  # device -> events
        self._device: dict[int, int] = {}  # id(event) -> its device, for every live event made here
        self._draining = False

    def take(self, device: int) -> Optional[Any]:
        kept = self._kept.get(device)
        if kept:
            try:
                return kept.pop()
            except IndexError:  # another thread took the last one
                pass
        return None

    def made(self, event: Any, device: int) -> None:
        self._device[id(event)] = device

    def give(self, event: Any) -> bool:
        device = self._device.get(id(event))
        if device is not None and not self._draining:
            kept = self._kept.setdefault(device, [])
            if len(kept) < self.limit:
                kept.append(event)
                return True
        self._device.pop(id(event), None)
        return False

    def drain(self) -> list[Any]:
        self._draining = True
        kept, self._kept = self._kept, {}
        events = [e for events in kept.values() for e in events]
        for e in events:
            self._device.pop(id(e), None)
        return events

    def __len__(self) -> int:
        return sum(len(v) for v in self._kept.values())
