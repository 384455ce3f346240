"""The Fluxon Plan client wrappers: missing calls named, lifecycle enforced, shapes converted."""

from __future__ import annotations

import importlib.util
from concurrent.futures import Future

import pytest
import torch

from cacheseek.errors import HandleStateError, PlanUnavailableError, StoreClosedError
from cacheseek.plan.base import REQUIRED_PLAN_CALLS, PlanClient, PutCommitResult, SegmentMapping
from cacheseek.plan.fluxon_native import FluxonNativePlanClient, missing_plan_calls
from cacheseek.registry import PLAN_CLIENTS
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

from fakes.plan_faults import FaultyEmbeddedPlanClient


class KeyNotFoundError(Exception):
    pass


class FakeFluxon:
    """A Fluxon client exposing the Plan API in its native shapes (tuples, plain futures),
    backed by an embedded client; it enforces nothing about handle states itself."""

    def __init__(self) -> None:
        self.inner = FaultyEmbeddedPlanClient(segment_bytes=1 << 20)
        self.closed = False

    def wait_local_segments_ready(self):
        return [(m.ptr, m.length, m.generation, m.writable) for m in self.inner.wait_local_segments_ready()]

    def local_fast_put_start(self, keys, value_len):
        return self.inner.local_fast_put_start(keys, value_len)

    def local_fast_put_commit(self, handle):
        result = self.inner.local_fast_put_commit(handle).result()
        fut: Future = Future()
        fut.set_result((result.status, list(result.key_codes)))
        return fut

    def put_abort(self, handle):
        self.inner.put_abort(handle)

    def get_start(self, keys, lens):
        return self.inner.get_start(keys, lens)

    def get_transfer(self, handle):
        return self.inner.get_transfer(handle)

    def cancel_get_transfer(self, handle):
        self.inner.cancel_get_transfer(handle)

    def release_views(self, handle):
        if handle.state.value == "released":
            return  # a lenient native client: the wrapper must still refuse a double release
        self.inner.release_views(handle)

    def remove(self, key):
        if key not in self.inner.keys():
            raise KeyNotFoundError(key)
        self.inner.remove(key)

    def close(self):
        self.closed = True
        self.inner.close()


class PublicFluxon024:
    """What fluxon-py 0.2.4's client offers: no Plan calls."""

    def put_blocking(self, key, value): ...

    def get_blocking(self, key): ...

    def remove(self, key): ...


def test_registered():
    assert PLAN_CLIENTS.get("fluxon_native") is FluxonNativePlanClient


def test_missing_calls_are_named():
    with pytest.raises(PlanUnavailableError) as info:
        FluxonNativePlanClient(PublicFluxon024())
    message = str(info.value)
    for call in REQUIRED_PLAN_CALLS:
        if call != "remove":
            assert call in message
    assert "0.2.4" in message and "embedded" in message
    assert missing_plan_calls(FakeFluxon()) == []


def test_absent_fluxon_py_is_refused_before_connecting():
    """fluxon-py absent: says to install it (no service is contacted, so this cannot block)."""
    if importlib.util.find_spec("fluxon_py") is not None:
        pytest.skip("fluxon-py is installed: test_installed_fluxon_py_without_plan_api_... covers this path")
    client = FluxonNativePlanClient(config={"instance_key": "x"})
    with pytest.raises(PlanUnavailableError, match="needs fluxon-py"):
        client.wait_local_segments_ready()


@pytest.mark.fluxon_py
def test_installed_fluxon_py_without_plan_api_is_refused_before_connecting():
    """0.2.4 present: names the missing calls (no service is contacted, so this cannot block)."""
    client = FluxonNativePlanClient(config={"instance_key": "x"})
    with pytest.raises(PlanUnavailableError, match="lacks the Plan API calls: wait_local_segments_ready"):
        client.wait_local_segments_ready()


def test_wraps_native_shapes():
    native = FakeFluxon()
    client = FluxonNativePlanClient(native)
    assert isinstance(client, PlanClient)
    (m,) = client.wait_local_segments_ready()
    assert isinstance(m, SegmentMapping) and m.generation == 1
    plan, _ = client.local_fast_put_start(["a"], 16)
    result = client.local_fast_put_commit(plan).result()
    assert result == PutCommitResult(0, (0,))
    client.remove("a")
    client.remove("a")  # KeyNotFound from the native client is success
    client.close()
    assert not native.closed  # the caller owns a client it passed in
    with pytest.raises(StoreClosedError):
        client.remove("a")
    native.close()


def test_lifecycle_enforced_by_the_wrapper():
    native = FakeFluxon()
    client = FluxonNativePlanClient(native)
    client.wait_local_segments_ready()
    plan, _ = client.local_fast_put_start(["a"], 16)
    client.local_fast_put_commit(plan).result()
    with pytest.raises(HandleStateError):
        client.put_abort(plan)
    get = client.get_start(["a"], [1])
    client.get_transfer(get)
    client.release_views(get)
    with pytest.raises(HandleStateError, match="released"):
        client.release_views(get)
    other = FluxonNativePlanClient(native)
    get = client.get_start(["a"], [1])
    with pytest.raises(HandleStateError, match="another Plan client"):
        other.cancel_get_transfer(get)
    client.cancel_get_transfer(get)
    native.close()


def test_plan_tier_runs_over_the_fluxon_client():
    native = FakeFluxon()
    store = PlanTierStore(plan_client=FluxonNativePlanClient(native), transfer=HostTransferRuntime())
    k = torch.arange(64, dtype=torch.float32).reshape(1, 4, 4, 4)
    handle = store.put_async("n:kv", [(k, -k)], tier=Tier.FLUXON_DRAM)
    assert handle.ready and native.inner.keys() == ["n:kv:L0:k", "n:kv:L0:v"]
    got_k, got_v = store.get_layer(handle, 0, like=(k, k))
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    store.free(handle)
    store.free(handle)
    assert native.inner.keys() == []
    store.close()
    native.close()
