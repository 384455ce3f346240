"""The transfer seams: `TransferRuntime` (synchronous batches) and `AsyncTransfer` (streams,
events and batches that return before they land).

A transfer runtime moves bytes between host mappings registered with it and device ranges
declared per batch (`cacheseek.transfer.memory`), in batches of copies
(`cacheseek.transfer.batch`). Every runtime in this package extends `TransferRuntimeBase`
(`cacheseek.transfer.base`), which offers both.

Synchronous batch lifecycle (`TransferRuntime.copy_batch`)::

    cut every copy whose host side spans two registrations (a mapping registered in pieces) at
    the joint (`cacheseek.transfer.joints`)
    validate every copy (positive size, each range inside a registered mapping or a declared
    device range, direction consistent, destinations disjoint)   -> TransferError, nothing submitted
    submit every copy on the stream (one batched call where offered, else one call per copy)
    synchronize the stream once                                   -> returns: every byte has landed
    a submission failed after earlier ones went out: synchronize, then raise TransferError

So when ``copy_batch`` returns or raises, no copy of that batch is still in flight: the caller may
commit, abort or release the memory behind it. The asynchronous lifecycle is in
`cacheseek.transfer.pending`; the registration lifecycle in `cacheseek.transfer.registrations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union, runtime_checkable

from cacheseek.transfer.batch import BatchLike
from cacheseek.transfer.memory import HostMapping, MemoryRange
from cacheseek.transfer.pending import Event, PendingBatch
from cacheseek.transfer.stats import TransferStats

__all__ = ["TransferRuntime", "AsyncTransfer"]


@runtime_checkable
class TransferRuntime(Protocol):
    """Moves bytes between registered host mappings and device ranges, in validated batches.

    ``device_kind`` is ``"cpu"`` or ``"cuda"``: the kind of tensors whose memory the runtime
    treats as device ranges (see `device_range`).
    """

    device_kind: str

    def register(self, mappings: Sequence[HostMapping]) -> None:
        """Register each mapping once (dedup by ``(ptr, length, generation)``) and count this call
        as one user of it; a read-only mapping falls back to a read-only registration; already
        registered is success. Raises `RegistrationError` naming the mapping that failed;
        mappings before it stay registered (and counted)."""
        ...

    def unregister(self, mappings: Sequence[HostMapping]) -> None:
        """Drop one user of each mapping; the last user's call unregisters it (unknown mappings
        are ignored)."""
        ...

    def device_range(self, tensor: Any) -> MemoryRange:
        """The bytes of a contiguous tensor of this runtime's device kind, to declare in a batch's
        ``device_ranges``. Raises `TransferError` for a tensor of another device or layout."""
        ...

    def copy_batch(
        self,
        descriptors: BatchLike,
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
    ) -> None:
        """Validate the whole batch, submit it on ``stream`` (None: the caller's current stream),
        synchronize once. Raises `TransferError`; on return or raise nothing is in flight."""
        ...

    @property
    def stats(self) -> TransferStats: ...

    def close(self) -> None:
        """Unregister everything this runtime registered. Idempotent."""
        ...


@runtime_checkable
class AsyncTransfer(Protocol):
    """Capability: streams, events and batches that return before they land
    (`cacheseek.transfer.pending`)."""

    def new_stream(self) -> Any: ...

    def destroy_stream(self, stream: Any) -> None: ...

    def current_stream(self, stream: Any = None) -> Any:
        """``stream`` resolved to the runtime's handle; None: the caller's current stream."""
        ...

    def record_event(self, stream: Any = None) -> Event: ...

    def release_event(self, event: Event) -> None: ...

    def stream_wait(self, stream: Any, event: Union[Event, PendingBatch]) -> None: ...

    def submit_batch(
        self,
        batch: BatchLike,
        *,
        stream: Any = None,
        device_ranges: Sequence[MemoryRange] = (),
        after: Sequence[Union[Event, PendingBatch]] = (),
    ) -> PendingBatch: ...
