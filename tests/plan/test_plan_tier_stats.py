"""The Plan tier's counters alone: sums and facts from several threads, and the snapshot's
fields (what reports read)."""

from __future__ import annotations

import threading

import attrs

from cacheseek.plan.base import PlanUsage
from cacheseek.stores.plan_tier.stats import Counters, PlanTierStats, collect


def test_counts_from_many_threads_add_up():
    counters = Counters()

    def work():
        for _ in range(1000):
            counters.count(puts=1, put_bytes=8)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.snapshot()[0] == {"puts": 4000, "put_bytes": 32000}
    assert counters.get("puts") == 4000 and counters.get("reads") == 0


def test_the_snapshot_carries_counters_facts_usage_and_write_back_state():
    counters = Counters()
    counters.count(puts=2, put_seconds=0.5)
    counters.note(overlap=True, mappings=({"ptr": 1, "length": 2},))
    stats = collect(counters, usage=PlanUsage(used_bytes=10, capacity_bytes=100, n_values=3), timers=None,
                    pending_writes=1, inflight_bytes=64, peak_inflight_bytes=128, staging_bytes=4096,
                    transfer={"batches": 5})
    assert isinstance(stats, PlanTierStats)
    assert (stats.puts, stats.put_seconds, stats.overlap) == (2, 0.5, True)
    assert (stats.used_bytes, stats.capacity_bytes, stats.n_values) == (10, 100, 3)
    assert (stats.pending_writes, stats.inflight_bytes, stats.peak_inflight_bytes, stats.staging_bytes) == (1, 64, 128, 4096)
    assert (stats.fault_method, stats.huge_page_bytes) == ("none", -1)
    out = stats.as_dict()
    assert out["transfer_batches"] == 5 and "transfer" not in out and out["mappings"] == [{"ptr": 1, "length": 2}]
    assert set(out) - {"transfer_batches"} == {f.name for f in attrs.fields(PlanTierStats)} - {"transfer"}


def test_a_closed_or_silent_client_leaves_usage_unknown():
    stats = collect(Counters(), usage=None, timers=None, pending_writes=0, inflight_bytes=0,
                    peak_inflight_bytes=0, staging_bytes=0, transfer={})
    assert (stats.used_bytes, stats.capacity_bytes, stats.n_values, stats.overlap) == (None, None, None, False)
