"""Bounded calls into Fluxon and the mapping of its Results, alone, over fakes (no fluxon-py)."""

from __future__ import annotations

import threading
import time

import pytest

from cacheseek.errors import ConfigError, StoreClosedError, StoreError, StoreFullError, StoreTimeoutError
from cacheseek.fluxon.calls import MAX_STUCK_CALLS, FluxonCalls
from cacheseek.fluxon.errors import FluxonValueTooLargeError
from cacheseek.fluxon.results import Miss, error_text, unwrap
from cacheseek.fluxon.values import slot_bytes, too_large_text


def calls(timeout: float = 5.0) -> FluxonCalls:
    return FluxonCalls(timeout, owner="cs-1-1", cluster_name="c1", share_mem_path="/dev/shm/x")


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# -- FluxonCalls --------------------------------------------------------------------------------


def test_a_call_returns_its_value_and_maps_raw_errors():
    c = calls()
    assert c.run("get", lambda: 42, key="k") == 42
    with pytest.raises(StoreError, match=r"fluxon get of key 'k' raised RuntimeError: boom") as info:
        c.run("get", lambda: (_ for _ in ()).throw(RuntimeError("boom")), key="k")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ConfigError):  # CacheSeek's own errors pass through unchanged
        c.run("get", lambda: (_ for _ in ()).throw(ConfigError("store", "bad")), key="k")
    with pytest.raises(Miss):
        c.run("get", lambda: (_ for _ in ()).throw(Miss()), key="k")
    assert c.inflight == 0 and c.stuck == 0


def test_an_overrunning_call_times_out_and_is_counted_stuck_until_it_returns():
    c = calls()
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        c.run("put", gate.wait, key="k", timeout_s=0.05, ptr_note=True)
    assert time.monotonic() - t0 < 2.0
    assert str(info.value) == (
        "fluxon put of key 'k' did not complete within 0.1 s (cluster 'c1' at /dev/shm/x); the service "
        "may be stopped or overloaded. The call goes on in the background. Keep the source memory "
        "valid: the call may still read it.")
    assert c.stuck == 1 and c.inflight == 0
    gate.set()
    wait_for(lambda: c.stuck == 0)


def test_too_many_stuck_calls_refuse_new_ones_at_once():
    c = calls()
    gate = threading.Event()
    try:
        for _ in range(MAX_STUCK_CALLS):
            with pytest.raises(StoreTimeoutError):
                c.run("get", gate.wait, key="k", timeout_s=0.01)
        with pytest.raises(StoreTimeoutError, match=r"fluxon exists of key 'x' not issued: 4 earlier Fluxon "
                                                    r"calls are still stuck \(the service of cluster 'c1'"):
            c.run("exists", lambda: True, key="x")
    finally:
        gate.set()
    wait_for(lambda: c.stuck == 0)
    assert c.run("exists", lambda: True, key="x") is True


def test_closed_refuses_every_call_but_close_and_drain_waits_for_calls_in_flight():
    c = calls()
    gate = threading.Event()
    worker = threading.Thread(target=lambda: c.run("get", gate.wait, key="k"))
    worker.start()
    wait_for(lambda: c.inflight == 1)
    with c.lock:
        assert c.mark_closed() and not c.mark_closed()
    with pytest.raises(StoreClosedError, match=r"fluxon get of key 'k': the Fluxon client cs-1-1 is closed"):
        c.run("get", lambda: None, key="k")
    assert c.run("close", lambda: "closed", key=None) == "closed"
    assert c.drain(0.05) == (0, 1)  # still in flight after the wait
    threading.Timer(0.05, gate.set).start()
    assert c.drain(5.0) == (0, 0)
    worker.join()


# -- results ------------------------------------------------------------------------------------


class FakeError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self._code, self.message = code, message

    def code(self) -> int:
        return self._code


class KeyNotFoundError(FakeError):
    pass


class Result:
    def __init__(self, value=None, error=None) -> None:
        self.value, self.error = value, error

    def is_ok(self) -> bool:
        return self.error is None

    def unwrap(self):
        return self.value

    def unwrap_error(self):
        return self.error


def test_results_map_to_cacheseek_errors():
    assert unwrap("get", "k", Result(7)) == 7
    missing = Result(error=KeyNotFoundError(4000, "no such key"))
    with pytest.raises(Miss):
        unwrap("get", "k", missing, miss_ok=True)
    with pytest.raises(StoreError, match=r"fluxon get of key 'k' failed: KeyNotFoundError\(4000\): no such key"):
        unwrap("get", "k", missing)
    full = Result(error=FakeError(6000, "no space"))
    with pytest.raises(StoreFullError, match=r"fluxon put of key 'k' \(100 bytes\): store full: "
                                             r"FakeError\(6000\): no space"):
        unwrap("put", "k", full, segment_bytes=1 << 24, nbytes=100)
    with pytest.raises(FluxonValueTooLargeError) as info:
        unwrap("put", "k", full, segment_bytes=1 << 24, nbytes=1 << 24)
    assert str(info.value) == too_large_text("k", 1 << 24, 1 << 24) + " (FakeError(6000): no space)"
    with pytest.raises(StoreError, match=r"^fluxon count_prefix failed: FakeError\(1\): odd$"):
        unwrap("count_prefix", None, Result(error=FakeError(1, "odd")))
    assert error_text(ValueError("plain")) == "ValueError(None): plain"


def test_slots_are_powers_of_two_with_the_header():
    assert slot_bytes(0) == 256 and slot_bytes(1) == 512 and slot_bytes(1 << 20) == 2 << 20
    assert "needs a slot of 2097152 bytes" in too_large_text("k", 1 << 20, 1 << 20)
