"""The Fluxon client's bounded calls: `FluxonCalls` is the policy over the shared mechanism
(`cacheseek.bounded_calls.BoundedCalls`, which fluxon-py calls need: a call issued after its owner
died was seen to return only after ~450 s): raw errors from fluxon-py become `StoreError`, and
messages name the cluster.
"""

from __future__ import annotations

from typing import Optional

from cacheseek.bounded_calls import MAX_STUCK_CALLS, BoundedCalls
from cacheseek.errors import CacheSeekError, StoreClosedError, StoreError, StoreTimeoutError
from cacheseek.fluxon.results import Miss

__all__ = ["BoundedCalls", "FluxonCalls", "MAX_STUCK_CALLS"]


class FluxonCalls(BoundedCalls):
    """The Fluxon client's calls (``owner``: its instance key) to one cluster."""

    def __init__(self, op_timeout_s: float, *, owner: str, cluster_name: str, share_mem_path: str) -> None:
        super().__init__(op_timeout_s, name="fluxon", field="store.op_timeout_s")
        self.op_timeout_s = self.timeout_s
        self._owner = owner
        self._cluster_name = cluster_name
        self._share_mem_path = share_mem_path

    def refusal(self, what: str, op: str) -> Optional[BaseException]:
        if self.closed and op != "close":
            return StoreClosedError(f"{what}: the Fluxon client {self._owner} is closed")
        if self.stuck >= self.max_stuck:
            return StoreTimeoutError(
                f"{what} not issued: {self.stuck} earlier Fluxon calls are still stuck (the service "
                f"of cluster {self._cluster_name!r} is probably gone)")
        return None

    def wrap(self, what: str, exc: BaseException) -> BaseException:
        if isinstance(exc, (CacheSeekError, Miss)) or not isinstance(exc, Exception):
            return exc
        err = StoreError(f"{what} raised {type(exc).__name__}: {exc}")  # raw fluxon-py or etcd client
        err.__cause__ = exc
        return err

    def timed_out(self, what: str, timeout: float, field: str, ptr_note: bool) -> StoreTimeoutError:
        note = " Keep the source memory valid: the call may still read it." if ptr_note else ""
        return StoreTimeoutError(
            f"{what} did not complete within {timeout:.1f} s (cluster {self._cluster_name!r} "
            f"at {self._share_mem_path}); the service may be stopped or overloaded. The call "
            f"goes on in the background.{note}")
