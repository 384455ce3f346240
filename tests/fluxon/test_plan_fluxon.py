"""The Plan path over the public fluxon-py client (``fluxon_public``) and the ``fluxon`` choice.

Unmarked tests need no service (the choice by capability, option checks). Tests marked
``fluxon`` run the Plan tier on the session's real service: ring restores through the host
runtime and through the CUDA runtime over the fake cudart (where the owner's read-only segment
mapping must register read-only), per-key commit codes, store full and values too large.
"""

from __future__ import annotations

import ctypes
import logging
import time

import pytest
import torch

from cacheseek.errors import ConfigError, PlanError, PlanUnavailableError, StoreError, StoreFullError
from cacheseek.fluxon.client import VALUE_FIELD, FluxonValueTooLargeError
from cacheseek.plan import fluxon_select
from cacheseek.plan.fluxon_calls import PutKeyCode
from cacheseek.plan.fluxon_native import FluxonNativePlanClient
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
from cacheseek.plan.fluxon_select import open_fluxon_plan_client
from cacheseek.plan.table import decode_plan_table
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.reuse.exact_prefix.types import Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime
from plan_testkit import fake_cuda_runtime, ingest, restore_target

MiB = 1 << 20


# -- the choice by capability (no service) ---------------------------------------------------------


def test_fluxon_choice_uses_the_native_api_when_the_installed_client_has_it(monkeypatch, caplog):
    monkeypatch.setattr(fluxon_select, "native_plan_api_problem", lambda: None)
    with caplog.at_level(logging.INFO, logger="cacheseek.plan.fluxon_select"):
        client = open_fluxon_plan_client(cluster_name="c1", share_mem_path="/dev/shm/nowhere", op_timeout_s=7.0,
                                         attach_timeout_s=9.0, value_bytes=MiB, chunk_bytes=80 * MiB)
    assert isinstance(client, FluxonNativePlanClient)  # connects on first use only
    assert client.config["fluxonkv_spec"] == {"cluster_name": "c1", "share_mem_path": "/dev/shm/nowhere"}
    assert (client.op_timeout_s, client.attach_timeout_s) == (7.0, 9.0)
    assert client.table_arena()[1] >= 32 * (2 + 32 * 80) * 8  # sized from the geometry
    assert "offers the Plan API: using it natively (fluxon_native)" in caplog.text
    client.close()


def test_fluxon_choice_falls_back_to_the_emulation(monkeypatch, caplog):
    made = []
    monkeypatch.setattr(fluxon_select, "native_plan_api_problem",
                        lambda: "fluxon-py 0.2.4 has no Plan API (missing get_start)")
    monkeypatch.setattr(fluxon_select, "FluxonPublicPlanClient", lambda **kw: made.append(kw) or "emulated")
    with caplog.at_level(logging.INFO, logger="cacheseek.plan.fluxon_select"):
        assert open_fluxon_plan_client(cluster_name="c1", staging_bytes=MiB) == "emulated"
    assert made == [{"cluster_name": "c1", "staging_bytes": MiB}]
    assert "missing get_start); emulating it over the public client (fluxon_public" in caplog.text
    with pytest.raises(PlanUnavailableError, match="api=native: fluxon-py 0.2.4 has no Plan API"):
        open_fluxon_plan_client(api="native")
    assert open_fluxon_plan_client(api="public") == "emulated"


@pytest.mark.fluxon_py
def test_the_installed_fluxon_py_has_no_plan_api():
    problem = fluxon_select.native_plan_api_problem()
    assert problem is not None and "has no Plan API (missing " in problem and "local_fast_put_start" in problem


def test_bad_options_name_the_field():
    with pytest.raises(ConfigError, match="store.client_options.api"):
        open_fluxon_plan_client(api="rdma")
    with pytest.raises(ConfigError, match="store.client_options.staging_bytes"):
        FluxonPublicPlanClient(staging_bytes=0)
    with pytest.raises(ConfigError, match="store.client_options.io_threads"):
        FluxonPublicPlanClient(io_threads=0)


# -- the Plan tier on the real service ---------------------------------------------------------------

ROLLED = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)


def _wipe(store, nodes) -> None:
    for node in nodes:
        store.free(node.blob)
        store.free_skeleton(node.skeleton.latent_locator)


@pytest.mark.fluxon
@pytest.mark.parametrize("kind", ["host", "fake_cuda"])
def test_plan_tier_restores_a_rolled_ring_from_fluxon(fluxon_client, kind):
    """Every resume depth of a rolling ring with a sink, restored through zero-copy views; on
    the (fake) CUDA runtime the owner's read-only mapping registers read-only, staging writable."""
    client = FluxonPublicPlanClient(client=fluxon_client, staging_bytes=4 * MiB)
    owner, staging = client.wait_local_segments_ready()
    assert not owner.writable and staging.writable
    fake = None
    if kind == "host":
        runtime = HostTransferRuntime()
    else:
        runtime, fake = fake_cuda_runtime()
        fake.readonly_ranges.append((owner.ptr, owner.length))  # as the H200 refuses default flags
    store = PlanTierStore(plan_client=client, transfer=runtime, overlap=False)
    nodes = []
    try:
        if fake is not None:
            assert fake.memory.registered[owner.ptr][1] & fake.cudaHostRegisterReadOnly
            assert not fake.memory.registered[staging.ptr][1] & fake.cudaHostRegisterReadOnly
        nodes, states, latents, kv_size = ingest(store, ROLLED, 4)
        assert all(n.blob.ready for n in nodes)
        for k in (1, 2, 4):
            target = restore_target(ROLLED, k, kv_size)
            window = [nodes[d] for d in ROLLED.window_depths(k)]
            assert store.read_path(nodes[:k], window, target)
            cold, local_end, _ = states[k - 1]
            for (rk, rv), (ck, cv) in zip(target.kv, cold):
                assert torch.equal(rk[:, :local_end], ck[:, :local_end])
                assert torch.equal(rv[:, :local_end], cv[:, :local_end])
            assert all(torch.equal(g, w) for g, w in zip(target.latents, latents[:k]))
        assert client.live_handles() == (0, 0) and client.staging_usage()[0] == 0
        stats = store.stats
        assert stats.read_hits == 3 and stats.plans_committed == 4 + 4  # one per chunk and latent
    finally:
        _wipe(store, nodes)
        store.close()
        client.close()
    if fake is not None:
        assert not fake.memory.registered  # both mappings unregistered at close
    assert not fluxon_client.closed


@pytest.mark.fluxon
def test_partial_window_is_a_miss_and_nothing_is_copied(fluxon_client):
    client = FluxonPublicPlanClient(client=fluxon_client, staging_bytes=MiB)
    store = PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False)
    geom = RingGeometry(chunk_size=3, frame_tokens=2)
    nodes, _, _, kv_size = ingest(store, geom, 2)
    try:
        fluxon_client.remove(layer_keys(nodes[1].blob.locator, 1)[1])  # one value of chunk 1 gone
        target = restore_target(geom, 2, kv_size)
        assert not store.read_path(nodes, nodes, target)
        assert not any(t.any() for pair in target.kv for t in pair)
        assert store.contains([*layer_keys(nodes[1].blob.locator, 0), *layer_keys(nodes[1].blob.locator, 1)]) \
            == [True, True, True, False]
        assert client.live_handles() == (0, 0)
    finally:
        _wipe(store, nodes)
        store.close()
        client.close()


@pytest.mark.fluxon
def test_commit_codes_store_full_and_a_value_too_large(fluxon_client, key_prefix):
    """Three 20 MiB values (32 MiB slots) overflow the 64 MiB segment: the commit reports
    StorageFull per key and frees the staging; a 40 MiB value (a 64 MiB slot) is refused at
    put_start, before any copy or Fluxon call."""
    client = FluxonPublicPlanClient(client=fluxon_client, staging_bytes=64 * MiB, io_threads=1)
    keys = [f"{key_prefix}big{i}" for i in range(3)]
    try:
        t0 = time.monotonic()
        with pytest.raises(FluxonValueTooLargeError, match="power-of-two slots"):
            client.local_fast_put_start([f"{key_prefix}huge"], 40 * MiB)
        assert time.monotonic() - t0 < 0.5 and client.staging_usage()[0] == 0
        plan, table = client.local_fast_put_start(keys, 20 * MiB)
        for p in decode_plan_table(table, 3, arena=client.table_arena()):
            ctypes.memset(p, 0x5A, 20 * MiB)
        result = client.local_fast_put_commit(plan).result(timeout=60)
        assert not result.ok and PutKeyCode.STORE_FULL in result.key_codes, result
        assert "StorageFullError(6000)" in result.message
        assert client.staging_usage()[0] == 0
        with pytest.raises(StoreFullError,
                           match="staging full: need 75497472 bytes .* raise store.client_options.staging_bytes"):
            client.local_fast_put_start(keys, 24 * MiB)
    finally:
        for key in keys:
            fluxon_client.remove(key)
        client.close()
        wait_for_space(fluxon_client, f"{key_prefix}probe", 20 * MiB)


def wait_for_space(fluxon_client, key: str, nbytes: int, timeout_s: float = 15.0) -> None:
    """Fluxon frees removed values asynchronously (~1 s): wait until ``nbytes`` fit again, so
    that the next test on the session service starts with room."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fluxon_client.put_bytes(key, bytes(nbytes))
            break
        except StoreFullError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    fluxon_client.remove(key)


@pytest.mark.fluxon
def test_a_value_that_is_not_a_zero_copy_view_is_refused(fluxon_client, key_prefix):
    """A key written by another kind of writer comes back as a private copy (CacheSeek's field
    as bytes), not a view into the segment, or without CacheSeek's field (fluxon's own bytes
    'payload'): either get is refused clearly."""
    key = f"{key_prefix}foreign"
    client = FluxonPublicPlanClient(client=fluxon_client, staging_bytes=MiB)
    try:
        fluxon_client.native_store.put_blocking(key, {VALUE_FIELD: b"x" * 64}).unwrap()
        with pytest.raises(PlanError, match="not a zero-copy view into the owner's segment"):
            client.get_start([key], [1])
        fluxon_client.native_store.put_blocking(key + "2", {"payload": b"x" * 64}).unwrap()
        with pytest.raises(StoreError, match="has no payload field .* .not written by CacheSeek"):
            client.get_start([key + "2"], [1])
        assert client.live_handles() == (0, 0)
    finally:
        fluxon_client.remove(key)
        fluxon_client.remove(key + "2")
        client.close()


@pytest.mark.fluxon
def test_plan_tier_builds_the_fluxon_client_from_its_name(fluxon_service, caplog):
    """``client: fluxon`` with client_options attaches its own Fluxon client (and closes it)."""
    opts = dict(cluster_name=fluxon_service.cluster_name, share_mem_path=fluxon_service.share_mem_path,
                op_timeout_s=10.0, staging_bytes=MiB)
    with caplog.at_level(logging.INFO, logger="cacheseek.plan.fluxon_select"):
        store = PlanTierStore(client="fluxon", client_options=opts, transfer=HostTransferRuntime())
    assert "emulating it over the public client (fluxon_public" in caplog.text
    client = store.plan_client
    assert isinstance(client, FluxonPublicPlanClient)
    k = torch.arange(32, dtype=torch.float32).reshape(1, 2, 4, 4)
    handle = store.put_async("feedface:kv", [(k, -k)], tier=Tier.FLUXON_DRAM)
    assert handle.ready
    got = store.get_layer(handle, 0, like=(k, k))
    assert torch.equal(got[0], k) and torch.equal(got[1], -k)
    store.free(handle)
    store.close()
    assert client.closed and client.fluxon_client.closed
