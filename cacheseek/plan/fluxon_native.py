"""`FluxonNativePlanClient`: the Plan calls of a Fluxon client, behind `PlanClient`.

Each call goes to the Fluxon client's method of the same name. This class adds what the native
calls do not promise:

- a time bound: every native call runs through `BoundedCalls` and is waited for at most
  ``op_timeout_s`` (connecting and ``wait_local_segments_ready``, the attach, ``attach_timeout_s``);
  a commit future that has not settled by then resolves to `StoreTimeoutError`. A call that
  returns after its caller gave up is cleaned up then (a late reservation is aborted, a late get
  plan cancelled or released);
- checked tables in a reused arena: the native table of a plan is validated (non-null, aligned,
  inside the native client's table arena when it reports one, magic, count, no null pointer,
  every value inside a segment mapping of `wait_local_segments_ready`, writable for a put) and
  copied into this client's `TableArena` (sized from the geometry, reused across plans; ``n * 8``
  bytes a plan), whose bounds `table_arena` reports so the reader checks every table address too.
  The copy is needed because the native API hands out tables in memory this process cannot
  bound: a bad address would be read blind. A failure is a `PlanError` naming the keys;
- the handle states of `cacheseek.plan.base` (a double release or an abort after commit raises
  here whatever the native client does), converted segment mappings and commit results (a result
  without one code per key is refused), ``remove`` idempotent, ``close`` safe to repeat; an error
  of the native client that is not CacheSeek's own becomes a `PlanError` naming the call.

Expected native shapes (those of Fluxon's Plan API): ``wait_local_segments_ready()`` returns
mappings (objects, dicts or ``(ptr, len, generation, writable)`` tuples);
``local_fast_put_start(keys, value_len)`` returns ``(handle, plan_ptr)``;
``local_fast_put_commit(handle)`` returns a future (or a result) with ``status`` and
``key_codes``; ``get_transfer(handle)`` returns ``(plan_ptr, n_transferable)``. Optional:
``value_lengths(handle)`` (the byte length of each transferable value; this client then offers
`PlanValueLengths`) and ``table_arena()``.

The public fluxon-py 0.2.4 has none of these calls (its clients offer put/get of whole values
and ``put_payload_from_ptr_blocking``/``get_payload_into_ptr_blocking``): constructing over such
a client raises `PlanUnavailableError` naming the missing calls.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional

import attrs

from cacheseek.errors import CacheSeekError, PlanError, StoreClosedError, StoreTimeoutError
from cacheseek.bounded_calls import BoundedCalls
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.plan.base import GetPlan, GetPlanState, PutCommitResult, PutPlan, PutPlanState, SegmentMapping
from cacheseek.plan.fluxon_native_api import (bounded_commit, build_native, checked_pointers, keys_text,
                                              missing_plan_calls, segment_mapping, transferable, unavailable)
from cacheseek.plan.table_arena import TableArena, table_arena_for
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.sizes import AUTO, Size, parse_size

__all__ = ["FluxonNativePlanClient", "missing_plan_calls"]

log = logging.getLogger(__name__)

_OP_FIELD = "store.client_options.op_timeout_s"
_ATTACH_FIELD = "store.client_options.attach_timeout_s"
_ARENA_FIELD = "store.client_options.table_arena_bytes"
_HINT = ": the Fluxon owner may be stopped or overloaded (check that it runs)"


@attrs.define(eq=False)
class _Record:
    """This client's side of a plan: the native handle and the plan's table in the arena."""

    handle: Any
    table: Optional[int] = None  # offset in the arena
    lengths: Optional[tuple[int, ...]] = None  # of the transferable values, when the native reports them
    native_transferred: bool = False  # the native get_transfer returned: end it with release_views
    transfer_stuck: bool = False  # a timed-out native get_transfer may still return
    late_settled: bool = False  # that call returned after its caller gave up
    end_deferred: bool = False  # the plan was ended while that call was stuck


@PLAN_CLIENTS.register("fluxon_native", objects=("client", "endpoint"))
class FluxonNativePlanClient:
    """`PlanClient` over a Fluxon client exposing the Plan API (see the module docstring).

    ``client``: the Fluxon client object (the caller keeps owning it). Without one, a client is
    built from ``config`` (a ``FluxonKvClientConfig`` dict) on first use and closed by `close`.
    ``op_timeout_s`` bounds every Plan call and the settling of a commit; ``attach_timeout_s``
    connecting and ``wait_local_segments_ready``. ``table_arena_bytes``: the arena of plan tables
    (`TableArena`; auto sizes it from ``value_bytes`` and ``chunk_bytes``, the largest value and
    one chunk's KV, which the Plan tier passes); one chunk's table must fit (`ConfigError`).
    ``endpoint``: a `FluxonEndpoint` (the ``fluxon`` Plan client's connection options) gives the
    config and both time bounds instead.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        config: Optional[dict[str, Any]] = None,
        op_timeout_s: float = 30.0,
        attach_timeout_s: float = 60.0,
        table_arena_bytes: Optional[Size] = AUTO,
        value_bytes: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        endpoint: Optional[FluxonEndpoint] = None,
    ) -> None:
        if endpoint is not None:
            config, op_timeout_s, attach_timeout_s = endpoint.native_spec(), endpoint.op_timeout_s, endpoint.attach_timeout_s
        if client is not None:
            missing = missing_plan_calls(client)
            if missing:
                raise unavailable(f"the Fluxon client {type(client).__name__}", missing)
        self._calls = BoundedCalls(op_timeout_s, name="fluxon_native", field=_OP_FIELD, hint=_HINT)
        BoundedCalls(attach_timeout_s, name="fluxon_native", field=_ATTACH_FIELD)  # validates the field
        self.op_timeout_s = float(op_timeout_s)
        self.attach_timeout_s = float(attach_timeout_s)
        size = parse_size(table_arena_bytes, _ARENA_FIELD, allow_auto=True, allow_none=True, minimum=4096)
        size = table_arena_for(value_bytes, chunk_bytes) if size in (None, AUTO) else size
        TableArena.check_fits(size, _ARENA_FIELD, value_bytes, chunk_bytes)
        self._tables = TableArena(size, full_fix=f"raise {_ARENA_FIELD}")
        self._client = client
        self._owned = client is None
        self._config = dict(config or {})
        self._lock = threading.RLock()
        self._mappings: Optional[list[SegmentMapping]] = None
        self._closed = False

    # -- bounded calls --------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], Any], keys: Sequence[str] = (), *,
              on_late: Any = None, attach: bool = False) -> Any:
        """``fn()`` bounded by op_timeout_s (attach_timeout_s when ``attach``); an error of the
        native client other than a CacheSeekError or a bad argument (ValueError, TypeError)
        becomes a `PlanError` naming the call."""
        bound = dict(timeout_s=self.attach_timeout_s, field=_ATTACH_FIELD) if attach else {}
        try:
            return self._calls.run(op, fn, on_late=on_late, **bound)
        except (CacheSeekError, ValueError, TypeError):  # ours, or a bad argument: as is
            raise
        except Exception as exc:
            raise PlanError(f"fluxon_native {op}{keys_text(keys)} raised {type(exc).__name__}: {exc}") from exc

    def _native(self) -> Any:
        if self._closed:
            raise StoreClosedError("Fluxon Plan client used after close()")
        with self._lock:
            if self._client is None:
                def close_late(client: Any, _error: Any) -> None:
                    if client is not None and callable(getattr(client, "close", None)):
                        client.close()

                client = self._call("connect", lambda: build_native(self._config), on_late=close_late, attach=True)
                missing = missing_plan_calls(client)
                if missing:
                    raise unavailable(f"the Fluxon client {type(client).__name__}", missing)
                self._client = client
            return self._client

    def _check(self, plan: Any) -> Any:
        native = self._native()
        plan.check_owner(self)
        return native

    # -- segments -------------------------------------------------------------------------------
    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        native = self._native()
        raw = self._call("wait_local_segments_ready", native.wait_local_segments_ready, attach=True)
        try:
            mappings = [segment_mapping(m) for m in raw]
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise PlanError(f"fluxon_native wait_local_segments_ready returned an invalid mapping: {exc}") from exc
        with self._lock:
            self._mappings = mappings
        return mappings

    def _segments(self) -> list[SegmentMapping]:
        with self._lock:
            mappings = self._mappings
        return mappings if mappings is not None else self.wait_local_segments_ready()

    def table_arena(self) -> Optional[tuple[int, int]]:
        """`PlanClientInfo.table_arena`: every table this client hands out lies in it."""
        return self._tables.bounds

    table_bytes_in_use = property(lambda self: self._tables.used,
                                  doc="Bytes of the arena held by plan tables not released yet (0 once every plan ended).")
    config = property(lambda self: dict(self._config),
                      doc="A copy of the ``FluxonKvClientConfig`` dict an owned native client is built from.")

    def _copy_table(self, op: str, native: Any, ptr: Any, keys: Sequence[str], *, nbytes: Optional[Sequence[int]],
                    writable: bool) -> tuple[int, int]:
        """Validate the native table at ``ptr`` (``len(keys)`` values of ``nbytes`` bytes each,
        or of unknown length) and copy it into the arena: ``(offset, address)``."""
        pointers = checked_pointers(op, ptr, keys, nbytes, writable=writable, mappings=self._segments,
                                    arena=getattr(native, "table_arena", None))
        with self._lock:
            return self._tables.write(pointers)

    def _free_table(self, record: _Record) -> None:
        with self._lock:
            if record.table is not None:
                self._tables.free(record.table)
                record.table = None

    # -- put ------------------------------------------------------------------------------------
    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        keys = tuple(keys)
        native = self._native()

        def abort_late(started: Any, _error: Any) -> None:
            if started is not None:
                native.put_abort(started[0])

        handle, ptr = self._call("local_fast_put_start", lambda: native.local_fast_put_start(list(keys), value_len),
                                 keys, on_late=abort_late)
        try:
            table, address = self._copy_table("local_fast_put_start", native, ptr, keys,
                                              nbytes=[value_len] * len(keys), writable=True)
        except BaseException as exc:
            try:
                self._call("put_abort", lambda: native.put_abort(handle), keys)
            except Exception as abort_error:  # noqa: BLE001 - the first error is the one to report
                exc.add_note(f"aborting the reservation failed too: {abort_error!r}")
            raise
        return PutPlan(keys, owner=self, native=_Record(handle, table), value_len=value_len), address

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        native = self._check(plan)
        plan.advance((PutPlanState.STARTED,), PutPlanState.COMMIT_SUBMITTED, "local_fast_put_commit")
        record: _Record = plan.native
        self._free_table(record)  # the caller decoded it at start; the values are written
        result = self._call("local_fast_put_commit", lambda: native.local_fast_put_commit(record.handle), plan.keys)
        return bounded_commit(result, plan.keys, self.op_timeout_s, lambda: StoreTimeoutError(
            f"fluxon_native commit of {len(plan.keys)} keys{keys_text(plan.keys)} did not settle within "
            f"{self.op_timeout_s:g} s ({_OP_FIELD}){_HINT}; if it is only slow, raise {_OP_FIELD}"))

    def put_abort(self, plan: PutPlan) -> None:
        native = self._check(plan)
        plan.advance((PutPlanState.STARTED,), PutPlanState.ABORTED, "put_abort")
        record: _Record = plan.native
        self._free_table(record)
        self._call("put_abort", lambda: native.put_abort(record.handle), plan.keys)

    # -- get ------------------------------------------------------------------------------------
    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        bad = any(not isinstance(g, int) or isinstance(g, bool) or g <= 0 for g in lens)
        if not keys or bad or sum(lens) != len(keys):
            raise ValueError(f"atomic_group_lens {lens} must be positive and sum to the {len(keys)} keys")
        native = self._native()

        def cancel_late(handle: Any, _error: Any) -> None:
            if handle is not None:
                native.cancel_get_transfer(handle)

        handle = self._call("get_start", lambda: native.get_start(list(keys), list(lens)), keys, on_late=cancel_late)
        return GetPlan(keys, owner=self, native=_Record(handle), atomic_group_lens=lens)

    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        """``(table, n)``: the table lies in this client's arena; every value was checked to lie in
        a segment mapping (whole, when the native client reports value lengths). On any failure
        the plan stays STARTED: cancel it (the native side is ended accordingly)."""
        native = self._check(plan)
        plan.expect((GetPlanState.STARTED,), "get_transfer")
        record: _Record = plan.native
        if record.transfer_stuck or record.native_transferred:
            raise PlanError(f"fluxon_native get_transfer{keys_text(plan.keys)}: an earlier get_transfer of this "
                            "plan failed or timed out; cancel it")

        def transferred_late(_value: Any, error: Optional[BaseException]) -> None:
            with self._lock:
                record.late_settled = True
                record.transfer_stuck = False
                record.native_transferred = error is None
                end = record.end_deferred
            if end:
                self._end_native(native, record)

        issued: list[bool] = []

        def transfer() -> Any:
            issued.append(True)
            return native.get_transfer(record.handle)

        try:
            ptr, n = self._call("get_transfer", transfer, plan.keys, on_late=transferred_late)
        except StoreTimeoutError:
            with self._lock:  # unless the late outcome came in first
                record.transfer_stuck = bool(issued) and not record.late_settled
            raise
        with self._lock:
            record.native_transferred = True
        n = transferable(n, plan)
        lengths = None
        if callable(getattr(native, "value_lengths", None)):
            lengths = tuple(int(x) for x in self._call("value_lengths", lambda: native.value_lengths(record.handle),
                                                       plan.keys))
            if len(lengths) != n:
                raise PlanError(f"fluxon_native value_lengths{keys_text(plan.keys)}: {len(lengths)} lengths for "
                                f"{n} transferable values")
        table, address = self._copy_table("get_transfer", native, ptr, plan.keys[:n], nbytes=lengths, writable=False)
        record.table, record.lengths = table, lengths
        plan.advance((GetPlanState.STARTED,), GetPlanState.TRANSFERRING, "get_transfer")
        return address, n

    @property
    def value_lengths(self) -> Optional[Callable[[GetPlan], tuple[int, ...]]]:
        """`PlanValueLengths` when the native client reports value lengths (``value_lengths(handle)``),
        else None: the reader then trusts its own size records."""
        native = self._client
        return self._lengths if callable(getattr(native, "value_lengths", None)) else None

    def _lengths(self, plan: GetPlan) -> tuple[int, ...]:
        self._check(plan)
        plan.expect((GetPlanState.TRANSFERRING,), "value_lengths")
        lengths = plan.native.lengths
        if lengths is None:
            raise PlanError("fluxon_native value_lengths: the native client reported none for this plan")
        return lengths

    def cancel_get_transfer(self, plan: GetPlan) -> None:
        native = self._check(plan)
        plan.advance((GetPlanState.STARTED,), GetPlanState.CANCELLED, "cancel_get_transfer")
        self._end_native(native, plan.native)

    def release_views(self, plan: GetPlan) -> None:
        native = self._check(plan)
        plan.advance((GetPlanState.TRANSFERRING,), GetPlanState.RELEASED, "release_views")
        self._end_native(native, plan.native)

    def _end_native(self, native: Any, record: _Record) -> None:
        """End the native plan the way its state needs: release_views after a native
        get_transfer, cancel before one, later when a get_transfer of it is stuck."""
        self._free_table(record)
        with self._lock:
            if record.transfer_stuck:
                record.end_deferred = True
                log.warning("fluxon_native: a get plan ended while its get_transfer is stuck; it is ended "
                            "natively when that call returns")
                return
            transferred = record.native_transferred
        if transferred:
            self._call("release_views", lambda: native.release_views(record.handle))
        else:
            self._call("cancel_get_transfer", lambda: native.cancel_get_transfer(record.handle))

    # -- remove / close -------------------------------------------------------------------------
    def remove(self, key: str) -> None:
        native = self._native()

        def remove() -> None:
            try:
                native.remove(key)
            except Exception as exc:
                if "KeyNotFound" not in type(exc).__name__:
                    raise

        self._call("remove", remove, (key,))

    def close(self) -> None:
        """Idempotent. Waits (bounded by op_timeout_s) for calls in flight; closes a native
        client this one built unless a call into it is stuck (it is then left open: closing
        native state under a live call is what item 8 of the fault review forbids)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        idle = self._calls.wait_idle(self.op_timeout_s)
        if self._owned and self._client is not None and callable(getattr(self._client, "close", None)):
            if idle and not self._calls.stuck:
                self._call("close", self._client.close)
            else:
                log.warning("fluxon_native: %d native calls stuck at close: the Fluxon client is left open "
                            "until process exit", self._calls.stuck)
        with self._lock:
            self._tables.close()

    @property
    def closed(self) -> bool:
        return self._closed
