"""The mechanisms the in-process Plan clients share, each alone: host segments, plan-table
arenas and the in-order call runner. No Plan client, no torch."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cacheseek.errors import PlanError, PlanTableError
from cacheseek.plan.pipeline import run_in_order
from cacheseek.plan.segment import PAGE, HostSegment, auto_threads, page_round
from cacheseek.plan.table import decode_plan_table
from cacheseek.plan.table_arena import TableArena

MiB = 1 << 20


# -- HostSegment --------------------------------------------------------------------------------


@pytest.mark.parametrize("backing", ["shared", "private", "shm"])
def test_host_segment_is_writable_memory_of_the_size_asked(backing, tmp_path):
    seg = HostSegment(3 * MiB, backing, str(tmp_path), 2, prefault=True, hugepages=False)
    try:
        assert seg.length == 3 * MiB and seg.ptr and not seg.closed
        assert seg.fault_method in ("madvise", "touch", "mixed") and seg.threads >= 1
        ctypes.memset(seg.ptr + seg.length - 1, 0x5A, 1)
        assert ctypes.string_at(seg.ptr + seg.length - 1, 1) == b"\x5a"
        assert seg.huge_bytes == 0  # not asked for huge pages
        assert len(os.listdir(tmp_path)) == (1 if backing == "shm" else 0)
    finally:
        seg.close()
    seg.close()  # idempotent
    assert seg.closed and os.listdir(tmp_path) == []  # the shm file is unlinked


def test_host_segment_without_prefault_and_a_bad_backing():
    seg = HostSegment(MiB, "private", None, 0, prefault=False)
    try:
        assert seg.fault_method == "none" and seg.threads == 0 and seg.fault_seconds >= 0
    finally:
        seg.close()
    with pytest.raises(ValueError, match="unknown backing 'tmpfs'"):
        HostSegment(MiB, "tmpfs", None, 0, prefault=False)


def test_sizes_round_to_pages_and_threads_to_cpus():
    assert page_round(1) == PAGE and page_round(PAGE) == PAGE and page_round(PAGE + 1) == 2 * PAGE
    assert auto_threads(3) == 3 and 1 <= auto_threads(0) <= 16


# -- TableArena ---------------------------------------------------------------------------------


def test_table_arena_writes_tables_the_caller_can_decode():
    arena = TableArena(4096, full_fix="raise my.table_arena_bytes")
    try:
        off, ptr = arena.write([0x1000, 0x2000, 0x3000])
        assert ptr == arena.ptr + off and ptr % 64 == 0
        assert decode_plan_table(ptr, 3, arena=(arena.ptr, arena.length)) == [0x1000, 0x2000, 0x3000]
        with pytest.raises(PlanTableError):
            decode_plan_table(ptr, 2, arena=(arena.ptr, arena.length))  # the count is checked
        off2, _ = arena.write([0x4000])
        assert off2 != off and arena.used == 64 + 64
        arena.free(off)
        arena.free(off2)
        assert arena.used == 0
    finally:
        arena.close()
    arena.close()  # idempotent


def test_a_full_table_arena_names_the_fix():
    arena = TableArena(4096, full_fix="raise my.table_arena_bytes")
    try:
        arena.write([1] * 500)  # 4016 bytes: a 4032-byte block
        arena.write([1, 2])  # 32 bytes fit the last 64
        with pytest.raises(PlanError) as info:
            arena.write([1])
        assert str(info.value) == ("plan table arena full (4096 of 4096 B in live tables, 24 B wanted); end "
                                   "plans sooner or raise my.table_arena_bytes")
        with pytest.raises(PlanError, match="not allocated"):
            arena.free(8)  # freeing what is not a table raises
    finally:
        arena.close()


# -- run_in_order -------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 3])
def test_calls_settle_in_index_order_with_at_most_width_in_flight(width):
    in_flight, peak, lock = [0], [0], threading.Lock()

    def call(i):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.01 * ((7 - i) % 3))  # later calls may finish first
        with lock:
            in_flight[0] -= 1
        return i * i

    settled = []
    with ThreadPoolExecutor(4) as pool:
        run_in_order(8, call, lambda i, fut: settled.append((i, fut.result())), lambda: False,
                     width=width, pool=lambda: pool)
    assert settled == [(i, i * i) for i in range(8)]
    assert peak[0] <= width


@pytest.mark.parametrize("width", [1, 2])
def test_stop_and_limit_end_issuing_but_every_issued_call_is_settled(width):
    issued, settled, stop = [], [], [False]

    def call(i):
        issued.append(i)
        if i == 2:
            raise KeyError(i)
        return i

    def settle(i, fut):
        settled.append(i)
        if fut.exception() is not None:
            stop[0] = True

    with ThreadPoolExecutor(2) as pool:
        run_in_order(10, call, settle, lambda: stop[0], width=width, pool=lambda: pool)
    assert 2 in settled and sorted(issued) == settled  # nothing issued is left unsettled
    assert max(issued) <= 2 + width  # issuing stopped once the error was settled
    issued.clear(), settled.clear()
    run_in_order(10, lambda i: issued.append(i), lambda i, f: settled.append(i), lambda: False,
                 width=1, limit=lambda: 4)
    assert issued == settled == [0, 1, 2, 3]
