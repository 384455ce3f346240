"""The byte accounting of a generic tier: what every value it holds (or is writing) weighs, against
its capacity.

A write reserves its values' bytes before anything is written or queued (`reserve`): above the
capacity it is refused with `StoreFullError`, changing nothing, so usage never exceeds the
capacity. A failed write gives its bytes back (`unreserve`), so does a removal (`forget`); a
reopened persistent tier counts what it already holds (`seed`). A full medium that the tier
accounts for alone lowers the capacity to the bytes held at that moment (`cap_at_used`); that cap
is not for ever: where the backend can say how much its medium has free (``free_bytes``), a write
the lowered cap refuses first re-probes it, and the capacity rises again to what the medium can
hold now (held plus free), at most back to the capacity it had before (another tenant freed the
disk). A manager that evicts keeps its writes under the lowered cap, so no write would ever ask:
`refresh` (called by the tier's ``usage()``, which the manager reads before it evicts) re-probes
too, at most once every `REPROBE_S`.

The counts live in the tier's stats (``used_bytes``, ``peak_bytes``, ``capacity_bytes``,
``refused_full``), which the report shows. The ledger takes no lock: the tier calls every method
under its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Optional

from cacheseek.errors import StoreFullError
from cacheseek.eviction.base import StoreUsage

__all__ = ["ValueLedger"]

log = logging.getLogger(__name__)

REPROBE_S = 1.0  # how often `refresh` asks the medium for its free bytes while the capacity is capped


class ValueLedger:
    """Bytes per key and their total in ``stats`` (any object with ``used_bytes``,
    ``peak_bytes``, ``capacity_bytes`` (None: unbounded) and ``refused_full``)."""

    def __init__(self, stats: Any, *, free_bytes: Optional[Callable[[], Optional[int]]] = None) -> None:
        self.stats = stats
        self.sizes: dict[str, int] = {}
        self._free_bytes = free_bytes  # the medium's free bytes now, or None when unknown
        self._lowered = False  # the capacity is a full medium's cap (`cap_at_used`)
        self._before: Optional[int] = None  # ... and what it was before it (None: unbounded)
        self._probed_at = float("-inf")  # when `refresh` last re-probed (time.monotonic)

    def __len__(self) -> int:
        return len(self.sizes)

    def reserve(self, sizes: Iterable[tuple[str, int]], *, name: str, fix: str) -> dict[str, Optional[int]]:
        """Count ``sizes`` (replacing what those keys held), or raise `StoreFullError` (naming
        the tier ``name`` and the ``fix``) changing nothing but ``refused_full``. Returns the
        keys' previous sizes (None: absent), for `unreserve`."""
        sizes = list(sizes)
        old = {key: self.sizes.get(key) for key, _ in sizes}
        delta = sum(n for _, n in sizes) - sum(n or 0 for n in old.values())
        used, cap = self.stats.used_bytes, self.stats.capacity_bytes
        if cap is not None and delta > 0 and used + delta > cap and self._lowered:
            cap = self.reprobe(name)
        if cap is not None and delta > 0 and used + delta > cap:
            self.stats.refused_full += 1
            raise StoreFullError(f"{name} store full: need {delta} more bytes, {used} of {cap} used ({fix})")
        for key, n in sizes:
            self.sizes[key] = n
        self.stats.used_bytes = used + delta
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.used_bytes)
        return old

    def unreserve(self, old: dict[str, Optional[int]], *, removed: Iterable[str]) -> None:
        """Undo a reservation after a failed write. ``removed`` keys are gone from the backend;
        the others still hold their previous value (if any)."""
        gone = set(removed)
        for key, previous in old.items():
            now = self.sizes.pop(key, 0)
            self.stats.used_bytes -= now
            if previous is not None and key not in gone:
                self.sizes[key] = previous
                self.stats.used_bytes += previous

    def refund(self, old: dict[str, Optional[int]], removed: Iterable[str], exc: BaseException, *, caps: bool,
               name: str) -> None:
        """A failed write: `unreserve`, and where the medium was full and ``caps`` (the tier
        accounts for it alone), `cap_at_used`."""
        self.unreserve(old, removed=removed)
        if caps:
            self.cap_at_used(exc, name=name)

    def usage(self, name: str, now: float) -> StoreUsage:
        """What the tier holds (after `refresh`: a full medium's cap rises again)."""
        self.refresh(name, now)
        return StoreUsage(self.stats.used_bytes, self.stats.capacity_bytes, self.stats.peak_bytes, len(self.sizes))

    def forget(self, key: str) -> None:
        """``key`` was removed from the backend (idempotent)."""
        self.stats.used_bytes -= self.sizes.pop(key, 0)

    def seed(self, sizes: dict[str, int]) -> None:
        """Count values that already exist in the backend (a reopened persistent tier)."""
        used = self.stats.used_bytes
        for key, n in sizes.items():
            used += n - self.sizes.get(key, 0)
            self.sizes[key] = n
        self.stats.used_bytes = used
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.used_bytes)

    def cap_at_used(self, exc: BaseException, *, name: str) -> None:
        """The backend's medium is full (``exc``): cap the tier at what it holds now (logged),
        unless the capacity is already at or below that."""
        used, cap = self.stats.used_bytes, self.stats.capacity_bytes
        if cap is None or used < cap:
            if not self._lowered:
                self._lowered, self._before = True, cap
            self.stats.capacity_bytes = used
            log.warning("%s: the backend is full (%s); capacity lowered from %s to %d bytes (the bytes "
                        "held now); the manager evicts from here on", name, exc,
                        "unbounded" if cap is None else cap, used)

    def refresh(self, name: str, now: float) -> None:
        """While the capacity is a full medium's cap: `reprobe`, at most once every `REPROBE_S`
        (``now``: `time.monotonic`)."""
        if self._lowered and now - self._probed_at >= REPROBE_S:
            self._probed_at = now
            self.reprobe(name)

    def reprobe(self, name: str) -> Optional[int]:
        """After a full medium's cap: the capacity the medium allows now (held plus free), at
        most the one before the cap; the cap itself when the medium cannot say or has no room.
        A write the cap refuses calls it."""
        cap = self.stats.capacity_bytes
        free = self._free_bytes() if self._free_bytes is not None else None
        if not free:
            return cap
        room = self.stats.used_bytes + int(free)
        if self._before is not None and room >= self._before:
            room, self._lowered = self._before, False
        if cap is None or room > cap:
            log.info("%s: the medium has %d bytes free again; capacity raised from %s to %d bytes", name,
                     free, cap, room)
            self.stats.capacity_bytes = cap = room
        return cap
