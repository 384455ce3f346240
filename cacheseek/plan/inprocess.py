"""`InProcessPlanClient`: the Plan verbs every in-process client runs the same way.

The embedded store and the Fluxon public client differ in where a plan's values live and how a
commit publishes them; the mechanism around that is shared here: argument checks, the handle
states of `cacheseek.plan.base` (every verb checks the handle is this open client's and moves it
along its lifecycle), the live-handle sets, and the plan tables in a `TableArena`. A subclass
supplies the policy:

    _reserve(keys, value_len) -> (record, pointers)   reserve a put's values; ``pointers`` go
                                                      into its table (``record.table`` is set here)
    _unreserve(record)                                give a put's reservation back (abort, or
                                                      its table could not be written)
    _submit_commit(plan) -> Future[PutCommitResult]   publish a submitted put (its table is freed)
    _transfer_pointers(record) -> pointers            a started get's value addresses
    _lengths(record) -> lengths                       a transferring get's value byte lengths
    _release_held(record)                             let go of what an ended get held

and optionally ``_before_reserve(keys, value_len)`` (checks outside the lock). Records carry
``table``: the offset of their table in the arena, or None.

State a subclass sets up (with ``super().__init__()``): ``_lock`` (an RLock), ``_closed``, the
live put and get plans, ``_tables`` (its `TableArena` once mapped, None after close) and
``_timers``. ``get_start``, ``remove`` and ``close`` are the subclass's own.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

from cacheseek.errors import StoreClosedError
from cacheseek.plan.base import GetPlan, GetPlanState, PutCommitResult, PutPlan, PutPlanState, SegmentTimers
from cacheseek.plan.table_arena import TableArena

__all__ = ["InProcessPlanClient", "check_put_keys", "check_group_lens"]


def check_put_keys(keys: tuple[str, ...], value_len: int) -> None:
    """ValueError unless ``keys`` are distinct non-empty strings and ``value_len`` a positive int."""
    if not keys or len(set(keys)) != len(keys) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError("local_fast_put_start needs distinct, non-empty string keys")
    if not isinstance(value_len, int) or isinstance(value_len, bool) or value_len <= 0:
        raise ValueError(f"value_len must be a positive int, got {value_len!r}")


def check_group_lens(keys: tuple[str, ...], lens: tuple[int, ...]) -> None:
    """ValueError unless ``lens`` are positive ints that sum to ``len(keys)`` (and keys exist)."""
    bad = any(not isinstance(g, int) or isinstance(g, bool) or g <= 0 for g in lens)
    if not keys or bad or sum(lens) != len(keys):
        raise ValueError(f"atomic_group_lens {lens} must be positive and sum to the {len(keys)} keys")


class InProcessPlanClient(abc.ABC):
    """The shared verbs (see the module docstring); ``_client_name`` names the client in errors."""

    _client_name = "Plan client"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self._live_puts: set[PutPlan] = set()
        self._live_gets: set[GetPlan] = set()
        self._tables: Optional[TableArena] = None
        self._timers = SegmentTimers()

    # -- capability: PlanClientInfo -------------------------------------------------------------
    def table_arena(self) -> Optional[tuple[int, int]]:
        with self._lock:
            return None if self._tables is None else (self._tables.ptr, self._tables.length)

    def segment_timers(self) -> SegmentTimers:
        return self._timers

    def live_handles(self) -> tuple[int, int]:
        """``(put plans STARTED, get plans not yet ended)``: both 0 when every handle was consumed."""
        with self._lock:
            return len(self._live_puts), len(self._live_gets)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- put ------------------------------------------------------------------------------------
    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        keys = tuple(keys)
        check_put_keys(keys, value_len)
        self._before_reserve(keys, value_len)
        with self._lock:
            record, pointers = self._reserve(keys, value_len)
            try:
                record.table, ptr = self._write_table(pointers)
            except BaseException:
                self._unreserve(record)
                raise
            plan = PutPlan(keys, owner=self, native=record, value_len=value_len)
            self._live_puts.add(plan)
            return plan, ptr

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        with self._lock:
            self._check_handle(plan)
            plan.advance((PutPlanState.STARTED,), PutPlanState.COMMIT_SUBMITTED, "local_fast_put_commit")
            self._live_puts.discard(plan)
            self._free_table_of(plan.native)
            return self._submit_commit(plan)

    def put_abort(self, plan: PutPlan) -> None:
        with self._lock:
            self._check_handle(plan)
            plan.advance((PutPlanState.STARTED,), PutPlanState.ABORTED, "put_abort")
            self._live_puts.discard(plan)
            self._free_table_of(plan.native)
            self._unreserve(plan.native)

    # -- get ------------------------------------------------------------------------------------
    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.STARTED,), "get_transfer")
            pointers = self._transfer_pointers(plan.native)
            plan.native.table, ptr = self._write_table(pointers)
            plan.advance((GetPlanState.STARTED,), GetPlanState.TRANSFERRING, "get_transfer")
            return ptr, len(pointers)

    def value_lengths(self, plan: GetPlan) -> tuple[int, ...]:
        """See `PlanValueLengths`."""
        with self._lock:
            self._check_handle(plan)
            plan.expect((GetPlanState.TRANSFERRING,), "value_lengths")
            return self._lengths(plan.native)

    def cancel_get_transfer(self, plan: GetPlan) -> None:
        with self._lock:
            self._check_handle(plan)
            plan.advance((GetPlanState.STARTED,), GetPlanState.CANCELLED, "cancel_get_transfer")
            self._end_read(plan)

    def release_views(self, plan: GetPlan) -> None:
        with self._lock:
            self._check_handle(plan)
            plan.advance((GetPlanState.TRANSFERRING,), GetPlanState.RELEASED, "release_views")
            self._end_read(plan)

    def _end_read(self, plan: GetPlan) -> None:
        self._live_gets.discard(plan)
        self._free_table_of(plan.native)
        self._release_held(plan.native)

    # -- policy ---------------------------------------------------------------------------------
    def _before_reserve(self, keys: tuple[str, ...], value_len: int) -> None:
        """Checks before the lock is taken (none by default)."""

    @abc.abstractmethod
    def _reserve(self, keys: tuple[str, ...], value_len: int) -> tuple[Any, list[int]]: ...

    @abc.abstractmethod
    def _unreserve(self, record: Any) -> None: ...

    @abc.abstractmethod
    def _submit_commit(self, plan: PutPlan) -> "Future[PutCommitResult]": ...

    @abc.abstractmethod
    def _transfer_pointers(self, record: Any) -> list[int]: ...

    @abc.abstractmethod
    def _lengths(self, record: Any) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def _release_held(self, record: Any) -> None: ...

    # -- internals ------------------------------------------------------------------------------
    def _write_table(self, pointers: list[int]) -> tuple[int, int]:
        if self._tables is None:
            raise StoreClosedError(f"{self._client_name} has no table arena (closed)")
        return self._tables.write(pointers)

    def _free_table_of(self, record: Any) -> None:
        if record.table is not None and self._tables is not None:
            self._tables.free(record.table)
        record.table = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._client_name} used after close()")

    def _check_handle(self, plan: Any) -> None:
        self._check_open()
        plan.check_owner(self)
