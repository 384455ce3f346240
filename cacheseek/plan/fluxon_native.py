"""`FluxonNativePlanClient`: the Plan calls of a Fluxon client, behind `PlanClient`.

Thin wrappers: each call goes to the Fluxon client's method of the same name; this class adds the
handle states of `cacheseek.plan.base` (so a double release or an abort after commit raises here
whatever the native client does), converts segment mappings and commit results, and makes
``remove`` idempotent and ``close`` safe to repeat.

Expected native shapes (those of Fluxon's Plan API): ``wait_local_segments_ready()`` returns
mappings (objects, dicts or ``(ptr, len, generation, writable)`` tuples);
``local_fast_put_start(keys, value_len)`` returns ``(handle, plan_ptr)``;
``local_fast_put_commit(handle)`` returns a future (or a result) with ``status`` and
``key_codes``; ``get_transfer(handle)`` returns ``(plan_ptr, n_transferable)``.

The public fluxon-py 0.2.4 has none of these calls: constructing over such a client raises
`PlanUnavailableError` naming the missing calls.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Dict, Optional

from cacheseek.errors import PlanUnavailableError, StoreClosedError
from cacheseek.plan.base import (
    REQUIRED_PLAN_CALLS,
    GetPlan,
    GetPlanState,
    PutCommitResult,
    PutPlan,
    PutPlanState,
    SegmentMapping,
)
from cacheseek.registry import PLAN_CLIENTS

__all__ = ["FluxonNativePlanClient", "FluxonNativePlanSchema", "missing_plan_calls"]


@dataclasses.dataclass
class FluxonNativePlanSchema:
    _target_: str = "cacheseek.plan.fluxon_native.FluxonNativePlanClient"
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    call_timeout_s: float = 30.0


def missing_plan_calls(client: Any) -> list[str]:
    """The Plan calls ``client`` lacks (empty when it offers them all)."""
    return [name for name in REQUIRED_PLAN_CALLS if not callable(getattr(client, name, None))]


def _unavailable(what: str, missing: Sequence[str]) -> PlanUnavailableError:
    return PlanUnavailableError(
        f"{what} lacks the Plan API calls: {', '.join(missing)} (the public fluxon-py 0.2.4 has "
        f"none of them); use plan client 'embedded' until a Fluxon build with the Plan API is installed"
    )


def _build_native(config: dict[str, Any]) -> Any:
    try:
        import fluxon_py
    except ImportError as exc:
        raise PlanUnavailableError(
            "plan client 'fluxon_native' needs fluxon-py (pip install 'cacheseek[fluxon]')"
        ) from exc
    classes = [c for c in vars(fluxon_py).values() if isinstance(c, type)]
    missing = min((missing_plan_calls(c) for c in classes), key=len, default=list(REQUIRED_PLAN_CALLS))
    if missing:
        raise _unavailable(f"the installed fluxon-py {getattr(fluxon_py, '__version__', '?')}", missing)
    spec = config.get("fluxonkv_spec", {})
    ready = os.path.join(spec.get("share_mem_path", ""), spec.get("cluster_name", ""), "shared.json")
    if spec.get("share_mem_path") and not os.path.exists(ready):
        raise PlanUnavailableError(f"no Fluxon owner is serving {ready!r} (start the owner first)")
    result = fluxon_py.new_store(fluxon_py.FluxonKvClientConfig(config))
    return result.unwrap() if hasattr(result, "unwrap") else result


@PLAN_CLIENTS.register("fluxon_native", FluxonNativePlanSchema)
class FluxonNativePlanClient:
    """`PlanClient` over a Fluxon client exposing the Plan API.

    ``client``: the Fluxon client object (the caller keeps owning it). Without one, a client is
    built from ``config`` (a ``FluxonKvClientConfig`` dict) on first use and closed by `close`.
    ``call_timeout_s`` bounds the wait on a commit future that is not done yet.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        config: Optional[dict[str, Any]] = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        if client is not None:
            missing = missing_plan_calls(client)
            if missing:
                raise _unavailable(f"the Fluxon client {type(client).__name__}", missing)
        self._client = client
        self._owned = client is None
        self._config = dict(config or {})
        self.call_timeout_s = call_timeout_s
        self._closed = False

    def _native(self) -> Any:
        if self._closed:
            raise StoreClosedError("Fluxon Plan client used after close()")
        if self._client is None:
            client = _build_native(self._config)
            missing = missing_plan_calls(client)
            if missing:
                raise _unavailable(f"the Fluxon client {type(client).__name__}", missing)
            self._client = client
        return self._client

    def _check(self, plan: Any) -> Any:
        native = self._native()
        plan.check_owner(self)
        return native

    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        return [SegmentMapping.coerce(m) for m in self._native().wait_local_segments_ready()]

    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        keys = tuple(keys)
        handle, ptr = self._native().local_fast_put_start(list(keys), value_len)
        return PutPlan(keys, owner=self, native=handle, value_len=value_len), int(ptr)

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        native = self._check(plan)
        plan.advance((PutPlanState.STARTED,), PutPlanState.COMMIT_SUBMITTED, "local_fast_put_commit")
        return self._adapt(native.local_fast_put_commit(plan.native))

    def _adapt(self, native_future: Any) -> "Future[PutCommitResult]":
        out: Future[PutCommitResult] = Future()

        def settle(fut: Any) -> None:
            try:
                out.set_result(PutCommitResult.coerce(fut.result()))
            except BaseException as exc:  # the native failure travels in the future
                out.set_exception(exc)

        if callable(getattr(native_future, "add_done_callback", None)):
            native_future.add_done_callback(settle)
        elif callable(getattr(native_future, "result", None)):
            try:
                out.set_result(PutCommitResult.coerce(native_future.result(self.call_timeout_s)))
            except BaseException as exc:
                out.set_exception(exc)
        else:
            out.set_result(PutCommitResult.coerce(native_future))
        return out

    def put_abort(self, plan: PutPlan) -> None:
        native = self._check(plan)
        plan.advance((PutPlanState.STARTED,), PutPlanState.ABORTED, "put_abort")
        native.put_abort(plan.native)

    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        keys, lens = tuple(keys), tuple(atomic_group_lens)
        handle = self._native().get_start(list(keys), list(lens))
        return GetPlan(keys, owner=self, native=handle, atomic_group_lens=lens)

    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        native = self._check(plan)
        plan.expect((GetPlanState.STARTED,), "get_transfer")
        ptr, n = native.get_transfer(plan.native)
        plan.advance((GetPlanState.STARTED,), GetPlanState.TRANSFERRING, "get_transfer")
        return int(ptr), int(n)

    def cancel_get_transfer(self, plan: GetPlan) -> None:
        native = self._check(plan)
        plan.advance((GetPlanState.STARTED,), GetPlanState.CANCELLED, "cancel_get_transfer")
        native.cancel_get_transfer(plan.native)

    def release_views(self, plan: GetPlan) -> None:
        native = self._check(plan)
        plan.advance((GetPlanState.TRANSFERRING,), GetPlanState.RELEASED, "release_views")
        native.release_views(plan.native)

    def remove(self, key: str) -> None:
        try:
            self._native().remove(key)
        except Exception as exc:
            if "KeyNotFound" not in type(exc).__name__:
                raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned and self._client is not None and callable(getattr(self._client, "close", None)):
            self._client.close()
