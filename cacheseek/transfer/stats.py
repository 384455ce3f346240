"""A runtime's counters: `DirectionStats` and `TransferStats` (snapshots), `CopyCounters` (the
thread-safe totals a runtime adds each finished batch to).

A synchronous batch counts from its submission to the end of its synchronize; an asynchronous
one from its submission to the wait that saw it complete. A mixed batch's seconds are split
between its directions by bytes.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from cacheseek.transfer.batch import Direction

__all__ = ["DirectionStats", "TransferStats", "CopyCounters"]


@attrs.frozen(slots=True)
class DirectionStats:
    """Totals for one direction: bytes copied, wall seconds of the batches, copies submitted.
    An asynchronous batch counts from its submission to the wait that saw it complete."""

    bytes: int = 0
    seconds: float = 0.0
    copies: int = 0


@attrs.frozen(slots=True)
class TransferStats:
    """A snapshot of a runtime's counters. A mixed batch's seconds are split by bytes."""

    h2d: DirectionStats = DirectionStats()
    d2h: DirectionStats = DirectionStats()
    h2h: DirectionStats = DirectionStats()
    d2d: DirectionStats = DirectionStats()
    batches: int = 0
    n_registered: int = 0
    registered_bytes: int = 0
    register_seconds: float = 0.0
    registered_pieces: int = 0  # registrations behind the n_registered mappings (more when in pieces)

    def direction(self, direction: Direction) -> DirectionStats:
        return getattr(self, direction.value)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for d in Direction:
            s = self.direction(d)
            out[f"{d.value}_bytes"] = s.bytes
            out[f"{d.value}_seconds"] = s.seconds
            out[f"{d.value}_copies"] = s.copies
        out.update(batches=self.batches, n_registered=self.n_registered, registered_bytes=self.registered_bytes,
                   register_seconds=self.register_seconds, registered_pieces=self.registered_pieces)
        return out


class CopyCounters:
    """Per-direction totals and the batch count, added to once per finished batch (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs = {d: DirectionStats() for d in Direction}
        self._batches = 0

    def add(self, per_dir: dict[Direction, tuple[int, int]], seconds: float) -> None:
        """One batch of ``{direction: (bytes, copies)}`` that took ``seconds``."""
        total = sum(b for b, _ in per_dir.values())
        with self._lock:
            self._batches += 1
            for direction, (nbytes, copies) in per_dir.items():
                s = self._dirs[direction]
                share = seconds * nbytes / total if total else 0.0
                self._dirs[direction] = DirectionStats(s.bytes + nbytes, s.seconds + share, s.copies + copies)

    def snapshot(
        self, *, n_registered: int, registered_bytes: int, register_seconds: float, registered_pieces: int = 0
    ) -> TransferStats:
        """The totals so far, with the registration figures given."""
        with self._lock:
            return TransferStats(h2d=self._dirs[Direction.H2D], d2h=self._dirs[Direction.D2H],
                                 h2h=self._dirs[Direction.H2H], d2d=self._dirs[Direction.D2D], batches=self._batches,
                                 n_registered=n_registered, registered_bytes=registered_bytes,
                                 register_seconds=register_seconds, registered_pieces=registered_pieces)
