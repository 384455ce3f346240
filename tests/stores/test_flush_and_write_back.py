"""The generic tier's mechanisms, alone: the bounded wait behind every ``flush``
(`wait_drained`), the write-back worker (order, backpressure, a bounded stop) and the byte
ledger (reserve, refuse, give back, seed, cap at a full medium)."""

from __future__ import annotations

import threading

import attrs
import pytest

from cacheseek.errors import StoreFullError, StoreTimeoutError
from cacheseek.stores.flush import wait_drained
from cacheseek.stores.value_ledger import ValueLedger
from cacheseek.stores.write_back import WriteBackWorker

WAIT_S = 10.0


# -- wait_drained ---------------------------------------------------------------------------------

def test_wait_drained_returns_at_once_when_nothing_is_pending():
    idle = threading.Condition()
    with idle:
        wait_drained(idle, lambda: 0, 0.0, lambda n: AssertionError("no wait expected"))


def test_wait_drained_wakes_on_the_notification_of_the_last_write():
    idle = threading.Condition()
    pending = [2]

    def complete():
        for _ in range(2):
            with idle:
                pending[0] -= 1
                idle.notify_all()

    timer = threading.Timer(0.05, complete)
    timer.start()
    with idle:
        wait_drained(idle, lambda: pending[0], WAIT_S, lambda n: StoreTimeoutError(f"{n} pending"))
    timer.join()
    assert pending == [0]


def test_wait_drained_raises_the_stores_error_naming_what_is_pending():
    idle = threading.Condition()
    with idle, pytest.raises(StoreTimeoutError, match="3 writes still pending"):
        wait_drained(idle, lambda: 3, 0.05, lambda n: StoreTimeoutError(f"{n} writes still pending"))


# -- WriteBackWorker ------------------------------------------------------------------------------

def test_the_worker_runs_jobs_in_order_and_stops_after_the_queued_ones():
    done = []
    gate = threading.Event()

    def run(job):
        gate.wait(WAIT_S)
        done.append(job)

    worker = WriteBackWorker(run, depth=4, name="t")
    for i in range(3):
        worker.submit(i)
    gate.set()
    assert worker.stop(wait_s=WAIT_S)
    assert done == [0, 1, 2] and not worker.is_alive()


def test_submit_blocks_while_the_queue_is_full():
    gate, started = threading.Event(), threading.Event()

    def run(job):
        started.set()
        gate.wait(WAIT_S)

    worker = WriteBackWorker(run, depth=1, name="t")
    worker.submit("running")  # taken by the thread, which blocks in run
    assert started.wait(WAIT_S)
    worker.submit("queued")  # fills the queue
    third = threading.Thread(target=worker.submit, args=("blocked",), daemon=True)
    third.start()
    third.join(0.1)
    assert third.is_alive()  # backpressure
    gate.set()
    third.join(WAIT_S)
    assert not third.is_alive()
    assert worker.stop(wait_s=WAIT_S)


def test_a_stuck_worker_does_not_stop_within_the_bound_and_stops_later():
    gate, started = threading.Event(), threading.Event()

    def run(job):
        started.set()
        gate.wait(WAIT_S)

    worker = WriteBackWorker(run, depth=1, name="t")
    worker.submit("stuck")
    assert started.wait(WAIT_S)
    assert not worker.stop(wait_s=0.05) and worker.is_alive()
    gate.set()
    worker.join(WAIT_S)
    assert not worker.is_alive()


def test_the_worker_thread_is_named_for_its_store_and_refuses_a_bad_depth():
    worker = WriteBackWorker(lambda job: None, depth=1, name="localdisk")
    try:
        assert worker.thread_name == "localdisk-write-back"
        with pytest.raises(ValueError, match="None"):
            worker.submit(None)
    finally:
        assert worker.stop(wait_s=WAIT_S)
    with pytest.raises(ValueError, match="queue_depth must be >= 1"):
        WriteBackWorker(lambda job: None, depth=0, name="t")


# -- ValueLedger ----------------------------------------------------------------------------------

@attrs.define
class Stats:
    used_bytes: int = 0
    peak_bytes: int = 0
    capacity_bytes: int | None = None
    refused_full: int = 0


def ledger(cap=None) -> ValueLedger:
    return ValueLedger(Stats(capacity_bytes=cap))


def test_reserve_counts_bytes_and_replacing_a_key_counts_the_difference():
    led = ledger(100)
    assert led.reserve([("a", 30), ("b", 20)], name="t", fix="f") == {"a": None, "b": None}
    assert led.reserve([("a", 10)], name="t", fix="f") == {"a": 30}
    assert (led.stats.used_bytes, led.stats.peak_bytes, len(led)) == (30, 50, 2)


def test_a_reservation_above_the_capacity_is_refused_changing_nothing():
    led = ledger(100)
    led.reserve([("a", 90)], name="t", fix="f")
    with pytest.raises(StoreFullError, match=r"t store full: need 20 more bytes, 90 of 100 used \(make room\)"):
        led.reserve([("b", 20)], name="t", fix="make room")
    assert (led.stats.used_bytes, led.stats.refused_full, dict(led.sizes)) == (90, 1, {"a": 90})
    led.reserve([("a", 50)], name="t", fix="f")  # shrinking a value always fits
    assert led.stats.used_bytes == 50


def test_unreserve_restores_what_a_failed_write_did_not_remove():
    led = ledger()
    led.reserve([("a", 10), ("b", 10)], name="t", fix="f")
    old = led.reserve([("a", 40), ("b", 40), ("c", 5)], name="t", fix="f")
    led.unreserve(old, removed=["b"])  # "a" still holds its old value; "b" is gone
    assert dict(led.sizes) == {"a": 10} and led.stats.used_bytes == 10
    assert led.stats.peak_bytes == 85


def test_a_full_mediums_cap_rises_again_when_the_medium_has_room():
    """ENOSPC caps the tier at what it holds; once another tenant frees the disk, the next write
    the cap refuses re-probes the free space and the capacity comes back (never above the one it
    had before)."""
    free = [0]
    led = ValueLedger(Stats(capacity_bytes=100), free_bytes=lambda: free[0])
    led.reserve([("a", 30)], name="t", fix="f")
    led.cap_at_used(StoreFullError("No space left on device"), name="t")
    assert led.stats.capacity_bytes == 30
    with pytest.raises(StoreFullError):
        led.reserve([("b", 10)], name="t", fix="f")  # still no room on the medium
    free[0] = 25
    led.reserve([("b", 10)], name="t", fix="f")  # 30 held + 25 free
    assert led.stats.capacity_bytes == 55 and led.stats.used_bytes == 40
    free[0] = 10**9
    led.reserve([("c", 50)], name="t", fix="f")  # back to the configured 100, not beyond
    assert led.stats.capacity_bytes == 100
    with pytest.raises(StoreFullError):
        led.reserve([("d", 11)], name="t", fix="f")
    unbounded = ValueLedger(Stats(capacity_bytes=None), free_bytes=lambda: free[0])
    unbounded.reserve([("a", 30)], name="t", fix="f")
    unbounded.cap_at_used(StoreFullError("No space left on device"), name="t")
    unbounded.reserve([("b", 10)], name="t", fix="f")
    assert unbounded.stats.capacity_bytes == 30 + 10**9  # bounded by the medium while it was full


def test_forget_seed_and_cap_at_used():
    led = ledger()
    led.seed({"a": 7, "b": 3})
    assert (led.stats.used_bytes, led.stats.peak_bytes) == (10, 10)
    led.forget("a")
    led.forget("a")  # idempotent
    assert led.stats.used_bytes == 3
    led.cap_at_used(StoreFullError("disk full"), name="t")
    assert led.stats.capacity_bytes == 3
    with pytest.raises(StoreFullError):
        led.reserve([("c", 1)], name="t", fix="f")
    led.stats.capacity_bytes = 2  # already below what is held: left as it is
    led.cap_at_used(StoreFullError("disk full"), name="t")
    assert led.stats.capacity_bytes == 2
