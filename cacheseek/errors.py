"""The error hierarchy, named by cause.

Every error a user can provoke with bad input is a `ConfigError` that names the offending field
and the fix; the CLI prints its message without a traceback. Everything else is a `CacheSeekError`
subclass that says which component failed and why. Invariant violations (a double release, a
handle used after close) are errors too, never silently repaired.
"""

from __future__ import annotations

import re


class CacheSeekError(Exception):
    """Base class of every error CacheSeek raises on purpose."""


class ConfigError(CacheSeekError, ValueError):
    """Bad user input: a config field, an override or an argument. The message names the field
    and the fix; a range error raised without one (``must be an integer >= 1, got 0``) gets the
    fix its problem implies (``set FIELD to an integer >= 1``)."""

    def __init__(self, field: str, problem: str, fix: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix or _implied_fix(field, problem)
        super().__init__(f"{field}: {problem}" + (f" (fix: {self.fix})" if self.fix else ""))


def _implied_fix(field: str, problem: str) -> str | None:
    """``must be X, got Y`` -> ``set FIELD to X`` (a comparison alone reads ``a value >= 1``)."""
    m = re.match(r"must be (.+?)(?:, got .*)?$", str(problem).strip(), re.S)
    if m is None:
        return None
    want = m.group(1).strip()
    if want[:1] in "<>=!":
        want = f"a value {want}"
    return f"set {field} to {want}"


class GeometryError(ConfigError):
    """The rolling-window geometry is inconsistent (e.g. L < S + c, or manager and runtime disagree)."""


class StoreError(CacheSeekError):
    """A store backend failed to put, get or free a value."""


class StoreFullError(StoreError):
    """The store cannot reserve the requested bytes (capacity reached and nothing evictable)."""


class StoreClosedError(StoreError):
    """A store (or Plan client) was used after `close()`."""


class CorruptValueError(StoreError):
    """A stored value failed its checksum, or is truncated or unreadable. Treated like a missing
    value: the tier removes it and the manager invalidates the node that named it. ``key``: the
    value's store key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"corrupt value {key!r}: {problem}")


class StoreTimeoutError(StoreError):
    """A store call did not complete within its time bound."""


class WriteNotCompleteError(StoreError):
    """A blob whose write has not completed was asked to be freed or evicted."""


class LayoutMismatchError(CacheSeekError):
    """Stored bytes do not match the active runtime's layout (sizes, layer count). ``depth``: the
    chunk whose stored values do not fit, where one is to blame (its node is then invalidated)."""

    def __init__(self, message: str, *, depth: "int | None" = None) -> None:
        self.depth = depth
        super().__init__(message)


class ControlMismatchError(CacheSeekError):
    """A chunk restored for the control its session planned is run with another control (an
    override that differs): its restored frames would belong to the planned control."""


class PlanTableError(CacheSeekError):
    """A Plan pointer table failed validation (null address, wrong magic, wrong count)."""


class PlanError(StoreError):
    """A Plan call failed (start, commit, per-key return code, transfer)."""


class PlanUnavailableError(CacheSeekError):
    """The installed Fluxon client lacks the Plan API calls CacheSeek needs; names the missing calls."""


class TransferError(CacheSeekError):
    """A host/device copy failed validation or submission."""


class TransferTimeoutError(TransferError):
    """A submitted batch did not land within its time bound; its buffers are still in use."""


class RegistrationError(TransferError):
    """Registering a host mapping with the transfer runtime failed."""


class HandleStateError(CacheSeekError):
    """A handle was used in a state that does not allow the call (double release, commit after abort)."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (``exc.add_note``, where Python offers it: 3.11+), so a cleanup
    that failed while handling ``exc`` is reported with it instead of replacing it."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class StoreWarmingError(StoreError):
    """A write reached a store still warming up in the background (``store.warmup=background``):
    it serves reads as misses and refuses writes until its segment is mapped and registered. The
    run goes on uncached meanwhile."""
