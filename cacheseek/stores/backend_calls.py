"""`BackendCalls`: a generic tier's calls into its `ValueBackend`, each as the tier must make it.

- Bounded: with ``op_timeout_s`` every call runs under `BoundedCalls` (a stalled disk or file
  system is a `StoreTimeoutError` naming the operation, never a hung session); ``wait_quiet``
  waits for calls still running before the backend is closed.
- A write that lands after its caller gave up is removed again, unless a later write reserved
  the key meanwhile (``reserved(key)``).
- A read passes the checksum a chunk's record names (``expect``) to a backend that checks them
  (``checks_digests``: LocalDisk, Fluxon); a value it reports corrupt (`CorruptValueError`:
  checksum mismatch, truncated, unreadable) is handed to ``on_corrupt`` (counted), removed and
  read as missing.
- ``stored_nbytes``: the bytes a value takes in the backend's unit where it has one (LocalDisk
  counts file bytes), else its payload bytes; ``caps_on_full``: a full medium this tier accounts
  for alone (``full_caps_tier``: LocalDisk; a shared store that evicts by itself reports full
  without capping the tier).

The backend may be replaced (``backend``: tests put a faulty one in front); what it offers is
asked at each call, except ``checks_digests``, decided once when the tier is built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.bounded_calls import BoundedCalls
from cacheseek.errors import CorruptValueError, StoreError, StoreFullError, StoreTimeoutError
from cacheseek.kv.payload import payload_nbytes
from cacheseek.stores.value_backend import ValueBackend

log = logging.getLogger(__name__)

__all__ = ["BackendCalls"]


class BackendCalls:
    """The calls of tier ``name`` into ``backend`` (see the module docstring)."""

    def __init__(self, backend: ValueBackend, *, name: str, op_timeout_s: Optional[float],
                 reserved: Callable[[str], bool], on_corrupt: Callable[..., None]) -> None:
        self.backend = backend
        self.name = name
        self.checks_digests = bool(getattr(backend, "checks_digests", False))  # decided once, here
        self.knows_free_bytes = hasattr(backend, "free_bytes")
        self.bounded = None if op_timeout_s is None else BoundedCalls(
            op_timeout_s, name=name, field="store.op_timeout_s", hint=" (a stalled disk or file system?)")
        self._reserved = reserved
        self._on_corrupt = on_corrupt

    def run(self, op: str, fn: Callable[[], Any], key: Optional[str] = None, on_late=None) -> Any:
        """``fn()``, a backend call: bounded when the tier has ``op_timeout_s``."""
        if self.bounded is None:
            return fn()
        return self.bounded.run(op, fn, key=key, on_late=on_late)

    def write(self, key: str, value: Any) -> Any:
        """One backend write (its checksum, where the backend has one)."""
        def late(_: Any, error: Optional[BaseException]) -> None:
            if error is None and not self._reserved(key):
                self.backend.delete(key)

        return self.run("write", lambda: self.backend.write(key, value), key, on_late=late)

    def delete(self, key: str) -> None:
        self.run("delete", lambda: self.backend.delete(key), key)

    def read(self, key: str, expect: Optional[str] = None, decode: Optional[Callable[[Any], Any]] = None
             ) -> Optional[Any]:
        """The value (after ``decode``: a codec's failure is a corrupt value), or None when it is
        missing or corrupt: then ``on_corrupt(key, exc, removed=...)`` and the value removed."""
        args = (key, expect) if expect is not None and self.checks_digests else (key,)
        try:
            value = self.run("read", lambda: self.backend.read(*args), key)
            return decode(value) if decode is not None else value
        except CorruptValueError as exc:
            log.error("%s: %s; removing it and reading it as missing", self.name, exc)
            try:
                self.delete(key)
            except Exception:  # noqa: BLE001 - the manager's free of the blob retries the removal
                log.exception("%s: could not remove corrupt value %s", self.name, key)
                self._on_corrupt(key, exc, removed=False)
            else:
                self._on_corrupt(key, exc, removed=True)
            return None

    def remove_partial(self, keys: Sequence[str]) -> list[str]:
        """Remove what a failed write may have left under ``keys``; the keys removed (a removal
        that fails is logged: the value stays until the blob is freed again)."""
        removed = []
        for key in keys:
            try:
                self.delete(key)
                removed.append(key)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not remove %s after a failed write", self.name, key)
        return removed

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` hold a value (the backend's ``exists`` when it has one, else a read)."""
        exists = getattr(self.backend, "exists", None)
        if callable(exists):
            return self.run("exists", lambda: [bool(exists(key)) for key in keys])
        return self.run("read", lambda: [self.backend.read(key) is not None for key in keys])

    def stored_nbytes(self, key: str, value: Any) -> int:
        sized = getattr(self.backend, "stored_nbytes", None)
        if callable(sized):
            try:
                return int(sized(key, value))
            except StoreError:  # a value the backend cannot store: its write fails on the handle
                pass
        return payload_nbytes(value)

    def caps_on_full(self, exc: BaseException) -> bool:
        return isinstance(exc, StoreFullError) and bool(getattr(self.backend, "full_caps_tier", False))

    def free_bytes(self) -> Optional[int]:
        """The backend medium's free bytes now (asked each time: the backend may be replaced)."""
        return self.backend.free_bytes()

    def close(self, bound_s: float) -> None:
        """Close the backend once no call runs in it any more, stuck ones included; past
        ``bound_s`` `StoreTimeoutError`, the backend left open (never torn down under a call)."""
        running = self.bounded.wait_quiet(bound_s) if self.bounded is not None else 0
        if running:
            raise StoreTimeoutError(f"{self.name}: {running} backend calls still running after "
                                    f"{bound_s} s (a stalled medium?); backend left open")
        self.backend.close()
