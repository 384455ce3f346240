"""`PlanFaults` and the faulty in-process Plan clients: failures injected around the embedded
Plan store's steps (and its device subclass's), outside the product.

Points (each fires on the ``nth`` next time the client reaches it, ``times`` times):
``put_start`` (start raises PlanError), ``commit_raise`` (the commit call raises after it was
submitted), ``commit_status`` (the commit resolves with status 1, nothing published),
``get_start``, ``get_transfer`` (raises; the plan stays STARTED), ``remove`` (raises),
``table_magic`` / ``table_count`` / ``table_null`` (the next table is written corrupt).
``key_codes[key] = code`` makes the commit of ``key`` return that code (not published).

`FaultyEmbeddedPlanClient` / `FaultyDevicePlanClient` are the real clients with the points around
their policy hooks (`FaultPoints`); ``faults=`` (a `PlanFaults`, a new one by default) is their
one extra keyword, ``client.faults`` the armed set.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future
from collections.abc import Sequence
from typing import Any, Optional

from cacheseek.errors import PlanError
from cacheseek.plan.base import GetPlan, PutCommitResult, PutPlan
from cacheseek.plan.device import DevicePlanClient
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.plan.inprocess import check_group_lens
from cacheseek.plan.table import PLAN_MAGIC

__all__ = ["FaultPoints", "FaultyDevicePlanClient", "FaultyEmbeddedPlanClient", "PlanFaults"]


class PlanFaults:
    """The armed points (module docstring); ``fired`` lists each point as it fired."""

    POINTS = (
        "put_start", "commit_raise", "commit_status", "get_start", "get_transfer", "remove",
        "table_magic", "table_count", "table_null",
    )

    def __init__(self) -> None:
        self._armed: dict[str, list[list[int]]] = {}
        self.key_codes: dict[str, int] = {}
        self.fired: list[str] = []

    def arm(self, point: str, *, nth: int = 1, times: int = 1) -> None:
        if point not in self.POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(self.POINTS)}")
        self._armed.setdefault(point, []).append([nth - 1, times])

    def fire(self, point: str) -> bool:
        for entry in self._armed.get(point, []):
            if entry[1] <= 0:
                continue
            if entry[0] > 0:
                entry[0] -= 1
                continue
            entry[1] -= 1
            self.fired.append(point)
            return True
        return False

    def key_code(self, key: str) -> int:
        return self.key_codes.get(key, 0)


def _resolved(result: PutCommitResult) -> "Future[PutCommitResult]":
    future: Future[PutCommitResult] = Future()
    future.set_result(result)
    return future


class FaultPoints:
    """The points around `EmbeddedPlanClient`'s hooks, each where the step would fail for real."""

    faults: PlanFaults

    def __init__(self, *args: Any, faults: Optional[PlanFaults] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults if faults is not None else PlanFaults()

    def _reserve(self, keys: tuple[str, ...], value_len: int) -> Any:
        self._ensure_segment()
        self._allocator()
        if self.faults.fire("put_start"):
            raise PlanError(f"injected fault: local_fast_put_start of {len(keys)} keys")
        return super()._reserve(keys, value_len)

    def _submit_commit(self, plan: PutPlan) -> "Future[PutCommitResult]":
        record = plan.native
        if self.faults.fire("commit_raise"):
            self._free_values(record.values)
            raise PlanError(f"injected fault: local_fast_put_commit of {len(plan.keys)} keys")
        if self.faults.fire("commit_status"):
            self._free_values(record.values)
            return _resolved(PutCommitResult(1, (0,) * len(plan.keys), "injected fault: commit status"))
        codes = tuple(self.faults.key_code(v.key) for v in record.values)
        if not any(codes):
            return super()._submit_commit(plan)
        self._free_values([v for v, code in zip(record.values, codes) if code])
        record.values = [v for v, code in zip(record.values, codes) if not code]
        super()._submit_commit(plan).result()
        return _resolved(PutCommitResult(0, codes))

    def get_start(self, keys: Sequence[str], atomic_group_lens: Sequence[int]) -> GetPlan:
        check_group_lens(tuple(keys), tuple(atomic_group_lens))
        with self._lock:
            self._ensure_segment()
            if self.faults.fire("get_start"):
                raise PlanError(f"injected fault: get_start of {len(keys)} keys")
            return super().get_start(keys, atomic_group_lens)

    def _transfer_pointers(self, record: Any) -> list[int]:
        if self.faults.fire("get_transfer"):
            raise PlanError("injected fault: get_transfer")
        return super()._transfer_pointers(record)

    def remove(self, key: str) -> None:
        with self._lock:
            self._check_open()
            if self.faults.fire("remove"):
                raise PlanError(f"injected fault: remove {key!r}")
            super().remove(key)

    def _write_table(self, pointers: list[int]) -> tuple[int, int]:
        off, ptr = super()._write_table(pointers)
        word = ctypes.c_uint64
        if self.faults.fire("table_magic"):
            word.from_address(ptr).value = PLAN_MAGIC ^ 0xFF
        if self.faults.fire("table_count"):
            word.from_address(ptr + 8).value = len(pointers) + 1
        if self.faults.fire("table_null") and pointers:
            word.from_address(ptr + 16).value = 0
        return off, ptr


class FaultyEmbeddedPlanClient(FaultPoints, EmbeddedPlanClient):
    pass


class FaultyDevicePlanClient(FaultPoints, DevicePlanClient):
    pass
