"""The Fluxon calls of one plan of the public client: a commit's puts and a get's reads.

Both issue one call per value through a runner (``run(n, call, settle, stop, limit=...)``, see
`cacheseek.plan.pipeline`), a few in flight, and settle outcomes in key order.

A commit (`CommitOutcome`): each key gets a `PutKeyCode`; after a put times out or finds the
client closed, no further put is issued (the rest stay NOT_ATTEMPTED), and a timeout marks the
plan ``stuck`` (its staging must never be freed: the call may still read it). The commit resolves
with status 0 and the codes; its message names up to three failures.

A read (`fetch_prefix`): the transferable prefix is the leading whole groups whose every key
exists. A missing key cuts the prefix at the start of its group (views beyond it are released);
a value that is not a zero-copy view into the owner's segment mapping is a `PlanError` (it was
not written by a CacheSeek Plan client); any error releases every view before it is raised.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional

from cacheseek.errors import PlanError, StoreClosedError, StoreFullError, StoreTimeoutError
from cacheseek.fluxon.errors import FluxonValueTooLargeError
from cacheseek.plan.base import PutCommitResult, SegmentMapping

__all__ = ["PutKeyCode", "CommitOutcome", "put_code", "fetch_prefix", "release_all"]

Runner = Callable[..., None]


class PutKeyCode(enum.IntEnum):
    """Per-key codes of a commit (`PutCommitResult.key_codes`); 0 = published."""

    OK = 0
    FAILED = 1  # Fluxon refused the put (the message carries its error text)
    TIMEOUT = 2  # the put did not complete within op_timeout_s (it may still land later)
    NOT_ATTEMPTED = 3  # not issued: an earlier put of the plan timed out or the client closed
    CLOSED = 4  # the Fluxon client was closed meanwhile
    STORE_FULL = 6000  # Fluxon's StorageFullError: no space (its own eviction runs behind)
    TOO_LARGE = 6001  # the value cannot fit the owner's segment even when empty


def put_code(exc: BaseException) -> PutKeyCode:
    """The code of a put that raised ``exc``."""
    if isinstance(exc, FluxonValueTooLargeError):
        return PutKeyCode.TOO_LARGE
    if isinstance(exc, StoreFullError):
        return PutKeyCode.STORE_FULL
    if isinstance(exc, StoreTimeoutError):
        return PutKeyCode.TIMEOUT
    if isinstance(exc, StoreClosedError):
        return PutKeyCode.CLOSED
    return PutKeyCode.FAILED


class CommitOutcome:
    """The codes of one commit's puts, as they settle (see the module docstring)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        self.codes = [PutKeyCode.NOT_ATTEMPTED] * len(self.keys)
        self.notes: list[str] = []
        self.stop = False  # issue no further put
        self.stuck = False  # a put timed out: its staging may still be read

    def run(self, runner: Runner, put: Callable[[int], None]) -> None:
        """Issue ``put(i)`` for every key through ``runner`` until `stop`."""
        runner(len(self.keys), put, self.settle, lambda: self.stop)

    def settle(self, i: int, fut: Future) -> None:
        try:
            fut.result()
            self.codes[i] = PutKeyCode.OK
            return
        except BaseException as exc:  # noqa: BLE001 - reported as the key's code
            code = put_code(exc)
            if code in (PutKeyCode.TIMEOUT, PutKeyCode.CLOSED):
                self.stop = True
            if code == PutKeyCode.TIMEOUT:
                self.stuck = True
            self.codes[i] = code
            if len(self.notes) < 3:
                self.notes.append(f"{self.keys[i]}: {exc}")

    def failed(self, exc: BaseException) -> None:
        """The commit itself failed (e.g. closed before the first put)."""
        self.stuck = self.stuck or isinstance(exc, StoreTimeoutError)
        self.notes.append(f"commit failed: {type(exc).__name__}: {exc}")

    def result(self) -> PutCommitResult:
        n = len(self.keys)
        bad = sum(c != PutKeyCode.OK for c in self.codes)
        message = "" if not bad else f"{bad} of {n} puts failed: " + "; ".join(self.notes)
        return PutCommitResult(0, tuple(int(c) for c in self.codes), message)


def release_all(views: Sequence[Any]) -> None:
    """Release every view not yet released (None entries are skipped)."""
    for v in views:
        if v is not None and not v.released:
            v.release()


def fetch_prefix(keys: tuple[str, ...], lens: tuple[int, ...], get_view: Callable[[str], Any],
                 owner: SegmentMapping, runner: Runner) -> list[Any]:
    """Views of the transferable prefix (whole groups whose every key exists), key order."""
    starts, pos = [], 0  # starts[i]: index of the first key of i's group
    for g in lens:
        starts += [pos] * g
        pos += g
    views: list[Any] = [None] * len(keys)
    limit = len(keys)  # first index not in the prefix
    error: Optional[BaseException] = None

    def settle(i: int, fut: Future) -> None:
        nonlocal limit, error
        try:
            view = fut.result()
        except BaseException as exc:  # noqa: BLE001 - raised below, after releasing
            error = error or exc
            return
        if view is None:
            limit = min(limit, starts[i])
            return
        views[i] = view
        if error is None and not (view.zero_copy and owner.ptr <= view.ptr and
                                  view.ptr + view.nbytes <= owner.ptr + owner.length):
            error = PlanError(
                f"fluxon value {keys[i]!r} ({view.nbytes} B at {view.ptr:#x}) is not a zero-copy view into "
                f"the owner's segment mapping [{owner.ptr:#x}, +{owner.length}): not written by a "
                f"CacheSeek Plan client")

    try:
        runner(len(keys), lambda i: get_view(keys[i]), settle, lambda: error is not None, limit=lambda: limit)
    except BaseException as exc:
        error = error or exc
    if error is not None:
        release_all(views)
        raise error
    release_all(views[limit:])
    return views[:limit]
