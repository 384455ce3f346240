"""The embedded Plan client: segments, allocator, key index, views, capacity. What every Plan client
does (handle states, transferable prefixes, another client's handles) is tests/fluxon/test_plan_conformance.py,
which runs on this client in the normal suite."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from cacheseek.errors import ConfigError, PlanError, PlanTableError, StoreClosedError, StoreFullError
from cacheseek.plan import segment as segment_mod
from cacheseek.plan.base import GetPlanState, PlanClient, PlanClientInfo, PutPlanState
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.plan.table import decode_plan_table
from cacheseek.registry import PLAN_CLIENTS

from fakes.plan_faults import FaultyEmbeddedPlanClient, PlanFaults

MiB = 1 << 20


@pytest.fixture
def client():
    c = FaultyEmbeddedPlanClient(segment_bytes=MiB, prefault_threads=2)
    yield c
    c.close()


def put(c, keys, data: bytes):
    plan, table = c.local_fast_put_start(keys, len(data))
    for p in decode_plan_table(table, len(keys), arena=c.table_arena()):
        ctypes.memmove(p, data, len(data))
    result = c.local_fast_put_commit(plan).result()
    assert result.ok
    return plan


def read(c, keys, n_bytes, groups=None, *, with_ptrs=False):
    plan = c.get_start(keys, groups or [1] * len(keys))
    table, n = c.get_transfer(plan)
    ptrs = decode_plan_table(table, n, arena=c.table_arena())
    values = [ctypes.string_at(p, n_bytes) for p in ptrs]
    return (plan, values, ptrs) if with_ptrs else (plan, values)


def test_is_a_plan_client_with_info(client):
    assert isinstance(client, PlanClient) and isinstance(client, PlanClientInfo)
    assert PLAN_CLIENTS.get("embedded") is EmbeddedPlanClient


@pytest.mark.parametrize("backing", ["shared", "private", "shm"])
def test_segment_ready_prefaulted_and_generation_one(backing, tmp_path):
    c = EmbeddedPlanClient(segment_bytes=2 * MiB, backing=backing, shm_dir=str(tmp_path))
    (m,) = c.wait_local_segments_ready()
    assert (m.length, m.generation, m.writable) == (2 * MiB, 1, True)
    timers = c.segment_timers()
    assert timers.fault_method in ("madvise", "touch", "mixed") and timers.fault_seconds >= 0
    assert c.wait_local_segments_ready() == [m]  # ready once
    if backing == "shm":
        assert len(os.listdir(tmp_path)) == 1
    c.close()
    if backing == "shm":
        assert os.listdir(tmp_path) == []


def test_prefault_uses_several_threads_for_large_segments(monkeypatch):
    monkeypatch.setattr(segment_mod, "PREFAULT_SLICE", MiB)
    started = []
    real = threading.Thread.start

    def spy(self):
        started.append(self)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", spy)
    c = EmbeddedPlanClient(segment_bytes=8 * MiB, prefault_threads=4)
    c.wait_local_segments_ready()
    assert len(started) == 3  # four slices: the caller's thread and three workers
    c.close()


def test_put_get_round_trip_and_accounting(client):
    put(client, ["a", "b"], b"x" * 300)
    u = client.usage()
    assert (u.used_bytes, u.n_values, u.capacity_bytes) == (2 * 512, 2, MiB)  # 256-B blocks
    plan, values = read(client, ["a", "b"], 300)
    assert values == [b"x" * 300] * 2
    client.release_views(plan)
    assert client.live_handles() == (0, 0)


def test_values_are_aligned(client):
    plan, table = client.local_fast_put_start(["a", "b", "c"], 100)
    assert all(p % 256 == 0 for p in decode_plan_table(table, 3))
    client.put_abort(plan)


def test_store_full_is_clear_and_rolls_back(client):
    put(client, ["a"], b"1" * (MiB // 2))
    with pytest.raises(StoreFullError, match=r"store full: need 1048576 bytes .* of 1048576 used; raise store.segment_bytes or free values"):
        client.local_fast_put_start(["b", "c"], MiB // 2)
    assert client.usage().used_bytes == MiB // 2
    assert client.live_handles() == (0, 0)


def test_allocator_coalesces_freed_neighbours(client):
    quarter = MiB // 4
    put(client, ["a", "b", "c", "d"], b"q" * quarter)
    client.remove("b")
    client.remove("c")
    put(client, ["bc"], b"h" * (2 * quarter))  # fits only if b and c merged
    client.remove("a")
    client.remove("d")
    client.remove("bc")
    assert client.usage().used_bytes == 0
    put(client, ["all"], b"z" * MiB)


def test_remove_during_a_read_defers_the_free(client):
    put(client, ["a"], b"A" * 1000)
    plan, _, (ptr,) = read(client, ["a"], 1000, with_ptrs=True)
    client.remove("a")
    client.remove("a")  # idempotent
    assert client.usage().n_values == 0
    assert client.usage().used_bytes == 1024  # still held by the view
    put(client, ["b"], b"B" * 1000)  # must not land on a's bytes
    assert ctypes.string_at(ptr, 1000) == b"A" * 1000
    client.release_views(plan)
    assert client.usage().used_bytes == 1024


def test_overwrite_during_a_read_defers_the_free(client):
    put(client, ["a"], b"1" * 512)
    plan, _, (old_ptr,) = read(client, ["a"], 512, with_ptrs=True)
    put(client, ["a"], b"2" * 512)
    assert ctypes.string_at(old_ptr, 512) == b"1" * 512
    plan2, values = read(client, ["a"], 512)
    assert values == [b"2" * 512]
    client.release_views(plan)
    client.release_views(plan2)
    assert client.usage().used_bytes == 512 and client.usage().n_values == 1


def test_failed_get_transfer_leaves_plan_started(client):
    client.faults.arm("get_transfer")
    put(client, ["a"], b"1" * 8)
    plan = client.get_start(["a"], [1])
    with pytest.raises(PlanError, match="injected"):
        client.get_transfer(plan)
    assert plan.state is GetPlanState.STARTED
    client.cancel_get_transfer(plan)
    assert client.live_handles() == (0, 0)


@pytest.mark.parametrize("point", ["table_magic", "table_count", "table_null"])
def test_corrupt_tables_are_caught_by_the_decoder(client, point):
    client.faults.arm(point)
    plan, table = client.local_fast_put_start(["a", "b"], 8)
    with pytest.raises(PlanTableError):
        decode_plan_table(table, 2, arena=client.table_arena())
    client.put_abort(plan)
    assert client.usage().used_bytes == 0


def test_commit_faults():
    faults = PlanFaults()
    c = FaultyEmbeddedPlanClient(segment_bytes=MiB, faults=faults)
    faults.key_codes["b"] = 4000
    plan, _ = c.local_fast_put_start(["a", "b"], 8)
    result = c.local_fast_put_commit(plan).result()
    assert (result.status, result.key_codes, result.ok) == (0, (0, 4000), False)
    assert c.keys() == ["a"]
    faults.arm("commit_status")
    plan, _ = c.local_fast_put_start(["c"], 8)
    result = c.local_fast_put_commit(plan).result()
    assert result.status == 1 and not result.ok and "c" not in c.keys()
    faults.arm("commit_raise")
    plan, _ = c.local_fast_put_start(["d"], 8)
    with pytest.raises(PlanError):
        c.local_fast_put_commit(plan)
    assert plan.state is PutPlanState.COMMIT_SUBMITTED
    assert c.usage().used_bytes == 256 and c.live_handles() == (0, 0)
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.arm("nope")
    c.close()


def test_recreate_bumps_generation_and_drops_values(client):
    put(client, ["a"], b"1" * 8)
    plan = client.get_start(["a"], [1])
    with pytest.raises(PlanError, match="1 get plans are live"):
        client.recreate_segment()
    client.cancel_get_transfer(plan)
    (m,) = client.recreate_segment()
    assert m.generation == 2 == client.generation
    assert client.usage().n_values == 0


def test_close_is_idempotent_and_use_after_close_raises():
    c = EmbeddedPlanClient(segment_bytes=MiB)
    plan, _ = c.local_fast_put_start(["a"], 8)
    c.close()
    c.close()
    for call in (
        lambda: c.wait_local_segments_ready(),
        lambda: c.local_fast_put_start(["b"], 8),
        lambda: c.local_fast_put_commit(plan),
        lambda: c.get_start(["a"], [1]),
        lambda: c.remove("a"),
    ):
        with pytest.raises(StoreClosedError):
            call()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"segment_bytes": 0}, "store.segment_bytes"), ({"backing": "nvme"}, "store.backing"), ({"alignment": 100}, "store.alignment")],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        EmbeddedPlanClient(**kwargs)


def test_thread_safe_under_concurrent_plans(client):
    errors = []

    def worker(i: int) -> None:
        try:
            for j in range(50):
                key = f"t{i}-{j}"
                put(client, [key], bytes([i]) * 700)
                plan, values = read(client, [key], 700)
                assert values == [bytes([i]) * 700]
                client.remove(key)
                client.release_views(plan)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.usage().used_bytes == 0 and client.live_handles() == (0, 0)
