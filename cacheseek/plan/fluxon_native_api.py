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
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Optional

from cacheseek.errors import PlanError, PlanUnavailableError
from cacheseek.plan.base import REQUIRED_PLAN_CALLS, GetPlan, PutCommitResult, SegmentMapping

__all__ = ["as_int", "missing_plan_calls", "unavailable", "build_native", "inside", "keys_text", "transferable",
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
