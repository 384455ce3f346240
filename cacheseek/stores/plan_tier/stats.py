"""How the Plan tier reports: `Counters`, which every part of the store adds to, the frozen
snapshot `PlanTierStats` that ``PlanTierStore.stats`` returns (the field names are what reports
and benchmarks read: keep them), and its failures: every error that leaves the store is a
`StoreError` (`as_store_error`), and a batch already submitted is waited for before a failure
path goes on (`settle`: its own failure becomes a note on the first error, never a second
exception). `settle` says whether the batch is known to have ended: after a wait that timed out
its copies may still read or write their buffers, so the caller keeps them (a restore keeps its
Plan views: `Reader`). A write's end on its handle is set in one place: `fail_write`,
`land_write`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Dict, Optional

import attrs

from cacheseek.errors import PlanError, StoreError, TransferTimeoutError, add_note
from cacheseek.kv.handles import BlobHandle
from cacheseek.plan.base import SegmentTimers
from cacheseek.transfer.pending import PendingBatch

__all__ = ["Counters", "PlanTierStats", "as_store_error", "collect", "fail_write", "land_write", "settle", "store_errors"]


@attrs.frozen(slots=True)
class PlanTierStats:
    """A snapshot of the Plan tier's counters (bytes and seconds are whole calls, wall clock).

    Warm-up: ``warmup_seconds`` (all of it), ``segment_ready_seconds`` (the client's
    ``wait_local_segments_ready``: ``map_seconds`` + ``fault_seconds`` for an embedded client,
    ``fault_method`` with ``fault_threads``, ``huge_page_bytes`` backed by 2 MiB pages),
    ``register_seconds`` (the register calls only, not the faults between pieces),
    ``register_pieces`` (registrations made: one per mapping, more when registered in pieces) and
    ``mappings`` (per mapping: ptr, length, generation, writable, register_seconds, pieces).
    Faulted piece by piece, ``segment_ready_seconds`` is the mapping plus every piece's fault. Writes: ``put_seconds`` from put_async to ready, ``put_submit_seconds``
    spent inside put_async (the request path), ``backpressure_*`` waits for a staging slot,
    ``pending_writes`` and ``inflight_bytes`` now, ``peak_inflight_bytes``. Background warm-up
    (``warmup``): ``ready``, the reads served as misses and the writes refused meanwhile, and
    ``warmup_error`` when it failed; ``warmup_yields`` (pauses between pieces while a session was
    starting) and ``warmup_yield_seconds``."""

    put_bytes: int = 0
    put_seconds: float = 0.0
    put_submit_seconds: float = 0.0
    puts: int = 0
    put_failures: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    reads: int = 0
    read_hits: int = 0
    read_misses: int = 0
    plans_started: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    gets_started: int = 0
    gets_transferred: int = 0
    gets_cancelled: int = 0
    values_removed: int = 0
    views_held: int = 0  # restores whose copies outlived their wait: views kept (read.py)
    views_released_late: int = 0
    views_leaked: int = 0  # still copying at close: never released under DMA
    used_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    n_values: Optional[int] = None
    overlap: bool = False
    pending_writes: int = 0
    inflight_bytes: int = 0
    peak_inflight_bytes: int = 0
    backpressure_waits: int = 0
    backpressure_seconds: float = 0.0
    snapshot_bytes: int = 0
    write_pieces: int = 0
    staging_bytes: int = 0
    warmup_seconds: float = 0.0
    segment_ready_seconds: float = 0.0
    map_seconds: float = 0.0
    fault_seconds: float = 0.0
    fault_method: str = "none"
    fault_threads: int = 0
    huge_page_bytes: int = -1
    register_seconds: float = 0.0
    register_pieces: int = 0
    warmup_yields: int = 0
    warmup_yield_seconds: float = 0.0
    warmup: str = "foreground"
    ready: bool = True
    reads_while_warming: int = 0
    writes_while_warming: int = 0
    warmup_error: Optional[str] = None
    mappings: tuple = ()
    transfer: Dict[str, Any] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["mappings"] = [dict(m) for m in self.mappings]
        out.update({f"transfer_{k}": v for k, v in out.pop("transfer").items()})
        return out


class Counters:
    """Sums (``count``: added to, e.g. ``puts``, ``put_seconds``) and facts (``note``: set, e.g.
    ``overlap``, ``mappings``), each a `PlanTierStats` field; thread-safe (the completion
    thread counts too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, Any] = {}
        self._facts: dict[str, Any] = {}

    def count(self, **deltas: Any) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._sums[k] = self._sums.get(k, 0) + v

    def note(self, **facts: Any) -> None:
        with self._lock:
            self._facts.update(facts)

    def get(self, name: str, default: Any = 0) -> Any:
        with self._lock:
            return self._sums.get(name, default)

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(sums, facts)``, copies taken together."""
        with self._lock:
            return dict(self._sums), dict(self._facts)


def collect(counters: Counters, *, usage: Any, timers: Any, pending_writes: int, inflight_bytes: int,
            peak_inflight_bytes: int, staging_bytes: int, transfer: dict[str, Any]) -> PlanTierStats:
    """The snapshot: the counters, with the client's `PlanUsage` and `SegmentTimers` (either may
    be None), the write-back state now and the transfer runtime's own stats."""
    sums, facts = counters.snapshot()
    t = timers or SegmentTimers()
    used = {k: getattr(usage, k) if usage else None for k in ("used_bytes", "capacity_bytes", "n_values")}
    setup = {k: getattr(t, k) for k in ("map_seconds", "fault_seconds", "fault_method", "fault_threads", "huge_page_bytes")}
    return PlanTierStats(**sums, **facts, **used, **setup, pending_writes=pending_writes, inflight_bytes=inflight_bytes,
                         peak_inflight_bytes=peak_inflight_bytes, staging_bytes=staging_bytes, transfer=transfer)


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


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Every `Exception` leaving the block leaves as a `StoreError` (`as_store_error` of it,
    naming ``what``, the cause chained)."""
    try:
        yield
    except Exception as exc:
        error = as_store_error(exc, what)
        if error is exc:
            raise
        raise error from exc


def fail_write(handle: BlobHandle, exc: BaseException, counters: Counters) -> Exception:
    """The write of ``handle`` failed: counted and its ``error`` set (a `StoreError`), which is
    returned. Through `BlobHandle.fail`, the one place a handle takes an error."""
    counters.count(put_failures=1)
    error = exc if isinstance(exc, Exception) else PlanError(repr(exc))
    handle.fail(as_store_error(error, f"put of {handle.locator}"))
    return handle.error


def land_write(handle: BlobHandle, counters: Counters, seconds: float, **counts: Any) -> None:
    """The write of ``handle`` landed and committed: counted, then ``ready`` (the caller calls
    its ``on_ready`` after)."""
    counters.count(puts=1, put_bytes=handle.nbytes, put_seconds=seconds, **counts)
    handle.publish()
