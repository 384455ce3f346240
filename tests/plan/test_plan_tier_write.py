"""The Plan tier's write path: grouping, ordering, failure handling at every step, reclamation,
capacity, no CPU staging. Runs on the host runtime and on the CUDA runtime over the fake cudart."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from cacheseek.errors import PlanError, StoreClosedError, StoreError, StoreFullError
from cacheseek.registry import STORES
from cacheseek.reuse.exact_prefix.types import BlobState, Tier
from cacheseek.stores.base import PathReadStore, TierStore
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.batch import Direction
from cacheseek.transfer.host_transfer import HostTransferRuntime

from fakes.cudart_types import cudaError_t

TIER = Tier.FLUXON_DRAM


def ring_tail_payload(n_layers=2, tokens=4, heads=2, dim=4, *, v_tokens=None, seed=0):
    """Per layer (k, v): detached views of a ring's tail ``[1, tokens, H, D]``, like the binding's."""
    g = torch.Generator().manual_seed(seed)
    payload, rings = [], []
    for _ in range(n_layers):
        ring_k = torch.randn(1, 3 * tokens, heads, dim, generator=g)
        ring_v = torch.randn(1, 3 * (v_tokens or tokens), heads, dim, generator=g)
        rings.append((ring_k, ring_v))
        payload.append((ring_k[:, tokens : 2 * tokens].detach(), ring_v[:, -(v_tokens or tokens) :].detach()))
    return payload, rings


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).flatten().tolist())


def stored(store, handle, layer):
    return store.get_layer(handle, layer)


def names(log, *wanted):
    return [e[1] for e in log if e[1] in wanted or e[0] in wanted]


def test_is_tier_and_path_read_store(make_store):
    store, _ = make_store()
    assert isinstance(store, TierStore) and isinstance(store, PathReadStore)
    assert store.accepts_device_views is True
    assert STORES.get("fluxon_plan") is PlanTierStore


def test_same_size_values_are_one_plan(make_store, transfer_kind):
    store, parts = make_store(transfer_kind)
    payload, _ = ring_tail_payload(n_layers=3)
    ready = []
    handle = store.put_async("aa:kv", payload, tier=TIER, on_ready=ready.append)
    assert ready == [handle] and handle.ready and handle.state is BlobState.READY
    assert (handle.locator, handle.n_layers, handle.nbytes) == ("aa:kv", 3, 6 * 4 * 2 * 4 * 4)
    starts = [e for e in parts["log"] if e[1] == "local_fast_put_start"]
    assert [list(e[2]) for e in starts] == [[f"aa:kv:L{i}:{h}" for i in range(3) for h in "kv"]]
    for i, (k, v) in enumerate(payload):
        assert stored(store, handle, i) == (as_bytes(k), as_bytes(v))
    s = store.stats
    assert (s.plans_started, s.plans_committed, s.plans_aborted, s.puts) == (1, 1, 0, 1)
    assert s.n_values == 6 and s.put_bytes == handle.nbytes


def test_mixed_sizes_are_one_plan_per_size(make_store, transfer_kind):
    store, parts = make_store(transfer_kind)
    payload, _ = ring_tail_payload(n_layers=2, tokens=4, v_tokens=2)
    handle = store.put_async("mm:kv", payload, tier=TIER)
    starts = [list(e[2]) for e in parts["log"] if e[1] == "local_fast_put_start"]
    assert starts == [["mm:kv:L0:k", "mm:kv:L1:k"], ["mm:kv:L0:v", "mm:kv:L1:v"]]
    assert len(parts["transfer"].batches) == 1  # one batch across both groups
    for i, (k, v) in enumerate(payload):
        got_k, got_v = store.get_layer(handle, i, like=(k, v))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_order_starts_copy_sync_commits_then_ready(make_store):
    store, parts = make_store("fake_cuda")
    log = parts["log"]
    payload, _ = ring_tail_payload(tokens=4, v_tokens=2)
    log.clear()
    store.put_async("oo:kv", payload, tier=TIER, on_ready=lambda h: log.append(("cb", "on_ready", h.ready)))
    seq = names(
        log, "local_fast_put_start", "cudaMemcpyBatchAsync", "cudaMemcpyAsync", "cudaStreamSynchronize",
        "local_fast_put_commit", "on_ready", "cudaHostRegister",
    )
    assert seq == [
        "local_fast_put_start", "local_fast_put_start", "cudaMemcpyBatchAsync", "cudaStreamSynchronize",
        "local_fast_put_commit", "local_fast_put_commit", "on_ready",
    ]
    assert log[-1] == ("cb", "on_ready", True)


def test_descriptors_point_straight_at_the_ring_views(make_store, transfer_kind, monkeypatch):
    store, parts = make_store(transfer_kind)
    payload, _ = ring_tail_payload()

    def refuse(*_a, **_k):
        raise AssertionError("the Plan tier must not stage through CPU copies")

    for name in ("cpu", "to", "numpy", "clone", "contiguous", "pin_memory", "copy_"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    store.put_async("ns:kv", payload, tier=TIER)
    monkeypatch.undo()
    (batch,) = parts["transfer"].batches
    views = [t for pair in payload for t in pair]
    assert [d.src for d in batch] == [t.data_ptr() for t in views]
    assert {d.direction for d in batch} == {Direction.D2H}
    (seg,) = parts["client"].wait_local_segments_ready()
    assert all(seg.ptr <= d.dst and d.dst + d.nbytes <= seg.ptr + seg.length for d in batch)


def test_segments_registered_at_construction_not_on_first_write(make_store):
    store, parts = make_store("fake_cuda")
    fake = parts["fake"]
    (seg,) = parts["client"].wait_local_segments_ready()
    assert [c.args[:2] for c in fake.calls_named("cudaHostRegister")] == [(seg.ptr, seg.length)]
    before = len(fake.calls)
    store.put_async("rr:kv", ring_tail_payload()[0], tier=TIER)
    assert not [c for c in fake.calls[before:] if c.name == "cudaHostRegister"]
    assert store.stats.register_seconds > 0 and store.stats.segment_ready_seconds > 0


def assert_nothing_left(store, parts, handle, locator):
    assert parts["client"].keys() == [] or not any(k.startswith(locator) for k in parts["client"].keys())
    assert parts["client"].usage().used_bytes == 0
    assert parts["client"].live_handles() == (0, 0)
    assert not handle.ready
    assert isinstance(handle.error, StoreError)


def put_failing(store, locator, payload):
    seen = []
    with pytest.raises(StoreError) as info:
        store.put_async(locator, payload, tier=TIER, on_ready=seen.append)
    assert seen == []
    return info.value


class Captured:
    handle = None


@pytest.fixture
def capture_handle(monkeypatch):
    """The handle of a failed put is never returned: catch it as the store makes it."""
    from cacheseek.stores.plan_tier import write as plan_tier

    cap = Captured()
    real = plan_tier.BlobHandle

    def make(*a, **k):
        cap.handle = real(*a, **k)
        return cap.handle

    monkeypatch.setattr(plan_tier, "BlobHandle", make)
    return cap


@pytest.mark.parametrize("batch_api", ["13", None])
def test_copy_failure_synchronizes_then_aborts_every_plan(make_store, capture_handle, batch_api):
    store, parts = make_store("fake_cuda", batch_api=batch_api, stream=0 if batch_api is None else 7)
    fake, log = parts["fake"], parts["log"]
    if batch_api is None:
        fake.fail("cudaMemcpyAsync", nth=3)
    else:
        fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue)
    payload, _ = ring_tail_payload(tokens=4, v_tokens=2)
    error = put_failing(store, "cf:kv", payload)
    assert isinstance(error, PlanError) and "TransferError" in str(error)
    seq = names(log, "cudaStreamSynchronize", "put_abort", "local_fast_put_commit")
    assert seq == ["cudaStreamSynchronize", "put_abort", "put_abort"]
    assert fake.pending() == 0
    assert store.stats.plans_aborted == 2 and store.stats.put_failures == 1
    assert_nothing_left(store, parts, capture_handle.handle, "cf:kv")


@pytest.mark.parametrize("point", ["table_magic", "table_count", "table_null"])
def test_decode_failure_aborts_before_any_copy(make_store, capture_handle, transfer_kind, point):
    store, parts = make_store(transfer_kind)
    parts["faults"].arm(point, nth=2)  # the second group's table
    payload, _ = ring_tail_payload(tokens=4, v_tokens=2)
    error = put_failing(store, "df:kv", payload)
    assert "PlanTableError" in str(error)
    assert parts["transfer"].batches == []
    assert names(parts["log"], "put_abort") == ["put_abort", "put_abort"]
    assert_nothing_left(store, parts, capture_handle.handle, "df:kv")


def test_start_failure_of_a_later_group_aborts_the_earlier(make_store, capture_handle, transfer_kind):
    store, parts = make_store(transfer_kind)
    parts["faults"].arm("put_start", nth=2)
    error = put_failing(store, "sf:kv", ring_tail_payload(tokens=4, v_tokens=2)[0])
    assert isinstance(error, PlanError)
    assert names(parts["log"], "put_abort") == ["put_abort"]
    assert_nothing_left(store, parts, capture_handle.handle, "sf:kv")


def test_store_full_is_raised_as_is_and_rolls_back(make_store, capture_handle):
    store, parts = make_store("host", segment_bytes=1 << 12)
    payload, _ = ring_tail_payload(n_layers=5, tokens=8, heads=2, dim=8)  # 10 values of 512 B > 4 KiB
    with pytest.raises(StoreFullError, match="store full: need .* raise store.segment_bytes or free values"):
        store.put_async("full:kv", payload, tier=TIER)
    assert_nothing_left(store, parts, capture_handle.handle, "full:kv")


def test_store_full_on_a_later_group_aborts_the_earlier(make_store, capture_handle):
    store, parts = make_store("host", segment_bytes=1 << 12)
    payload, _ = ring_tail_payload(n_layers=2, tokens=8, heads=2, dim=8, v_tokens=32)  # k: 2x512 fits, then v: 2x2048 does not
    with pytest.raises(StoreFullError):
        store.put_async("full2:kv", payload, tier=TIER)
    assert names(parts["log"], "put_abort") == ["put_abort"]
    assert_nothing_left(store, parts, capture_handle.handle, "full2:kv")


def test_commit_status_failure_removes_what_was_committed(make_store, capture_handle, transfer_kind):
    store, parts = make_store(transfer_kind)
    parts["faults"].arm("commit_status")
    error = put_failing(store, "cs:kv", ring_tail_payload()[0])
    assert "status 1" in str(error)
    assert_nothing_left(store, parts, capture_handle.handle, "cs:kv")


def test_per_key_code_failure_is_caught_and_cleaned(make_store, capture_handle, transfer_kind):
    store, parts = make_store(transfer_kind)
    parts["faults"].key_codes["kc:kv:L1:v"] = 6000
    error = put_failing(store, "kc:kv", ring_tail_payload()[0])
    assert "kc:kv:L1:v=6000" in str(error)
    assert_nothing_left(store, parts, capture_handle.handle, "kc:kv")


def test_no_orphans_when_a_later_group_fails_after_an_earlier_committed(make_store, capture_handle, transfer_kind):
    store, parts = make_store(transfer_kind)
    parts["faults"].key_codes["or:kv:L0:v"] = 4001  # second group (v values)
    error = put_failing(store, "or:kv", ring_tail_payload(tokens=4, v_tokens=2)[0])
    assert "or:kv:L0:v=4001" in str(error)
    seq = names(parts["log"], "local_fast_put_commit", "put_abort", "remove")
    assert seq[:2] == ["local_fast_put_commit", "local_fast_put_commit"] and "put_abort" not in seq
    assert_nothing_left(store, parts, capture_handle.handle, "or:kv")


def test_commit_call_raising_is_never_followed_by_abort(make_store, capture_handle):
    store, parts = make_store("host")
    parts["faults"].arm("commit_raise", nth=2)
    put_failing(store, "cr:kv", ring_tail_payload(tokens=4, v_tokens=2)[0])
    assert "put_abort" not in names(parts["log"], "put_abort")
    assert_nothing_left(store, parts, capture_handle.handle, "cr:kv")


def test_strided_or_foreign_payload_is_a_store_error(make_store):
    store, parts = make_store("host")
    k = torch.zeros(1, 4, 2, 4)
    with pytest.raises(PlanError, match="contiguous"):
        store.put_async("st:kv", [(k.transpose(1, 2), k)], tier=TIER)
    with pytest.raises(PlanError, match="tensor on 'meta'"):
        store.put_async("st:kv", [(torch.zeros(4, device="meta"), k)], tier=TIER)
    with pytest.raises(PlanError, match="empty payload"):
        store.put_async("st:kv", [], tier=TIER)
    for layer in [(k,), (k, k, k)]:  # a layer is exactly (K, V): never half a chunk stored as ready
        with pytest.raises(PlanError, match="unpack"):
            store.put_async("st:kv", [layer], tier=TIER)
    assert parts["client"].keys() == [] and parts["client"].live_handles() == (0, 0)


def test_free_removes_kv_and_keeps_the_skeleton(make_store, transfer_kind):
    store, parts = make_store(transfer_kind)
    handle = store.put_async("ff:kv", ring_tail_payload()[0], tier=TIER)
    store.put_skeleton("ff:lat", torch.ones(1, 4, 3, 2, 2))
    store.free(handle)
    assert parts["client"].keys() == ["ff:lat"]
    store.free(handle)  # idempotent
    assert store.get_layer(handle, 0) is None
    assert torch.equal(store.get_skeleton("ff:lat", like=torch.zeros(1, 4, 3, 2, 2)), torch.ones(1, 4, 3, 2, 2))


def test_free_failure_raises_so_the_manager_keeps_the_blob(make_store):
    store, parts = make_store("host")
    handle = store.put_async("fx:kv", ring_tail_payload()[0], tier=TIER)
    parts["faults"].arm("remove", nth=2)
    with pytest.raises(PlanError, match="free of fx:kv: 1 removals failed, first fx:kv:L0:v"):
        store.free(handle)
    store.free(handle)
    assert parts["client"].keys() == []


def test_skeleton_round_trip_and_raw_bytes(make_store, transfer_kind):
    store, _ = make_store(transfer_kind)
    latent = torch.arange(48, dtype=torch.bfloat16).reshape(1, 4, 3, 2, 2)
    store.put_skeleton("sk:lat", latent)
    assert torch.equal(store.get_skeleton("sk:lat", like=torch.empty_like(latent)), latent)
    assert store.get_skeleton("sk:lat") == as_bytes(latent)
    assert store.get_skeleton("missing:lat", like=latent) is None


def test_flush_is_a_no_op_and_close_is_idempotent(make_store):
    store, parts = make_store("fake_cuda")
    store.flush()
    store.close()
    store.close()
    (seg,) = parts["client"].wait_local_segments_ready()
    assert [c.args for c in parts["fake"].calls_named("cudaHostUnregister")] == [(seg.ptr,)]
    with pytest.raises(StoreClosedError):
        store.put_async("x:kv", ring_tail_payload()[0], tier=TIER)


def test_transfer_chosen_from_first_tensors_when_not_given():
    store = PlanTierStore(segment_bytes=1 << 20)
    assert store.transfer is None
    store.put_async("lz:kv", ring_tail_payload()[0], tier=TIER)
    assert isinstance(store.transfer, HostTransferRuntime)
    assert store.transfer.stats.n_registered == 1
    store.close()


def test_built_from_the_registered_schema_with_objects_passed_at_instantiate():
    schema = STORES.schema("fluxon_plan")
    fields = {f.name: f.default for f in dataclasses.fields(schema) if f.name != "client_options"}
    assert fields["client"] == "embedded" and fields["segment_bytes"] == "auto" and fields["prefault_threads"] == 0
    assert fields["overlap"] is None and fields["hugepages"] is True
    cfg = OmegaConf.structured(schema(segment_bytes=1 << 20, device="cpu"))
    transfer = HostTransferRuntime()
    store = instantiate(cfg, transfer=transfer)
    assert isinstance(store, PlanTierStore) and store.transfer is transfer
    assert transfer.stats.n_registered == 1  # registered at construction
    store.close()
    assert transfer.stats.n_registered == 0  # unregistered, but the caller's runtime stays open
    store2 = instantiate(OmegaConf.structured(schema(segment_bytes=1 << 20, device="cpu")))
    assert isinstance(store2.transfer, HostTransferRuntime)
    store2.close()
