"""How the Plan tier reports a failure: every error that leaves the store is a `StoreError`, and
a batch already submitted is waited for before a failure path goes on (its own failure becomes
a note on the first error, never a second exception)."""

from __future__ import annotations

from typing import Optional

from cacheseek.errors import PlanError, StoreError, add_note
from cacheseek.transfer.pending import PendingBatch

__all__ = ["as_store_error", "settle"]


def settle(pending: Optional[PendingBatch], error: Optional[BaseException] = None) -> None:
    """Wait for a batch on a failure path; its own failure becomes a note on ``error``."""
    if pending is None:
        return
    try:
        pending.wait()
    except Exception as wait_error:  # noqa: BLE001
        if error is not None:
            add_note(error, f"waiting for a submitted batch failed too: {wait_error!r}")


def as_store_error(exc: Exception, what: str) -> Exception:
    """``exc`` when it already is a `StoreError`; else a `PlanError` naming the cause (a transfer,
    table or layout error, or a payload that is not a tensor pair)."""
    if isinstance(exc, StoreError):
        return exc
    return PlanError(f"{what} failed: {type(exc).__name__}: {exc}")
