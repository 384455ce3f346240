"""The Plan tier's write-path pieces alone: size grouping and waves, the staging layout, the
put plans of one write (`PutPlans`) over the embedded client and its faults."""

from __future__ import annotations

import numpy as np
import pytest

from cacheseek.errors import PlanError
from cacheseek.stores.plan_tier.segments import ClientCalls, direction
from cacheseek.stores.plan_tier.capacity import ALIGN, staging_layout
from cacheseek.stores.plan_tier.write import PutPlans, group_by_size, plan_waves
from cacheseek.stores.plan_tier.stats import Counters
from cacheseek.transfer.batch import Direction

from fakes.plan_faults import FaultyEmbeddedPlanClient, PlanFaults


def test_group_by_size_keeps_first_seen_order():
    assert group_by_size([64, 32, 64, 16, 32]) == {64: [0, 2], 32: [1, 4], 16: [3]}
    assert list(group_by_size([5, 1, 5])) == [5, 1]
    assert group_by_size([]) == {}


def test_waves_are_one_when_the_client_stages_nothing_or_everything_fits():
    sizes = [100, 100, 50, 50]
    assert plan_waves(sizes, None) == [[0, 1, 2, 3]]
    assert plan_waves(sizes, lambda n: 10) == [[0, 1, 2, 3]]


def test_waves_split_by_the_share_of_the_clients_staging_each_value_takes():
    # values of 100 B take half the staging each, of 50 B a quarter each
    caps = {100: 2, 50: 4}
    waves = plan_waves([100, 50, 100, 50, 100, 50], caps.__getitem__)
    assert waves == [[0, 2], [4, 1, 3], [5]]  # by size group, first-seen order
    assert sorted(i for w in waves for i in w) == list(range(6))
    for wave in waves:
        assert sum(1 / caps[[100, 50, 100, 50, 100, 50][i]] for i in wave) <= 1.0


def test_a_value_the_client_cannot_stage_at_all_is_refused():
    with pytest.raises(PlanError, match="cannot stage one value of 64 bytes"):
        plan_waves([64, 64], lambda n: 0)


def test_staging_layout_aligns_each_value():
    lengths, offsets, need = staging_layout([100, 256, 1, 300])
    assert lengths.dtype == np.int64 and list(lengths) == [100, 256, 1, 300]
    assert list(offsets) == [0, ALIGN, 2 * ALIGN, 3 * ALIGN] and need == 3 * ALIGN + 300
    assert staging_layout([ALIGN + 1, 8])[1].tolist() == [0, 2 * ALIGN]


def test_direction_between_kinds_of_memory():
    assert direction(True, False) is Direction.D2H and direction(False, True) is Direction.H2D
    assert direction(True, True) is Direction.D2D and direction(False, False) is Direction.H2H


@pytest.fixture
def client():
    faults = PlanFaults()
    c = FaultyEmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1, faults=faults)
    c.wait_local_segments_ready()
    c.faults = faults
    yield c
    c.close()


def test_one_plan_per_size_started_then_committed(client):
    counters = Counters()
    plans = PutPlans(client, counters, timeout_s=5.0)
    keys = ["a", "b", "c", "d"]
    dsts, order, sizes = plans.start(keys, [64, 32, 64, 32], ClientCalls.of(client).arena())
    assert order == [0, 2, 1, 3] and sizes == [64, 64, 32, 32] and len(set(dsts)) == 4
    assert len(plans.started) == 2 and plans.submitted == []
    plans.commit()
    assert plans.started == [] and len(plans.submitted) == 2
    assert sorted(client.keys()) == keys
    sums, _ = counters.snapshot()
    assert sums == {"plans_started": 2, "plans_committed": 2}


def test_a_failed_commit_names_the_key_codes_and_undo_removes_what_was_submitted(client):
    counters = Counters()
    client.faults.key_codes["b"] = 6000
    plans = PutPlans(client, counters, timeout_s=5.0)
    plans.start(["a", "b"], [16, 16], ClientCalls.of(client).arena())
    with pytest.raises(PlanError, match=r"commit of 2 values of 16 B: status 0, key codes b=6000") as info:
        plans.commit()
    plans.undo(info.value)
    assert client.keys() == [] and client.live_handles() == (0, 0)
    assert counters.get("values_removed") == 2 and counters.get("plans_committed") == 0


def test_undo_before_commit_aborts_every_started_plan(client):
    counters = Counters()
    plans = PutPlans(client, counters, timeout_s=5.0)
    plans.start(["a", "b", "c"], [16, 8, 16], ClientCalls.of(client).arena())
    plans.undo(RuntimeError("copy failed"))
    assert client.keys() == [] and client.live_handles() == (0, 0)
    assert counters.get("plans_aborted") == 2 and counters.get("values_removed") == 0


def test_commits_of_waves_are_checked_per_call_and_undone_together(client):
    counters = Counters()
    plans = PutPlans(client, counters, timeout_s=5.0)
    plans.start(["a"], [16], ClientCalls.of(client).arena())
    plans.commit()
    plans.start(["b"], [16], ClientCalls.of(client).arena())
    client.faults.arm("commit_status")
    with pytest.raises(PlanError, match="status 1") as info:
        plans.commit()
    assert counters.get("plans_committed") == 1  # the first wave's commit only
    plans.undo(info.value)
    assert client.keys() == []  # both waves' keys removed
