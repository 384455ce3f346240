"""The Plan tier's capacity role alone: staging slot and in-flight byte accounting
(`StagingSlots`, with a counting allocator instead of device memory) and the segment's removals
(`SegmentCapacity`, over a dict-backed client)."""

from __future__ import annotations

import threading
import time

import pytest

from cacheseek.errors import PlanError, StoreClosedError, StoreError, StoreTimeoutError, WriteNotCompleteError
from cacheseek.kv.handles import BlobHandle, Tier
from cacheseek.stores.plan_tier.capacity import SLOT_ROUND, SegmentCapacity, StagingSlots
from cacheseek.stores.plan_tier.stats import Counters

MiB = 1 << 20


class Buffer:
    """A stand-in for a uint8 device tensor: a distinct fake address per allocation."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    def data_ptr(self) -> int:
        return self.ptr


class Allocator:
    def __init__(self) -> None:
        self.made: list[tuple[int, object]] = []

    def __call__(self, nbytes: int, like: object) -> Buffer:
        self.made.append((nbytes, like))
        return Buffer(0x1000 * len(self.made), nbytes)


def make_slots(n_slots=2, slot_bytes=0, max_inflight=0, timeout_s=5.0, pending=lambda: 0):
    alloc, counters = Allocator(), Counters()
    slots = StagingSlots(n_slots, slot_bytes, max_inflight, timeout_s=timeout_s, allocate=alloc,
                         counters=counters, pending_writes=pending)
    return slots, alloc, counters


def test_slots_are_rounded_reused_and_released():
    slots, alloc, _ = make_slots(n_slots=2)
    a = slots.acquire(100, 100, "like")
    assert a.busy and a.nbytes == SLOT_ROUND and alloc.made == [(SLOT_ROUND, "like")]
    assert slots.snapshot() == (100, 100, SLOT_ROUND)
    slots.release(a, 100)
    b = slots.acquire(50, 50, None)
    assert b is a and len(alloc.made) == 1  # a free slot that fits is taken again
    c = slots.acquire(3 * MiB, 3 * MiB, None)
    assert c is not a and c.nbytes == 2 * SLOT_ROUND
    assert slots.snapshot() == (50 + 3 * MiB, 50 + 3 * MiB, 3 * SLOT_ROUND)
    slots.release(b, 50)
    slots.release(b, 50)  # a second release changes nothing
    slots.release(c, 3 * MiB)
    assert slots.snapshot() == (0, 50 + 3 * MiB, 3 * SLOT_ROUND)


def test_a_free_slot_too_small_is_replaced_by_a_larger_one():
    slots, alloc, _ = make_slots(n_slots=1)
    small = slots.acquire(MiB, MiB, None)
    slots.release(small, MiB)
    big = slots.acquire(5 * MiB, 5 * MiB, None)
    assert big is not small and big.nbytes == 6 * MiB
    assert slots.snapshot()[2] == 6 * MiB  # one slot at most: the small one is gone


def test_fill_allocates_every_slot_of_the_configured_size_once():
    slots, alloc, _ = make_slots(n_slots=3, slot_bytes=3 * MiB)
    slots.fill("like")
    assert alloc.made == [(4 * MiB, "like")] * 3 and slots.snapshot()[2] == 12 * MiB
    unsized, alloc0, _ = make_slots(n_slots=3, slot_bytes=0)
    unsized.fill("like")
    assert alloc0.made == [] and unsized.snapshot()[2] == 0
    slots.drop()
    assert slots.snapshot()[2] == 0


def test_busy_slots_block_until_a_release_and_the_wait_is_counted():
    slots, _, counters = make_slots(n_slots=1)
    first = slots.acquire(10, 10, None)
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(10, 10, None)))
    waiter.start()
    time.sleep(0.1)
    assert got == []  # backpressure: the only slot is busy
    slots.release(first, 10)
    waiter.join(5)
    assert got == [first]
    sums, _ = counters.snapshot()
    assert sums["backpressure_waits"] == 1 and sums["backpressure_seconds"] > 0.05


def test_max_inflight_bounds_reservations_but_lets_the_first_through():
    slots, _, _ = make_slots(n_slots=4, max_inflight=100, timeout_s=0.2, pending=lambda: 7)
    big = slots.acquire(10, 500, None)  # over the bound, but nothing else is in flight
    with pytest.raises(StoreTimeoutError, match=r"no staging slot free after 0.2 s \(7 writes pending, 500 B in flight\)"):
        slots.acquire(10, 1, None)
    slots.release(big, 500)
    a = slots.acquire(10, 60, None)
    with pytest.raises(StoreTimeoutError):
        slots.acquire(10, 41, None)  # 60 + 41 > 100
    b = slots.acquire(10, 40, None)  # 60 + 40 fits
    assert slots.snapshot()[:2] == (100, 500) and a is not b


def test_close_wakes_a_waiting_acquire_and_refuses_new_ones():
    slots, _, _ = make_slots(n_slots=1)
    slots.acquire(10, 10, None)
    errors = []

    def wait():
        try:
            slots.acquire(10, 10, None)
        except StoreClosedError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    slots.close()
    waiter.join(5)
    assert len(errors) == 1
    with pytest.raises(StoreClosedError):
        slots.acquire(1, 1, None)


class DictClient:
    """remove() over a dict; keys in ``failing`` raise."""

    def __init__(self, keys=(), failing=()) -> None:
        self.values = dict.fromkeys(keys, b"")
        self.failing = set(failing)
        self.removed: list[str] = []

    def remove(self, key: str) -> None:
        if key in self.failing:
            raise RuntimeError(f"cannot remove {key}")
        self.removed.append(key)
        self.values.pop(key, None)


def test_free_removes_every_value_of_the_blob_and_counts_them():
    client, counters = DictClient(["b:L0:k", "b:L0:v", "b:L1:k", "b:L1:v"]), Counters()
    capacity = SegmentCapacity(client, counters, {})
    assert capacity.usage() is None  # the client reports no usage
    capacity.free(BlobHandle(Tier.FLUXON_DRAM, "b", 64, 2, ready=True))
    assert client.removed == ["b:L0:k", "b:L0:v", "b:L1:k", "b:L1:v"] and client.values == {}
    assert counters.get("values_removed") == 4


def test_free_refuses_a_blob_in_flight_and_names_failed_removals_after_trying_all():
    client, counters = DictClient(failing=["b:L0:v", "b:L1:k"]), Counters()
    capacity = SegmentCapacity(client, counters, {})
    with pytest.raises(WriteNotCompleteError):
        capacity.free(BlobHandle(Tier.FLUXON_DRAM, "b", 64, 2))
    assert client.removed == []
    with pytest.raises(PlanError, match="free of b: 2 removals failed, first b:L0:v"):
        capacity.free(BlobHandle(Tier.FLUXON_DRAM, "b", 64, 2, ready=True))
    assert client.removed == ["b:L0:k", "b:L1:v"] and counters.get("values_removed") == 2


def test_free_latent_forgets_its_size_and_a_failure_is_a_store_error():
    sizes = {"aa:lat": 16, "bb:lat": 16}
    capacity = SegmentCapacity(DictClient(failing=["bb:lat"]), Counters(), sizes)
    capacity.free_latent("aa:lat")
    assert sizes == {"bb:lat": 16}
    with pytest.raises(StoreError, match="remove of latent bb:lat failed: RuntimeError"):
        capacity.free_latent("bb:lat")
    assert sizes == {"bb:lat": 16}  # kept: the value may still be there
