"""What the native Fluxon Plan API must offer, and how its answers are read and checked.

`FluxonNativePlanClient` calls these: whether a client class offers every Plan call
(`missing_plan_calls`), building the native client from the installed fluxon-py (`build_native`),
and the checks of what the native calls return (a transferable count at a group boundary, a commit
result with one code per key, a value inside a segment mapping). Each refusal is a `PlanError` or
`PlanUnavailableError` naming the call and its keys.
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Optional

from cacheseek.errors import CacheSeekError, PlanError, PlanUnavailableError
from cacheseek.plan.base import REQUIRED_PLAN_CALLS, GetPlan, PutCommitResult, SegmentMapping
from cacheseek.plan.table import decode_plan_table

__all__ = ["as_int", "bounded_commit", "checked_pointers", "missing_plan_calls", "unavailable", "build_native", "inside", "keys_text", "transferable",
           "segment_mapping", "commit_result", "settle_once"]


def missing_plan_calls(client: Any) -> list[str]:
    """The Plan calls ``client`` lacks (empty when it offers them all)."""
    return [name for name in REQUIRED_PLAN_CALLS if not callable(getattr(client, name, None))]


def unavailable(what: str, missing: Sequence[str]) -> PlanUnavailableError:
    return PlanUnavailableError(
        f"{what} lacks the Plan API calls: {', '.join(missing)} (the public fluxon-py 0.2.4 has "
        f"none of them); use plan client 'embedded' until a Fluxon build with the Plan API is installed"
    )


def build_native(config: dict[str, Any]) -> Any:
    try:
        import fluxon_py
    except ImportError as exc:
        raise PlanUnavailableError(
            "plan client 'fluxon_native' needs fluxon-py (pip install 'cacheseek[fluxon]')"
        ) from exc
    classes = [c for c in vars(fluxon_py).values() if isinstance(c, type)]
    missing = min((missing_plan_calls(c) for c in classes), key=len, default=list(REQUIRED_PLAN_CALLS))
    if missing:
        raise unavailable(f"the installed fluxon-py {getattr(fluxon_py, '__version__', '?')}", missing)
    spec = config.get("fluxonkv_spec", {})
    ready = os.path.join(spec.get("share_mem_path", ""), spec.get("cluster_name", ""), "shared.json")
    if spec.get("share_mem_path") and not os.path.exists(ready):
        raise PlanUnavailableError(f"no Fluxon owner is serving {ready!r} (start the owner first)")
    result = fluxon_py.new_store(fluxon_py.FluxonKvClientConfig(config))
    return result.unwrap() if hasattr(result, "unwrap") else result


def inside(mappings: Sequence[SegmentMapping], ptr: int, nbytes: int, *, writable: bool) -> bool:
    return any(m.ptr <= ptr and ptr + nbytes <= m.ptr + m.length and (m.writable or not writable)
               for m in mappings)


def keys_text(keys: Sequence[str]) -> str:
    if not keys:
        return ""
    return f" of {keys[0]!r}" + (f" (+{len(keys) - 1} keys)" if len(keys) > 1 else "")


def as_int(value: Any) -> Any:
    """An integral value (a numpy int, say) as an int; anything else unchanged (and refused by
    the check that follows)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def transferable(n: Any, plan: GetPlan) -> int:
    """``n`` checked: an int within the plan, at a group boundary."""
    ends, pos = {0}, 0
    for g in plan.atomic_group_lens:
        pos += g
        ends.add(pos)
    n = as_int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n not in ends:
        raise PlanError(f"fluxon_native get_transfer{keys_text(plan.keys)}: {n!r} transferable values is not a "
                        f"whole-group prefix of the {len(plan.keys)} keys (groups {list(plan.atomic_group_lens)})")
    return n


def segment_mapping(value: Any) -> SegmentMapping:
    """A native ``(ptr, length, generation, writable)`` as a `SegmentMapping`."""
    ptr, length, generation, writable = value
    return SegmentMapping(int(ptr), int(length), int(generation), bool(writable))


def commit_result(value: Any, keys: tuple[str, ...]) -> PutCommitResult:
    """A native ``(status, key_codes)``, one code per key, as a `PutCommitResult`."""
    try:
        status, codes = value
        result = PutCommitResult(int(status), tuple(int(c) for c in codes))
    except (TypeError, ValueError, IndexError) as exc:
        raise PlanError(f"fluxon_native commit{keys_text(keys)}: unreadable result {value!r}") from exc
    if len(result.key_codes) != len(keys):
        raise PlanError(f"fluxon_native commit{keys_text(keys)}: {len(result.key_codes)} key codes for "
                        f"{len(keys)} keys")
    return result


def settle_once(out: Future, *, result: Any = None, exception: Optional[BaseException] = None) -> None:
    try:
        if exception is not None:
            out.set_exception(exception)
        else:
            out.set_result(result)
    except InvalidStateError:  # the deadline (or the result) came first
        pass


def checked_pointers(op: str, ptr: Any, keys: Sequence[str], nbytes: Optional[Sequence[int]], *, writable: bool,
                     mappings: Callable[[], Sequence[SegmentMapping]],
                     arena: Optional[Callable[[], Optional[tuple[int, int]]]]) -> list[int]:
    """The value pointers of the native table at ``ptr`` (``len(keys)`` values of ``nbytes``
    bytes each, or of unknown length), checked before this process reads any of them: the table
    itself (`decode_plan_table`, inside the native client's ``arena`` when it reports one), then
    every value inside one of ``mappings()`` (writable ones for a put). A failure is a `PlanError`
    naming the call and the key."""
    try:
        # nothing transferable: the native table is not read
        pointers = decode_plan_table(as_int(ptr), len(keys), arena=arena() if callable(arena) else None) if keys else []
    except CacheSeekError as exc:
        raise PlanError(f"fluxon_native {op}{keys_text(keys)}: bad plan table: {exc}") from exc
    segments = mappings()
    for i, p in enumerate(pointers):
        n = nbytes[i] if nbytes is not None else 1
        if not inside(segments, p, n, writable=writable):
            raise PlanError(
                f"fluxon_native {op}: value {keys[i]!r} [{p:#x}, +{n}) lies outside every "
                f"{'writable ' if writable else ''}segment mapping of wait_local_segments_ready")
    return pointers


def bounded_commit(native_future: Any, keys: tuple[str, ...], timeout_s: float,
                   expired: Callable[[], BaseException]) -> "Future[PutCommitResult]":
    """A Future of a native commit's result (`commit_result`), settled at most ``timeout_s``
    from now (with ``expired()`` past it). The native future may offer ``add_done_callback``, or
    only ``result`` (waited for off the caller's thread), or be the result itself."""
    out: Future[PutCommitResult] = Future()
    timer: Optional[threading.Timer] = None

    def settle(get: Callable[[], Any]) -> None:
        if timer is not None:
            timer.cancel()
        try:
            result = commit_result(get(), keys)
        except BaseException as exc:  # noqa: BLE001 - the failure travels in the future
            settle_once(out, exception=exc)
        else:
            settle_once(out, result=result)

    if callable(getattr(native_future, "add_done_callback", None)) or callable(
            getattr(native_future, "result", None)):
        timer = threading.Timer(timeout_s, lambda: settle_once(out, exception=expired()))
        timer.daemon = True
        timer.start()
        if callable(getattr(native_future, "add_done_callback", None)):
            native_future.add_done_callback(lambda fut: settle(fut.result))
        else:  # a result-only future: wait for it off the caller's thread
            threading.Thread(target=settle, args=(native_future.result,), daemon=True,
                             name="fluxon_native-commit").start()
    else:
        settle(lambda: native_future)
    return out
