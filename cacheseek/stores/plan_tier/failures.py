"""How the Plan tier reports a failure: every error that leaves the store is a `StoreError`, and
a batch already submitted is waited for before a failure path goes on (its own failure becomes
a note on the first error, never a second exception). `settle` says whether the batch is known
to have ended: after a wait that timed out its copies may still read or write their buffers, so
the caller keeps them (a restore keeps its Plan views: `Reader`)."""

from __future__ import annotations

from typing import Optional

from cacheseek.errors import PlanError, StoreError, TransferTimeoutError, add_note
from cacheseek.transfer.pending import PendingBatch

__all__ = ["as_store_error", "settle"]


def settle(pending: Optional[PendingBatch], error: Optional[BaseException] = None, *,
           wait_s: Optional[float] = None) -> bool:
    """Wait for a batch on a failure path (at most ``wait_s``, default the runtime's bound); its
    own failure becomes a note on ``error``. True when the batch is known to have ended (landed,
    or failed: the device reported its end); False when it may still be copying."""
    if pending is None:
        return True
    try:
        pending.wait(timeout_s=wait_s)
    except TransferTimeoutError as wait_error:
        if error is not None and error is not wait_error:
            add_note(error, f"a submitted batch has not landed either: {wait_error}")
        return False
    except Exception as wait_error:  # noqa: BLE001
        if error is not None:
            add_note(error, f"waiting for a submitted batch failed too: {wait_error!r}")
    return True


def as_store_error(exc: Exception, what: str) -> Exception:
    """``exc`` when it already is a `StoreError`; else a `PlanError` naming the cause (a transfer,
    table or layout error, or a payload that is not a tensor pair)."""
    if isinstance(exc, StoreError):
        return exc
    return PlanError(f"{what} failed: {type(exc).__name__}: {exc}")
