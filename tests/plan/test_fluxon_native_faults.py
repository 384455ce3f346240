"""The native Fluxon Plan client under a misbehaving native module: calls that hang, null or
out-of-segment pointers, short lengths, bad counts. Each fault must end in a bounded, named
error (never a hang, never bytes read from outside a value) and leave no native plan behind.

The installed fluxon-py 0.2.4 has no Plan API, so the native side is `FaultyFluxon`: the fake of
test_fluxon_native.py (an embedded client in Fluxon's native shapes) with fault switches.
"""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from cacheseek.errors import ConfigError, CorruptValueError, PlanError, StoreError, StoreTimeoutError
from cacheseek.plan import fluxon_native
from cacheseek.plan.fluxon_native import FluxonNativePlanClient
from cacheseek.plan.table import PLAN_MAGIC, decode_plan_table, plan_table_nbytes
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime
from test_fluxon_native import FakeFluxon

BOUND = 0.3  # op_timeout_s of the clients under test


class FaultyFluxon(FakeFluxon):
    """``hang``: call names that block until `release` (the native call never returns by itself);
    ``table``: what get_transfer hands out instead of the real table ("null": address 0,
    "outside": a table of pointers into memory outside every segment); ``n``: a transferable
    count to report instead of the real one; ``put_table_null``: put_start returns address 0;
    ``commit``: "never" (a future that never settles) or "short" (one key code too few);
    ``report_length``: the segment length wait_local_segments_ready reports."""

    def __init__(self) -> None:
        super().__init__()
        self.hang: set[str] = set()
        self.gate = threading.Event()
        self.table = None
        self.n = None
        self.put_table_null = False
        self.commit = None
        self.report_length = None
        self.calls: list[str] = []
        self._buffers: list = []

    def release(self) -> None:
        self.gate.set()

    def _maybe_hang(self, name: str) -> None:
        self.calls.append(name)
        if name in self.hang:
            self.gate.wait(30)

    def _table(self, pointers) -> int:
        buf = (ctypes.c_uint64 * (2 + len(pointers)))(PLAN_MAGIC, len(pointers), *pointers)
        self._buffers.append(buf)
        return ctypes.addressof(buf)

    def wait_local_segments_ready(self):
        self._maybe_hang("wait_local_segments_ready")
        maps = super().wait_local_segments_ready()
        if self.report_length is not None:
            maps = [(p, self.report_length, g, w) for p, _, g, w in maps]
        return maps

    def local_fast_put_start(self, keys, value_len):
        self._maybe_hang("local_fast_put_start")
        handle, ptr = super().local_fast_put_start(keys, value_len)
        return (handle, 0) if self.put_table_null else (handle, ptr)

    def local_fast_put_commit(self, handle):
        self._maybe_hang("local_fast_put_commit")
        if self.commit == "never":
            return Future()
        fut = super().local_fast_put_commit(handle)
        if self.commit == "short":
            status, codes = fut.result()
            fut = Future()
            fut.set_result((status, codes[:-1]))
        return fut

    def get_start(self, keys, lens):
        self._maybe_hang("get_start")
        return super().get_start(keys, lens)

    def get_transfer(self, handle):
        self._maybe_hang("get_transfer")
        ptr, n = super().get_transfer(handle)
        if self.table == "null":
            ptr = 0
        elif self.table == "outside":
            elsewhere = ctypes.create_string_buffer(4096)
            self._buffers.append(elsewhere)
            ptr = self._table([ctypes.addressof(elsewhere)] * n)
        return ptr, (self.n if self.n is not None else n)

    def release_views(self, handle):
        self._maybe_hang("release_views")
        super().release_views(handle)

    def cancel_get_transfer(self, handle):
        self.calls.append("cancel_get_transfer")
        super().cancel_get_transfer(handle)

    def put_abort(self, handle):
        self.calls.append("put_abort")
        super().put_abort(handle)


class FaultyFluxonWithLengths(FaultyFluxon):
    """Reports value lengths (the optional native call); ``short`` bytes fewer than the truth."""

    short = 0

    def value_lengths(self, handle):
        return [v.length - self.short for v in handle.native.held]


@pytest.fixture
def fake():
    f = FaultyFluxon()
    yield f
    f.release()
    f.close()


def _client(native, **options):
    return FluxonNativePlanClient(native, op_timeout_s=BOUND, attach_timeout_s=BOUND, **options)


def _put(client, keys, data: bytes):
    plan, table = client.local_fast_put_start(keys, len(data))
    arena = getattr(client, "table_arena", None)
    for p in decode_plan_table(table, len(keys), arena=arena() if callable(arena) else None):
        ctypes.memmove(p, data, len(data))
    assert client.local_fast_put_commit(plan).result(timeout=5).ok


def _wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- time bounds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["get_start", "local_fast_put_start", "wait_local_segments_ready"])
def test_a_hanging_native_call_times_out_naming_the_field(fake, call):
    client = _client(fake)
    if call != "wait_local_segments_ready":
        client.wait_local_segments_ready()
    fake.hang.add(call)
    run = {"get_start": lambda: client.get_start(["a"], [1]),
           "local_fast_put_start": lambda: client.local_fast_put_start(["a"], 64),
           "wait_local_segments_ready": client.wait_local_segments_ready}[call]
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        run()
    assert time.monotonic() - t0 < BOUND + 2
    field = "attach_timeout_s" if call == "wait_local_segments_ready" else "op_timeout_s"
    assert f"store.client_options.{field}" in str(info.value) and call in str(info.value)
    assert "raise store.client_options" in str(info.value)  # the fix
    fake.release()  # the native call returns late: its plan is ended natively
    _wait_until(lambda: fake.inner.live_handles() == (0, 0))
    client.close()


def test_a_late_reservation_is_aborted_and_its_space_freed(fake):
    client = _client(fake)
    client.wait_local_segments_ready()
    fake.hang.add("local_fast_put_start")
    with pytest.raises(StoreTimeoutError):
        client.local_fast_put_start(["a", "b"], 4096)
    fake.release()
    _wait_until(lambda: "put_abort" in fake.calls)
    assert fake.inner.live_handles() == (0, 0) and fake.inner.usage().used_bytes == 0
    client.close()


def test_a_commit_that_never_settles_resolves_to_a_timeout(fake):
    client = _client(fake)
    client.wait_local_segments_ready()
    fake.commit = "never"
    plan, _ = client.local_fast_put_start(["a"], 64)
    fut = client.local_fast_put_commit(plan)
    with pytest.raises(StoreTimeoutError, match="store.client_options.op_timeout_s"):
        fut.result(timeout=BOUND + 5)
    client.close()


def test_a_get_ended_while_its_transfer_is_stuck_is_released_when_it_returns(fake):
    client = _client(fake)
    _put(client, ["a"], b"x" * 64)
    fake.hang.add("get_transfer")
    plan = client.get_start(["a"], [1])
    with pytest.raises(StoreTimeoutError):
        client.get_transfer(plan)
    client.cancel_get_transfer(plan)  # the contract's way out of a failed get_transfer
    assert fake.inner.live_handles() == (0, 1)  # still held natively: the call is stuck
    fake.release()
    _wait_until(lambda: fake.inner.live_handles() == (0, 0))
    assert fake.calls.count("release_views") == 1 and "cancel_get_transfer" not in fake.calls
    client.close()


def test_stuck_calls_are_capped_and_close_leaves_a_stuck_native_client_open(fake, monkeypatch):
    client = _client(fake)
    client.wait_local_segments_ready()
    fake.hang.add("get_start")
    for _ in range(4):
        with pytest.raises(StoreTimeoutError):
            client.get_start(["a"], [1])
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="not issued: 4 earlier calls are still stuck"):
        client.get_start(["a"], [1])
    assert time.monotonic() - t0 < 0.1
    monkeypatch.setattr(fluxon_native, "build_native", lambda config: fake)
    owned = FluxonNativePlanClient(config={"fluxonkv_spec": {}}, op_timeout_s=BOUND, attach_timeout_s=BOUND)
    owned.wait_local_segments_ready()  # builds (and so owns) its native client
    with pytest.raises(StoreTimeoutError):
        owned.get_start(["a"], [1])  # stuck in the native client
    owned.close()
    assert not fake.closed  # a native client with a live call is not closed under it
    client.close()


def test_the_plan_tier_gets_a_store_error_not_a_hang(fake):
    store = PlanTierStore(plan_client=_client(fake), transfer=HostTransferRuntime())
    k = torch.arange(64, dtype=torch.float32).reshape(1, 4, 4, 4)
    handle = store.put_async("n:kv", [(k, -k)], tier=Tier.FLUXON_DRAM)
    fake.hang.add("get_start")
    t0 = time.monotonic()
    with pytest.raises(StoreError):
        store.get_layer(handle, 0, like=(k, k))
    assert time.monotonic() - t0 < BOUND + 2
    fake.release()
    store.close()


# -- the table arena ------------------------------------------------------------------------------


def test_tables_are_copied_into_one_reused_arena(fake):
    client = _client(fake)
    base, length = client.table_arena()
    addresses = set()
    for i in range(200):
        plan, table = client.local_fast_put_start([f"k{i}", f"j{i}"], 64)
        assert base <= table and table + plan_table_nbytes(2) <= base + length
        addresses.add(table)
        client.put_abort(plan)
    assert len(addresses) == 1  # the same bytes reused, nothing allocated per call
    _put(client, ["a", "b"], b"y" * 64)
    plan = client.get_start(["a", "b"], [2])
    table, n = client.get_transfer(plan)
    assert n == 2 and base <= table < base + length
    assert [ctypes.string_at(p, 64) for p in decode_plan_table(table, 2, arena=(base, length))] == [b"y" * 64] * 2
    client.release_views(plan)
    assert client.table_bytes_in_use == 0
    client.close()
    assert client.table_arena() is None


def test_the_arena_is_sized_from_the_geometry():
    small = FluxonNativePlanClient(FakeFluxon())
    big = FluxonNativePlanClient(FakeFluxon(), value_bytes=1 << 20, chunk_bytes=400 << 20)  # 400 values a chunk
    assert big.table_arena()[1] > small.table_arena()[1] >= 64 << 10
    assert big.table_arena()[1] >= 32 * plan_table_nbytes(32 * 400)
    with pytest.raises(ConfigError, match="store.client_options.table_arena_bytes"):
        FluxonNativePlanClient(FakeFluxon(), table_arena_bytes="4KiB", value_bytes=1024, chunk_bytes=1024 * 1024)
    for c in (small, big):
        c.close()


# -- pointers and lengths -------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["table_null", "value_null", "outside", "count"])
def test_a_bad_get_table_is_refused_naming_the_key_and_the_plan_still_ends(fake, fault):
    client = _client(fake)
    _put(client, ["a", "b"], b"z" * 64)
    if fault == "table_null":
        fake.table = "null"
    elif fault == "value_null":
        fake.inner.faults.arm("table_null")
    elif fault == "outside":
        fake.table = "outside"
    else:
        fake.n = 5
    plan = client.get_start(["a", "b"], [1, 1])
    with pytest.raises(PlanError, match="'a'"):
        client.get_transfer(plan)
    client.cancel_get_transfer(plan)  # the native side had transferred: released, not cancelled
    assert fake.inner.live_handles() == (0, 0)
    client.close()


def test_a_null_put_table_aborts_the_reservation(fake):
    client = _client(fake)
    fake.put_table_null = True
    with pytest.raises(PlanError, match="'a'.*bad plan table"):
        client.local_fast_put_start(["a"], 64)
    assert fake.inner.live_handles() == (0, 0) and "put_abort" in fake.calls
    client.close()


def test_a_commit_result_without_a_code_per_key_is_refused(fake):
    client = _client(fake)
    fake.commit = "short"
    plan, _ = client.local_fast_put_start(["a", "b"], 64)
    with pytest.raises(PlanError, match="1 key codes for 2 keys"):
        client.local_fast_put_commit(plan).result(timeout=5)
    client.close()


def _tier_with_a_blob(native):
    writer = PlanTierStore(plan_client=_client(native), transfer=HostTransferRuntime())
    k = torch.arange(64, dtype=torch.float32).reshape(1, 4, 4, 4)
    handle = writer.put_async("n:kv", [(k, -k)], tier=Tier.FLUXON_DRAM)
    writer.put_skeleton("n:lat", k.clone())
    assert handle.ready
    return writer, handle


def test_raw_reads_check_lengths_the_native_client_reports():
    native = FaultyFluxonWithLengths()
    store, handle = _tier_with_a_blob(native)
    assert store.get_layer(handle, 0)[0] == torch.arange(64, dtype=torch.float32).numpy().tobytes()
    native.short = 8  # the values now claim 8 bytes fewer than the reader would read
    with pytest.raises(CorruptValueError, match=r"'n:kv:L0:k'.*holds 248 B where 256 B"):
        store.get_layer(handle, 0)
    with pytest.raises(CorruptValueError, match="'n:lat'"):
        store.get_skeleton("n:lat")
    assert native.inner.live_handles() == (0, 0)
    store.close()
    native.close()


def test_raw_reads_never_read_past_a_segment_mapping():
    """A reader that maps only part of the segment (as its native client reports it) must refuse
    a value that crosses the end of that mapping (the bytes past it are readable here, so the
    old unchecked read returned them silently)."""
    native = FaultyFluxon()
    writer, handle = _tier_with_a_blob(native)
    base = native.inner.wait_local_segments_ready()[0].ptr
    native.report_length = _value_ptr(native, "n:kv:L0:v") - base + 100  # V starts inside, ends outside
    reader = PlanTierStore(plan_client=_client(native), transfer=HostTransferRuntime())
    with pytest.raises(CorruptValueError, match=r"'n:kv:L0:v'.*does not lie inside a segment mapping"):
        reader.get_layer(handle, 0)
    assert native.inner.live_handles() == (0, 0)
    for s in (reader, writer):
        s.close()
    native.close()


def _value_ptr(native, key):
    plan = native.inner.get_start([key], [1])
    ptr, n = native.inner.get_transfer(plan)
    (p,) = decode_plan_table(ptr, n, arena=native.inner.table_arena())
    native.inner.release_views(plan)
    return p


def test_a_bad_table_on_a_raw_read_is_a_store_error_naming_the_key(fake):
    store, handle = _tier_with_a_blob(fake)
    fake.table = "null"
    with pytest.raises(StoreError, match="'n:lat'"):
        store.get_skeleton("n:lat")
    with pytest.raises(StoreError, match="'n:kv:L0:k'"):
        store.get_layer(handle, 0)
    assert fake.inner.live_handles() == (0, 0)
    store.close()
