"""The Plan seam: the calls a Plan store client offers, its handles and their lifecycles.

The names follow Fluxon's Plan API (docs/design.md section 2). A *plan pointer* addresses a FXPLANV1
table of value pointers (`cacheseek.plan.table`); values are raw bytes with no shape or dtype.
The caller moves the bytes itself (a transfer runtime) between the values and its tensors.

Put plan lifecycle (``PutPlan.state``)::

    local_fast_put_start(keys, value_len) -> (PutPlan STARTED, plan_ptr)
        value_len bytes are reserved for every key (one size per plan: group keys by size);
        plan_ptr's table holds the reserved, writable value pointers in key order; readers see
        nothing yet.
    local_fast_put_commit(plan) -> COMMIT_SUBMITTED; returns Future[PutCommitResult]
        call it only after every copy into the values has been synchronized. On status 0, each
        key whose code is 0 is published (an older value under that key is replaced and freed
        once no reader holds it); a key with a nonzero code is not published. Check the status
        AND every key code. A submitted plan is never aborted.
    put_abort(plan) -> ABORTED
        releases the reservation; only from STARTED.

Get plan lifecycle (``GetPlan.state``)::

    get_start(keys, atomic_group_lens) -> GetPlan STARTED
        the groups partition ``keys`` in order and are all-or-nothing; the transferable prefix is
        the leading whole groups whose every key exists; those values are held from now on (a
        remove or an overwrite defers freeing their bytes).
    get_transfer(plan) -> TRANSFERRING; returns (plan_ptr, n_transferable)
        plan_ptr's table holds the n_transferable value pointers (whole groups only). A failed
        get_transfer leaves the plan STARTED: cancel it.
    cancel_get_transfer(plan) -> CANCELLED
        consumes a STARTED plan without transferring and releases everything it held.
    release_views(plan) -> RELEASED
        only from TRANSFERRING, after the copies out of the values are synchronized; the values
        may move or be evicted afterwards. A partial prefix the caller will not use is ended the
        same way, with nothing copied.

So a get plan is consumed by exactly one of get_transfer/cancel_get_transfer, and a transferred
one is ended by exactly one release_views. Any other verb raises `HandleStateError` (commit after
abort, abort after commit, a second release, a handle of another client). ``remove(key)`` is
idempotent; ``close()`` is idempotent and any call after it raises `StoreClosedError`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional, Protocol, runtime_checkable

import attrs

from cacheseek.errors import HandleStateError

__all__ = ["SegmentMapping", "PutCommitResult", "PutPlanState", "GetPlanState", "PutPlan", "GetPlan", "PlanClient",
           "PlanClientInfo", "PlanSharedRecords", "PlanValueLengths", "PlanSegmentPieces", "PlanUsage",
           "SegmentTimers", "PLAN_OK", "REQUIRED_PLAN_CALLS"]

PLAN_OK = 0

REQUIRED_PLAN_CALLS = ("wait_local_segments_ready", "local_fast_put_start", "local_fast_put_commit", "put_abort",
                       "get_start", "get_transfer", "cancel_get_transfer", "release_views", "remove")


def _positive(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(slots=True)
class SegmentMapping:
    """A host segment of the Plan store as this process maps it: ``length`` bytes at ``ptr``;
    ``generation`` changes when the segment is recreated; ``writable`` False for a read-only
    mapping (register it read-only). ``on_device``: the segment is memory of the runtime's device
    (the HBM tier's pool): never registered, declared as a device range, copied D2D."""

    ptr: int = attrs.field(validator=_positive)
    length: int = attrs.field(validator=_positive)
    generation: int = attrs.field(validator=attrs.validators.instance_of(int))
    writable: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    on_device: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

@attrs.frozen(slots=True)
class PutCommitResult:
    """What a commit future resolves to: an overall ``status`` (0 = ok) and one code per key of
    the plan, in key order (0 = published)."""

    status: int
    key_codes: tuple[int, ...] = attrs.field(converter=tuple)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == PLAN_OK and all(c == PLAN_OK for c in self.key_codes)

class PutPlanState(str, enum.Enum):
    STARTED = "started"
    COMMIT_SUBMITTED = "commit_submitted"
    ABORTED = "aborted"


class GetPlanState(str, enum.Enum):
    STARTED = "started"
    TRANSFERRING = "transferring"
    CANCELLED = "cancelled"
    RELEASED = "released"


@attrs.define(eq=False)
class _PlanHandle:
    """Common handle mechanics: the owning client and guarded state transitions. Made only by the
    client that owns it; ``native`` is that client's private record."""

    keys: tuple[str, ...] = attrs.field(converter=tuple)
    owner: object = attrs.field(repr=False)
    native: Any = attrs.field(default=None, repr=False)

    def check_owner(self, client: object) -> None:
        if self.owner is not client:
            raise HandleStateError(f"{type(self).__name__} belongs to another Plan client")

    def expect(self, allowed: tuple, verb: str) -> None:
        """Raise HandleStateError unless the state is one of ``allowed``."""
        state = self.state  # type: ignore[attr-defined]
        if state not in allowed:
            raise HandleStateError(
                f"{verb} on a {type(self).__name__} in state {state.value}"
                f" (allowed from: {', '.join(s.value for s in allowed)})"
            )

    def advance(self, allowed: tuple, new: enum.Enum, verb: str) -> None:
        """Move to ``new`` if the state is one of ``allowed``; else raise HandleStateError."""
        self.expect(allowed, verb)
        self.state = new  # type: ignore[attr-defined]


@attrs.define(eq=False)
class PutPlan(_PlanHandle):
    value_len: int = 0
    state: PutPlanState = PutPlanState.STARTED


@attrs.define(eq=False)
class GetPlan(_PlanHandle):
    atomic_group_lens: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    state: GetPlanState = GetPlanState.STARTED


@runtime_checkable
class PlanClient(Protocol):
    """The Plan calls of docs/design.md section 2. See the module docstring for each lifecycle."""

    def wait_local_segments_ready(self) -> list[SegmentMapping]:
        """Block until this process's host segments are mapped; return them (register each with
        the transfer runtime once)."""
        ...

    def local_fast_put_start(self, keys: Sequence[str], value_len: int) -> tuple[PutPlan, int]:
        """Reserve ``value_len`` bytes per key; returns the plan and its table's address. Raises
        `StoreFullError` when the reservation does not fit."""
        ...

    def local_fast_put_commit(self, plan: PutPlan) -> "Future[PutCommitResult]": ...

    def put_abort(self, plan: PutPlan) -> None: ...

    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan: ...

    def get_transfer(self, plan: GetPlan) -> tuple[int, int]:
        """``(plan_ptr, n_transferable)``."""
        ...

    def cancel_get_transfer(self, plan: GetPlan) -> None: ...

    def release_views(self, plan: GetPlan) -> None: ...

    def remove(self, key: str) -> None:
        """Delete the value under ``key`` (a held view defers freeing its bytes). Idempotent."""
        ...

    def close(self) -> None: ...


@attrs.frozen(slots=True)
class PlanUsage:
    used_bytes: int
    capacity_bytes: int
    n_values: int


@attrs.frozen(slots=True)
class SegmentTimers:
    """Setup costs of the segments: mapping, pre-faulting (``fault_method``: "madvise",
    "touch" or "none", from ``fault_threads`` threads). ``huge_page_bytes``: bytes of the segment
    backed by 2 MiB pages after the fault (-1 when unknown)."""

    map_seconds: float = 0.0
    fault_seconds: float = 0.0
    fault_method: str = "none"
    fault_threads: int = 0
    huge_page_bytes: int = -1
    segment_bytes: int = 0


@runtime_checkable
class PlanClientInfo(Protocol):
    """Optional capability: a client that reports where its plan tables live, its usage and its
    segment setup timers."""

    def table_arena(self) -> Optional[tuple[int, int]]:
        """``(ptr, length)`` of the memory every plan table lies in, or None if unknown."""
        ...

    def usage(self) -> PlanUsage: ...

    def segment_timers(self) -> SegmentTimers: ...


@runtime_checkable
class PlanSharedRecords(Protocol):
    """Optional capability: a client whose values other processes read too (a Fluxon cluster)
    offers the chunk records of its store (`cacheseek.kv.records.ChunkRecords`, the shared
    index), so that a chunk any of them committed is found by its key. A client without it (the
    embedded client: its segment lives in one process) keeps none."""

    @property
    def records(self) -> Any:
        """The store's `ChunkRecords`."""
        ...


@runtime_checkable
class PlanValueLengths(Protocol):
    """Optional capability: a client that knows the byte length of every value it hands out.

    A Plan table holds bare pointers, so without it a reader trusts its own size records; with
    it, the reader checks every value against its target before the first copy and never reads
    past a value."""

    def value_lengths(self, plan: GetPlan) -> tuple[int, ...]:
        """Byte lengths of the transferable values of a TRANSFERRING plan, in key order."""
        ...


@runtime_checkable
class PlanSegmentPieces(Protocol):
    """Optional capability: a client whose segments can be mapped first and pre-faulted part by
    part, so a warm-up can fault a piece, register it with the transfer runtime, then fault the
    next (registration starts early; no single call holds the process's locks for long)."""

    def map_local_segments(self) -> list[SegmentMapping]:
        """The segments mapped, not necessarily pre-faulted (``wait_local_segments_ready``
        afterwards faults whatever is left)."""
        ...

    def fault_local_range(self, ptr: int, length: int) -> None:
        """Pre-fault ``length`` bytes at ``ptr`` (inside a segment of `map_local_segments`)."""
        ...
