"""`RegistrationTable`: which host mappings a runtime has registered, and for how many users.

Registration lifecycle: reference-counted per ``(ptr, length, generation)``. ``register(m)``
registers on the first call and counts every call ("already registered" by someone outside this
runtime is success, and never undone); ``unregister(m)`` drops one count and unregisters on the
last (an unknown mapping is ignored); ``drop_all`` (a runtime's ``close()``) unregisters
everything at once. So two users of one runtime (two Plan tiers over one segment) each register
and unregister their own mappings, and the first to close cannot unregister memory the other
still uses. Thread-safe: concurrent ``register`` calls of one mapping make one registration (the
others wait for it). Unregister a mapping before the memory behind it is unmapped.

The table does the bookkeeping; the runtime moves the bytes through two callbacks:
``register_one(mapping) -> (owned, read_only)`` and ``unregister_one(registration)``, each
called outside the table's lock. Batch validation reads `HostIndex`, an immutable snapshot
rebuilt on every change (so a lookup takes no copy).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs

from cacheseek.errors import TransferError
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import HostMapping

np = LazyModule("numpy")

__all__ = ["Registration", "HostIndex", "RegistrationTable"]

Key = tuple[int, int, int]


@attrs.frozen(slots=True)
class Registration:
    mapping: HostMapping
    owned: bool  # False: someone else had registered it ("already registered"); never unregistered
    read_only: bool


@attrs.frozen(slots=True, eq=False)
class HostIndex:
    """The registered mappings sorted by address: ``entries`` ``[(ptr, Registration)]`` and, for
    vectorized checks, ``starts``/``ends`` int64 ``[n]`` and ``writable`` bool ``[n]``."""

    entries: list[tuple[int, Registration]]
    starts: np.ndarray
    ends: np.ndarray
    writable: np.ndarray

    @classmethod
    def of(cls, registrations: Sequence[Registration]) -> "HostIndex":
        entries = sorted(((r.mapping.ptr, r) for r in registrations), key=lambda e: e[0])
        return cls(
            entries,
            np.array([r.mapping.ptr for _, r in entries], dtype=np.int64),
            np.array([r.mapping.ptr + r.mapping.length for _, r in entries], dtype=np.int64),
            np.array([r.mapping.writable for _, r in entries], dtype=bool),
        )


class RegistrationTable:
    """Reference-counted registrations (module docstring), their address index and timings."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._registrations: dict[Key, Registration] = {}
        self._users: dict[Key, int] = {}  # register calls not yet unregistered
        self._registering: set[Key] = set()
        self._index = HostIndex.of([])
        self._seconds = 0.0
        self._timings: list[tuple[HostMapping, float]] = []

    def register(
        self, mappings: Sequence[HostMapping], register_one: Callable[[HostMapping], tuple[bool, bool]]
    ) -> None:
        """Count one user of each mapping, calling ``register_one`` for the first. An error of
        ``register_one`` propagates; the mappings before it stay registered (and counted)."""
        for mapping in mappings:
            if not isinstance(mapping, HostMapping):
                raise TypeError(f"register takes HostMapping values, got {type(mapping).__name__}")
            key = mapping.key
            with self._cond:
                while key in self._registering:  # another thread is registering it now
                    self._cond.wait()
                if key in self._registrations:
                    self._users[key] += 1
                    continue
                self._registering.add(key)
            t0 = time.perf_counter()
            try:
                owned, read_only = register_one(mapping)
            except BaseException:
                with self._cond:
                    self._registering.discard(key)
                    self._cond.notify_all()
                raise
            reg = Registration(mapping, owned, read_only)
            with self._cond:
                seconds = time.perf_counter() - t0
                self._seconds += seconds
                self._timings.append((mapping, seconds))
                self._registrations[key] = reg
                self._users[key] = 1
                self._registering.discard(key)
                self._index = HostIndex.of(list(self._registrations.values()))
                self._cond.notify_all()

    def unregister(
        self,
        mappings: Sequence[HostMapping],
        unregister_one: Callable[[Registration], None],
        *,
        force: bool = False,
    ) -> None:
        """One count off each mapping (``force``: all of them); at zero, forget it and call
        ``unregister_one`` if this runtime made the registration. Every mapping is tried; the
        first `TransferError` is raised at the end."""
        errors: list[BaseException] = []
        for mapping in mappings:
            with self._lock:
                key = mapping.key
                if key not in self._registrations:
                    continue
                self._users[key] -= 1
                if self._users[key] > 0 and not force:
                    continue  # another user still needs it
                self._users.pop(key, None)
                reg = self._registrations.pop(key)
                self._index = HostIndex.of(list(self._registrations.values()))
            if reg.owned:
                try:
                    unregister_one(reg)
                except TransferError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def drop_all(self, unregister_one: Callable[[Registration], None]) -> None:
        """Unregister every mapping, whatever its count."""
        with self._lock:
            mappings = [r.mapping for r in self._registrations.values()]
        self.unregister(mappings, unregister_one, force=True)

    def index(self) -> HostIndex:
        """The registered mappings now, sorted by address (an immutable snapshot)."""
        with self._lock:
            return self._index

    def registered(self) -> list[HostMapping]:
        """The mappings registered now, in address order."""
        return [reg.mapping for _, reg in self.index().entries]

    def users(self, mapping: HostMapping) -> int:
        """How many `register` calls of ``mapping`` are not yet matched by `unregister` (0: none)."""
        with self._lock:
            return self._users.get(mapping.key, 0)

    def timings(self) -> list[tuple[HostMapping, float]]:
        """``(mapping, seconds)`` of every registration made, in order."""
        with self._lock:
            return list(self._timings)

    def totals(self) -> tuple[int, int, float]:
        """``(mappings registered now, their bytes, seconds spent registering so far)``."""
        with self._lock:
            regs = list(self._registrations.values())
            return len(regs), sum(r.mapping.length for r in regs), self._seconds
