"""The Plan client contract (cacheseek.plan.base), run against every Plan client.

- ``embedded``: the reference implementation (no service; runs in the normal suite);
- ``fluxon_native``: the native wrapper over a fake Fluxon client that has the Plan API (no
  service; the wrapper a Fluxon build with the Plan API is used through);
- ``fluxon_public``: the emulation over the public fluxon-py 0.2.4 client, on the session's
  real service (marker ``fluxon``; run inside a private network namespace, see conftest.py).

Every client gets a reservation capacity of 1 MiB (the embedded segment, the fake's segment,
the public client's staging). Each real Fluxon call costs ~10-100 ms here: the cases stay small.
"""

from __future__ import annotations

import ctypes
import time

import pytest

from cacheseek.errors import HandleStateError, StoreClosedError, StoreFullError
from cacheseek.plan.base import GetPlanState, PlanClient, PutPlanState
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.plan.fluxon_native import FluxonNativePlanClient
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
from cacheseek.plan.table import decode_plan_table
from cacheseek.registry import PLAN_CLIENTS

MiB = 1 << 20
CLIENTS = ["embedded", "fluxon_native", pytest.param("fluxon_public", marks=pytest.mark.fluxon)]


class Case:
    """A Plan client under test, a maker of sibling clients and a key namer."""

    def __init__(self, kind: str, request) -> None:
        self.kind = kind
        self.prefix = f"{request.node.name}/" if kind == "fluxon_public" else ""
        self.keys_used: set[str] = set()
        self.made: list = []
        if kind == "fluxon_public":
            self.fluxon = request.getfixturevalue("fluxon_client")
        elif kind == "fluxon_native":
            from test_fluxon_native import FakeFluxon  # tests/plan: a fake with the Plan API

            self.fake = FakeFluxon()
        self.client = self.new()

    def new(self):
        if self.kind == "embedded":
            c = EmbeddedPlanClient(segment_bytes=MiB, prefault_threads=1)
        elif self.kind == "fluxon_native":
            c = FluxonNativePlanClient(self.fake)
        else:
            c = FluxonPublicPlanClient(client=self.fluxon, staging_bytes=MiB, io_threads=4)
        self.made.append(c)
        return c

    def k(self, *names: str) -> list[str]:
        keys = [self.prefix + n for n in names]
        self.keys_used.update(keys)
        return keys

    def close(self) -> None:
        for c in self.made:
            c.close()
        if self.kind == "fluxon_public":
            for key in self.keys_used:
                self.fluxon.remove(key)
        elif self.kind == "fluxon_native":
            self.fake.close()


@pytest.fixture(params=CLIENTS)
def case(request):
    c = Case(request.param, request)
    yield c
    c.close()


def put(c, keys, data: bytes):
    plan, table = c.local_fast_put_start(keys, len(data))
    for p in decode_plan_table(table, len(keys), arena=_arena(c)):
        ctypes.memmove(p, data, len(data))
    result = c.local_fast_put_commit(plan).result(timeout=30)
    assert result.ok, result
    return plan, result


def read(c, keys, n_bytes, groups=None):
    plan = c.get_start(keys, groups or [1] * len(keys))
    table, n = c.get_transfer(plan)
    ptrs = decode_plan_table(table, n, arena=_arena(c))
    return plan, [ctypes.string_at(p, n_bytes) for p in ptrs], ptrs


def _arena(c):
    fn = getattr(c, "table_arena", None)
    return fn() if callable(fn) else None


def _inside(mappings, ptr, n, *, writable):
    return any(m.ptr <= ptr and ptr + n <= m.ptr + m.length and (m.writable or not writable) for m in mappings)


def _live(c):
    fn = getattr(c, "live_handles", None)
    return fn() if callable(fn) else (0, 0)


def test_is_a_registered_plan_client(case):
    assert isinstance(case.client, PlanClient)
    assert {"embedded", "fluxon_native", "fluxon_public", "fluxon"} <= set(PLAN_CLIENTS.names())


def test_segments_ready_once_and_every_pointer_inside_them(case):
    c = case.client
    maps = c.wait_local_segments_ready()
    assert maps and c.wait_local_segments_ready() == maps
    assert any(m.writable for m in maps)
    a, b, d = case.k("a", "b", "d")
    plan, table = c.local_fast_put_start([a, b, d], 300)
    dsts = decode_plan_table(table, 3, arena=_arena(c))
    assert all(_inside(maps, p, 300, writable=True) for p in dsts)  # a D2H destination
    for i, p in enumerate(dsts):
        ctypes.memmove(p, bytes([i + 1]) * 300, 300)
    assert c.local_fast_put_commit(plan).result(timeout=30).ok
    get, values, srcs = read(c, [a, b, d], 300)
    assert values == [b"\x01" * 300, b"\x02" * 300, b"\x03" * 300]
    assert all(_inside(maps, p, 300, writable=False) for p in srcs)  # an H2D source
    c.release_views(get)
    assert _live(c) == (0, 0)


def test_transferable_prefix_is_whole_groups(case):
    c = case.client
    a, b, x, d = case.k("a", "b", "missing", "d")
    put(c, [a, b, d], b"v" * 64)
    plan = c.get_start([a, b, x, d], [2, 2])
    assert c.get_transfer(plan)[1] == 2
    c.release_views(plan)
    plan = c.get_start([x, a], [1, 1])
    assert c.get_transfer(plan)[1] == 0
    c.release_views(plan)
    plan = c.get_start([a, x, d], [1, 1, 1])
    c.cancel_get_transfer(plan)
    with pytest.raises(ValueError, match="sum to the 2 keys"):
        c.get_start([a, b], [1])
    assert _live(c) == (0, 0)


def test_put_handle_states(case):
    c = case.client
    (a,) = case.k("a")
    plan, _ = c.local_fast_put_start([a], 8)
    c.put_abort(plan)
    assert plan.state is PutPlanState.ABORTED
    with pytest.raises(HandleStateError, match="local_fast_put_commit on a PutPlan in state aborted"):
        c.local_fast_put_commit(plan)
    with pytest.raises(HandleStateError):
        c.put_abort(plan)
    plan, _ = c.local_fast_put_start([a], 8)
    c.local_fast_put_commit(plan).result(timeout=30)
    assert plan.state is PutPlanState.COMMIT_SUBMITTED
    with pytest.raises(HandleStateError, match="put_abort on a PutPlan in state commit_submitted"):
        c.put_abort(plan)
    with pytest.raises(HandleStateError):
        c.local_fast_put_commit(plan)


def test_get_handle_states(case):
    c = case.client
    (a,) = case.k("a")
    put(c, [a], b"1" * 8)
    plan = c.get_start([a], [1])
    with pytest.raises(HandleStateError, match="release_views on a GetPlan in state started"):
        c.release_views(plan)
    c.get_transfer(plan)
    with pytest.raises(HandleStateError):
        c.cancel_get_transfer(plan)
    with pytest.raises(HandleStateError):
        c.get_transfer(plan)
    c.release_views(plan)
    assert plan.state is GetPlanState.RELEASED
    with pytest.raises(HandleStateError, match="release_views on a GetPlan in state released"):
        c.release_views(plan)
    plan = c.get_start([a], [1])
    c.cancel_get_transfer(plan)
    assert plan.state is GetPlanState.CANCELLED
    with pytest.raises(HandleStateError):
        c.get_transfer(plan)
    with pytest.raises(HandleStateError):
        c.cancel_get_transfer(plan)
    assert _live(c) == (0, 0)


def test_handle_of_another_client_is_refused(case):
    other = case.new()
    (a,) = case.k("a")
    plan, _ = other.local_fast_put_start([a], 8)
    with pytest.raises(HandleStateError, match="another Plan client"):
        case.client.put_abort(plan)
    other.put_abort(plan)


def test_a_reservation_that_does_not_fit_raises_store_full_and_holds_nothing(case):
    c = case.client
    a, b = case.k("a", "b")
    with pytest.raises(StoreFullError, match="full"):
        c.local_fast_put_start([a, b], MiB // 2 + 4096)
    assert _live(c) == (0, 0)
    plan, _ = c.local_fast_put_start([a], MiB // 2 + 4096)  # the refused one reserved nothing
    c.put_abort(plan)
    plan, _ = c.local_fast_put_start([a, b], MiB // 2 - 4096)  # an aborted one neither
    c.put_abort(plan)


def test_remove_during_a_read_defers_the_free(case):
    c = case.client
    a, b = case.k("a", "b")
    put(c, [a], b"A" * 1000)
    plan, _, (ptr,) = read(c, [a], 1000)
    c.remove(a)
    c.remove(a)  # idempotent
    put(c, [b], b"B" * 1000)  # must not land on a's bytes
    assert ctypes.string_at(ptr, 1000) == b"A" * 1000
    gone = c.get_start([a], [1])
    assert c.get_transfer(gone)[1] == 0
    c.release_views(gone)
    c.release_views(plan)
    c.remove(b)


def test_overwrite_during_a_read_defers_the_free(case):
    c = case.client
    (a,) = case.k("a")
    put(c, [a], b"1" * 512)
    plan, _, (old,) = read(c, [a], 512)
    put(c, [a], b"2" * 512)
    assert ctypes.string_at(old, 512) == b"1" * 512
    c.release_views(plan)
    # fluxon-py 0.2.4 makes an overwrite visible after up to ~1 s (a remove is immediate)
    deadline = time.monotonic() + (5.0 if case.kind == "fluxon_public" else 0.0)
    while True:
        plan, values, _ = read(c, [a], 512)
        c.release_views(plan)
        if values == [b"2" * 512] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values == [b"2" * 512]


def test_close_releases_live_views_is_idempotent_and_later_calls_raise(case):
    c = case.new()
    (a,) = case.k("a")
    put(c, [a], b"z" * 64)
    live = c.get_start([a], [1])
    c.get_transfer(live)
    put_plan, _ = c.local_fast_put_start(case.k("b"), 8)
    c.close()
    c.close()
    if case.kind == "fluxon_public":
        assert not live.native.views and not case.fluxon.closed  # released; the shared client stays open
        assert a not in case.fluxon.open_view_keys
    for call in (
        lambda: c.wait_local_segments_ready(),
        lambda: c.local_fast_put_start(case.k("c"), 8),
        lambda: c.local_fast_put_commit(put_plan),
        lambda: c.get_start([a], [1]),
        lambda: c.release_views(live),
        lambda: c.remove(a),
    ):
        with pytest.raises(StoreClosedError):
            call()
