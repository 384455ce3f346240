"""`PendingBatch` alone, over a stub runtime: bounded waits, stats recorded once, a failed wait
raising every time. No device, no copies."""

from __future__ import annotations

import sys

import pytest

from cacheseek.errors import TransferError, TransferTimeoutError
from cacheseek.transfer.batch import CopyBatch, Direction
from cacheseek.transfer.pending import Event, PendingBatch


class StubRuntime:
    """An `EventSource`: ``ready`` answers queries; ``sync_error`` is raised by the synchronize."""

    wait_timeout_s = 5.0

    def __init__(self) -> None:
        self.ready = True
        self.sync_error = None
        self.queries = 0
        self.released: list[Event] = []
        self.recorded: list[tuple[dict, float]] = []

    def _event_query(self, event: Event) -> bool:
        self.queries += 1
        return self.ready

    def _event_synchronize(self, event: Event) -> None:
        if self.sync_error is not None:
            raise self.sync_error

    def release_event(self, event: Event) -> None:
        event.released = True
        self.released.append(event)

    def _record_dirs(self, per_dir, seconds: float) -> None:
        self.recorded.append((per_dir, seconds))


def pending(rt: StubRuntime) -> PendingBatch:
    batch = CopyBatch.of([0x100, 0x200], [0x300, 0x400], [8, 24], Direction.D2H)
    return PendingBatch(rt, batch, stream=7, event=Event("handle", 7), t0=0.0)


def test_wait_records_the_stats_once_and_frees_the_event():
    rt = StubRuntime()
    p = pending(rt)
    assert (p.nbytes, p.copies, p.stream) == (32, 2, 7) and p.seconds is None
    p.wait()
    p.wait()
    assert rt.recorded and len(rt.recorded) == 1 and rt.recorded[0][0] == {Direction.D2H: (32, 2)}
    assert rt.released == [p.event] and p.done() and p.seconds is not None


def test_a_wait_past_its_bound_times_out_and_stays_pending():
    rt = StubRuntime()
    rt.ready = False
    p = pending(rt)
    with pytest.raises(TransferTimeoutError, match="2 copies \\(32 bytes\\) has not landed after 0.01 s"):
        p.wait(timeout_s=0.01, poll_s=0.001)
    assert not p.done() and rt.released == [] and rt.recorded == []
    rt.ready = True
    p.wait()  # a later wait may succeed
    assert len(rt.recorded) == 1


def test_a_failed_wait_raises_every_time_and_records_nothing():
    rt = StubRuntime()
    rt.sync_error = TransferError("device fault")
    p = pending(rt)
    for _ in range(2):
        with pytest.raises(TransferError, match="device fault"):
            p.wait()
    assert p.done() and rt.released == [p.event] and rt.recorded == []
    assert rt.queries == 1  # the second wait did not ask the device again


def test_a_young_wait_polls_finely_and_an_old_one_backs_off(monkeypatch):
    """A restore lands in a few milliseconds: while a wait is younger than 50 ms no poll interval
    exceeds 100 us (a 1 ms poll would add up to a millisecond to every restore); later the
    interval grows to 1 ms so that long waits do not spin."""
    import cacheseek.transfer.pending as pending_mod

    clock = [0.0]
    sleeps: list[tuple[float, float]] = []  # (age when the sleep started, interval)

    def fake_sleep(seconds: float) -> None:
        sleeps.append((clock[0], seconds))
        clock[0] += seconds

    monkeypatch.setattr(pending_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pending_mod.time, "sleep", fake_sleep)

    class LandsAt(StubRuntime):
        def _event_query(self, event: Event) -> bool:
            return clock[0] >= 0.2

    rt = LandsAt()
    pending(rt).wait()
    young = [interval for age, interval in sleeps if age < 0.05]
    old = [interval for age, interval in sleeps if age >= 0.06]
    assert young and max(young) <= 1e-4
    assert old and max(old) == pytest.approx(1e-3)
    assert clock[0] - 0.2 <= 1e-3  # it noticed within one poll of landing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread setting")
def test_fine_sleeps_sets_the_threads_timer_slack_and_restores_it():
    import ctypes

    from cacheseek.transfer.pending import fine_sleeps

    prctl = ctypes.CDLL(None).prctl
    before = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    with fine_sleeps():
        assert prctl(30, 0, 0, 0, 0) == min(before, 1000)
    assert prctl(30, 0, 0, 0, 0) == before
    with pytest.raises(RuntimeError):
        with fine_sleeps():
            raise RuntimeError("the block fails")
    assert prctl(30, 0, 0, 0, 0) == before
