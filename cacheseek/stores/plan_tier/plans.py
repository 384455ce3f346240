"""The put plans of one write: grouped by value size, started, committed and checked, or undone
so that nothing of the write stays in the store.

Lifecycle of `PutPlans` (a plan is in exactly one of ``started`` and ``submitted``)::

    start(keys, lengths)  one plan per value size (``local_fast_put_start``): -> started;
                          returns where each value goes (decoded from the plan's table)
    commit()              ``local_fast_put_commit`` of every started plan (-> submitted, before
                          the call, so a commit call that raised counts as submitted), then every
                          status and key code of this call's commits checked: `PlanError`
                          naming each failure, `StoreTimeoutError` past ``timeout_s``
    undo(exc)             ``put_abort`` of every started plan; each submitted plan's commit
                          waited for, then each of its keys removed (a submitted commit is never
                          aborted); a failure of these is a note on ``exc``

Start, commit, undo all count into `Counters` (``plans_started``, ``plans_committed``,
``plans_aborted``, ``values_removed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from cacheseek.errors import PlanError, StoreTimeoutError, add_note
from cacheseek.plan.base import PlanClient, PutCommitResult, PutPlan
from cacheseek.plan.table import decode_plan_table
from cacheseek.stores.plan_tier.stats import Counters

__all__ = ["PutPlans", "group_by_size", "plan_waves"]


def group_by_size(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Item indices by value size, in first-seen order (one Plan per size)."""
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    return groups


def plan_waves(sizes: Sequence[int], max_plan_values: Optional[Callable[[int], int]]) -> list[list[int]]:
    """Item indices in waves of plans whose staging fits the client at once (its optional
    ``max_plan_values(value_len)``); one wave when the client stages no bytes of its own or
    everything fits. Each wave is started, copied and committed before the next starts."""
    everything = [list(range(len(sizes)))]
    if max_plan_values is None:
        return everything
    by_size = group_by_size(sizes)
    fits = {n: int(max_plan_values(n)) for n in by_size}
    for n, cap in fits.items():
        if cap < 1:
            raise PlanError(f"the Plan client cannot stage one value of {n} bytes (raise its staging)")
    if sum(len(idxs) / fits[n] for n, idxs in by_size.items()) <= 1.0:
        return everything
    waves: list[list[int]] = [[]]
    share = 0.0
    for n, idxs in by_size.items():
        for i in idxs:
            if share + 1.0 / fits[n] > 1.0 + 1e-9:
                waves.append([])
                share = 0.0
            waves[-1].append(i)
            share += 1.0 / fits[n]
    return waves


class PutPlans:
    """The plans of one write on ``client`` (see the module docstring for the lifecycle)."""

    def __init__(self, client: PlanClient, counters: Counters, timeout_s: float) -> None:
        self._client = client
        self._counters = counters
        self._timeout_s = timeout_s
        self.started: list[PutPlan] = []
        self.submitted: list[PutPlan] = []
        self._futures: dict[PutPlan, Future] = {}

    def start(
        self, keys: Sequence[str], lengths: Sequence[int], arena: Optional[tuple[int, int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """Start one plan per size group (each in ``started`` once started); returns the value
        pointers, the item indices and the sizes, all in group order."""
        dsts: list[int] = []
        order: list[int] = []
        sizes: list[int] = []
        for nbytes, idxs in group_by_size(lengths).items():
            plan, table = self._client.local_fast_put_start([keys[i] for i in idxs], nbytes)
            self.started.append(plan)
            self._counters.count(plans_started=1)
            dsts += decode_plan_table(table, len(idxs), arena=arena)
            order += idxs
            sizes += [nbytes] * len(idxs)
        return dsts, order, sizes

    def commit(self) -> None:
        """Commit every started plan and check every status and key code of these commits;
        raises `PlanError` naming each failure."""
        now: list[PutPlan] = []
        while self.started:
            plan = self.started.pop(0)
            self.submitted.append(plan)
            now.append(plan)
            self._futures[plan] = self._client.local_fast_put_commit(plan)
        failures = []
        for plan in now:
            result = self._result(plan, self._futures[plan])
            if not result.ok:
                bad = [f"{k}={c}" for k, c in zip(plan.keys, result.key_codes) if c]
                failures.append(
                    f"commit of {len(plan.keys)} values of {plan.value_len} B: status "
                    f"{result.status}{', key codes ' + ', '.join(bad) if bad else ''}"
                    f"{' (' + result.message + ')' if result.message else ''}"
                )
        if failures:
            raise PlanError("; ".join(failures))
        self._counters.count(plans_committed=len(now))

    def _result(self, plan: PutPlan, future: Future) -> PutCommitResult:
        try:
            return future.result(timeout=self._timeout_s)
        except FutureTimeout as exc:
            raise StoreTimeoutError(
                f"commit of {len(plan.keys)} values not done after {self._timeout_s} s"
            ) from exc

    def undo(self, exc: BaseException) -> None:
        """Abort every uncommitted plan; remove every key of a submitted one (after its commit
        settled), so that a failed write leaves nothing behind."""
        for plan in self.started:
            try:
                self._client.put_abort(plan)
                self._counters.count(plans_aborted=1)
            except Exception as abort_error:
                add_note(exc, f"put_abort failed too: {abort_error!r}")
        for plan in self.submitted:
            future = self._futures.get(plan)
            if future is not None:
                try:
                    future.result(timeout=self._timeout_s)
                except Exception:
                    pass  # its keys are removed below whatever the commit's outcome
            for key in plan.keys:
                try:
                    self._client.remove(key)
                    self._counters.count(values_removed=1)
                except Exception as remove_error:
                    add_note(exc, f"remove({key!r}) after a failed commit failed too: {remove_error!r}")
