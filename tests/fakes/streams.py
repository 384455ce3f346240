"""`FakeStreams`: the queues of copies and the events of a `FakeCudart`.

What it models, so tests see the ordering bugs a GPU would show:

- copies are queued per stream at submission and performed only when something waits for them
  (a stream or device synchronize, an event synchronize, a stream waiting on an event, a
  stream's destruction): reading a destination before that sees old bytes;
- an event marks a stream's queue position (``cudaEventRecord``); waiting on it performs the
  marked stream's copies up to that position;
- a query of an event with copies still queued before it answers "not ready"
  ``not_ready_queries`` times, then performs them (the device "progresses" when polled);
- streams made here get handles from 1000 up.

Queue entries are ``(seq, dst, src, nbytes)``, ``seq`` counting per stream. Not thread-safe by
itself: the fake calls it under its own mutex.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["FakeEvent", "FakeStreams"]


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


class FakeStreams:
    """Per-stream copy queues, the streams created, and the live events (module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[int, list[tuple[int, int, int, int]]] = {}  # (seq, dst, src, n)
        self._seq: dict[int, int] = {}
        self._created: dict[int, int] = {}  # created stream -> flags
        self._next_stream = 1000
        self._events: set[FakeEvent] = set()

    # -- copies ---------------------------------------------------------------------------------
    def enqueue(self, stream: int, copies: Sequence[tuple[int, int, int]]) -> None:
        queue = self._queues.setdefault(stream, [])
        for dst, src, n in copies:
            seq = self._seq.get(stream, 0)
            self._seq[stream] = seq + 1
            queue.append((seq, dst, src, n))

    def execute(self, stream: int, upto: Optional[int] = None) -> None:
        """Perform ``stream``'s queued copies (those before queue position ``upto``)."""
        queue = self._queues.get(stream, [])
        while queue and (upto is None or queue[0][0] < upto):
            _, dst, src, n = queue.pop(0)
            ctypes.memmove(dst, src, n)
        if not queue:
            self._queues.pop(stream, None)

    def execute_all(self) -> None:
        for stream in list(self._queues):
            self.execute(stream)

    def pending(self, stream: Optional[int] = None) -> int:
        """Copies submitted and not yet performed (on ``stream``, or on every stream)."""
        if stream is None:
            return sum(len(q) for q in self._queues.values())
        return len(self._queues.get(stream, []))

    # -- streams --------------------------------------------------------------------------------
    def create(self, flags: int) -> int:
        handle = self._next_stream
        self._next_stream += 1
        self._created[handle] = int(flags)
        return handle

    def destroy(self, stream: int) -> bool:
        """Forget a created stream, letting its queued work finish; False if it is unknown."""
        if self._created.pop(stream, None) is None:
            return False
        self.execute(stream)
        return True

    def live_streams(self) -> list[int]:
        return sorted(self._created)

    # -- events ---------------------------------------------------------------------------------
    def new_event(self, flags: int) -> FakeEvent:
        event = FakeEvent(int(flags))
        self._events.add(event)
        return event

    @staticmethod
    def is_live(event: Any) -> bool:
        return isinstance(event, FakeEvent) and not event.destroyed

    def record(self, event: FakeEvent, stream: int) -> None:
        event.stream = stream
        event.pos = self._seq.get(stream, 0)
        event.queries = 0

    def reach(self, event: FakeEvent) -> None:
        """Perform the copies the event marks (those queued before it on its stream)."""
        if event.stream is not None:
            self.execute(event.stream, event.pos)

    def query(self, event: FakeEvent, not_ready_queries: int) -> bool:
        """Has the event been reached? "Not ready" ``not_ready_queries`` times while copies are
        queued before it, then it is reached."""
        queue = self._queues.get(event.stream, []) if event.stream is not None else []
        if queue and queue[0][0] < event.pos:
            if event.queries < not_ready_queries:
                event.queries += 1
                return False
            self.execute(event.stream, event.pos)
        return True

    def destroy_event(self, event: FakeEvent) -> None:
        event.destroyed = True
        self._events.discard(event)

    def live_events(self) -> int:
        return len(self._events)
