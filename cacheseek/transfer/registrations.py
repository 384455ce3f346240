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

In pieces (``register(..., piece_bytes=N)``): a mapping is registered as consecutive pieces of at
most N bytes (`HostMapping.pieces`), one ``register_one`` call each, so no single driver call
holds the driver's and the mmap locks for long (a 24 GiB ``cudaHostRegister`` holds them for
about 0.4 s, and every ``cudaMalloc`` of the process waits). ``before_piece(piece)`` runs before
each piece (the Plan tier pre-faults it there) and ``after_piece(piece)`` after it (a pause that
lets other threads take the locks). The mapping stays one entry for the users count, `registered`
and `timings` (seconds of the register calls only); each piece is its own `Registration` in the
index (so `cacheseek.transfer.joints` can split copies at the joints) and is unregistered on its
own. If piece k fails, pieces 0..k-1 are unregistered before the error (`RegistrationError`
naming the piece) propagates: nothing of the mapping stays registered. The mapping is published
(in the index, counted) only once every piece is registered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

import attrs

from cacheseek.errors import RegistrationError, TransferError, add_note
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import HostMapping

np = LazyModule("numpy")

__all__ = ["Registration", "HostIndex", "RegistrationTable"]

Key = tuple[int, int, int]


@attrs.frozen(slots=True)
class Registration:
    """One registration the runtime made or found: a whole mapping, or one piece of a mapping
    registered in pieces (``mapping`` is then the piece)."""

    mapping: HostMapping
    owned: bool  # False: someone else had registered it ("already registered"); never unregistered
    read_only: bool


@attrs.frozen(slots=True, eq=False)
class HostIndex:
    """The registrations (whole mappings and pieces) sorted by address: ``entries``
    ``[(ptr, Registration)]`` and, for vectorized checks, ``starts``/``ends`` int64 ``[n]``,
    ``writable`` bool ``[n]`` and ``joints`` int64 ``[j]``: the addresses where one registration
    ends and the next one begins (a copy may not run across them; empty when nothing touches)."""

    entries: list[tuple[int, Registration]]
    starts: np.ndarray
    ends: np.ndarray
    writable: np.ndarray
    joints: np.ndarray

    @classmethod
    def of(cls, registrations: Sequence[Registration]) -> "HostIndex":
        entries = sorted(((r.mapping.ptr, r) for r in registrations), key=lambda e: e[0])
        starts = np.array([r.mapping.ptr for _, r in entries], dtype=np.int64)
        ends = np.array([r.mapping.ptr + r.mapping.length for _, r in entries], dtype=np.int64)
        joints = np.unique(ends[:-1][np.isin(ends[:-1], starts[1:])]) if len(entries) > 1 else ends[:0]
        return cls(entries, starts, ends, np.array([r.mapping.writable for _, r in entries], dtype=bool), joints)


class RegistrationTable:
    """Reference-counted registrations (module docstring), their address index and timings."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._registrations: dict[Key, tuple[Registration, ...]] = {}  # mapping -> its pieces (one: whole)
        self._mappings: dict[Key, HostMapping] = {}
        self._users: dict[Key, int] = {}  # register calls not yet unregistered
        self._registering: set[Key] = set()
        self._index = HostIndex.of([])
        self._seconds = 0.0
        self._timings: list[tuple[HostMapping, float]] = []

    def register(self, mappings: Sequence[HostMapping], register_one: Callable[[HostMapping], tuple[bool, bool]], *,
                 unregister_one: Optional[Callable[[Registration], None]] = None, piece_bytes: Optional[int] = None,
                 before_piece: Optional[Callable[[HostMapping], None]] = None,
                 after_piece: Optional[Callable[[HostMapping], None]] = None) -> None:
        """Count one user of each mapping, registering it (whole, or in pieces of ``piece_bytes``:
        module docstring) for the first. An error propagates; the mappings before it stay
        registered (and counted), nothing of the failing one does (``unregister_one`` undoes its
        pieces: required with ``piece_bytes``)."""
        if piece_bytes and unregister_one is None:
            raise TypeError("register in pieces needs unregister_one (to undo the pieces of a failure)")
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
            try:
                pieces, seconds = _register_pieces(mapping, register_one, unregister_one, piece_bytes,
                                                   before_piece, after_piece)
            except BaseException:
                with self._cond:
                    self._registering.discard(key)
                    self._cond.notify_all()
                raise
            with self._cond:
                self._seconds += seconds
                self._timings.append((mapping, seconds))
                self._registrations[key] = pieces
                self._mappings[key] = mapping
                self._users[key] = 1
                self._registering.discard(key)
                self._reindex()
                self._cond.notify_all()

    def _reindex(self) -> None:
        """Rebuild the index from every piece (the caller holds the lock)."""
        self._index = HostIndex.of([r for pieces in self._registrations.values() for r in pieces])

    def unregister(self, mappings: Sequence[HostMapping], unregister_one: Callable[[Registration], None], *,
                   force: bool = False) -> None:
        """One count off each mapping (``force``: all of them); at zero, forget it and call
        ``unregister_one`` for each of its pieces this runtime registered. Every mapping and piece
        is tried; the first `TransferError` is raised at the end."""
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
                self._mappings.pop(key, None)
                pieces = self._registrations.pop(key)
                self._reindex()
            for reg in pieces:
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
            mappings = list(self._mappings.values())
        self.unregister(mappings, unregister_one, force=True)

    def index(self) -> HostIndex:
        """The registrations now, sorted by address (an immutable snapshot)."""
        with self._lock:
            return self._index

    def registered(self) -> list[HostMapping]:
        """The mappings registered now (whole, however many pieces each), in address order."""
        with self._lock:
            return sorted(self._mappings.values(), key=lambda m: (m.ptr, m.length, m.generation))

    def pieces(self, mapping: HostMapping) -> tuple[HostMapping, ...]:
        """The registrations behind ``mapping`` now (one: registered whole; none: not registered)."""
        with self._lock:
            return tuple(r.mapping for r in self._registrations.get(mapping.key, ()))

    def users(self, mapping: HostMapping) -> int:
        """How many `register` calls of ``mapping`` are not yet matched by `unregister` (0: none)."""
        with self._lock:
            return self._users.get(mapping.key, 0)

    def timings(self) -> list[tuple[HostMapping, float]]:
        """``(mapping, seconds)`` of every registration made, in order (a mapping registered in
        pieces: one entry, the sum of its pieces' register calls)."""
        with self._lock:
            return list(self._timings)

    def totals(self) -> tuple[int, int, float]:
        """``(mappings registered now, their bytes, seconds spent registering so far)``."""
        with self._lock:
            maps = list(self._mappings.values())
            return len(maps), sum(m.length for m in maps), self._seconds

    def n_pieces(self) -> int:
        """Registrations (driver calls that succeeded) behind the mappings registered now."""
        with self._lock:
            return sum(len(p) for p in self._registrations.values())


def _register_pieces(mapping: HostMapping, register_one: Callable[[HostMapping], tuple[bool, bool]],
                     unregister_one: Optional[Callable[[Registration], None]], piece_bytes: Optional[int],
                     before_piece: Optional[Callable[[HostMapping], None]],
                     after_piece: Optional[Callable[[HostMapping], None]]) -> tuple[tuple[Registration, ...], float]:
    """Register every piece of ``mapping`` in order (outside the lock); on a failure undo the
    pieces before it. Returns the pieces' registrations and the seconds of the register calls."""
    pieces = mapping.pieces(piece_bytes)
    done: list[Registration] = []
    seconds = 0.0
    for k, piece in enumerate(pieces):
        try:
            if before_piece is not None:
                before_piece(piece)
            t0 = time.perf_counter()
            owned, read_only = register_one(piece)
            seconds += time.perf_counter() - t0
            done.append(Registration(piece, owned, read_only))
            if after_piece is not None and k + 1 < len(pieces):
                after_piece(piece)
        except BaseException as exc:
            if len(pieces) == 1:
                raise
            undo_errors = []
            for reg in done:
                if reg.owned and unregister_one is not None:
                    try:
                        unregister_one(reg)
                    except Exception as undo_error:  # noqa: BLE001 - reported on the error
                        undo_errors.append(undo_error)
            error = RegistrationError(
                f"registering {mapping} in {len(pieces)} pieces of {piece_bytes} B: piece {k} "
                f"[{piece.ptr:#x}, +{piece.length}) failed: {exc}. The {len(done)} piece(s) before "
                f"it were unregistered, nothing of the mapping stays registered. Fix: free host "
                f"memory or raise the locked-memory limit (ulimit -l); pieces of another size "
                f"(store.register_piece_bytes; 0 registers the mapping in one call)"
            )
            for undo_error in undo_errors:
                add_note(error, f"and undoing a piece before it failed: {undo_error}")
            if isinstance(exc, Exception):
                raise error from exc
            raise  # KeyboardInterrupt and the like: pieces undone, the interrupt goes on
    return tuple(done), seconds
