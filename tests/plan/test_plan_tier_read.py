"""The Plan tier's whole-path read: ring reconstruction (full length, rolled, sink plus recent)
against a cold run, latent-first order, partial-prefix misses, and handle cleanup on every path."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import LayoutMismatchError, PlanError, PlanTableError, TransferError
from cacheseek.kv.ring import RingGeometry
from cacheseek.stores.base import RestoreTarget
from cacheseek.transfer.batch import Direction
from plan_testkit import ingest, restore_target

N_LAYERS = 2
TOKEN_BYTES = 2 * 4 * 4  # heads * dim * float32


def target_for(geom: RingGeometry, k: int, kv_size: int) -> RestoreTarget:
    return restore_target(geom, k, kv_size)


def window_of(nodes, geom, k):
    return [nodes[d] for d in geom.window_depths(k)]


GEOMETRIES = {
    "full_length": (RingGeometry(chunk_size=3, frame_tokens=2), 4),
    "rolled_no_sink": (RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=6, sink_size=0), 5),
    "sink_plus_recent": (RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3), 5),
    "partial_sink_chunk": (RingGeometry(chunk_size=2, frame_tokens=2, local_attn_size=6, sink_size=1), 6),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_ring_reconstruction_matches_the_cold_run(make_store, transfer_kind, name):
    geom, n_chunks = GEOMETRIES[name]
    store, parts = make_store(transfer_kind)
    nodes, states, latents, kv_size = ingest(store, geom, n_chunks)
    for k in range(1, n_chunks + 1):
        target = target_for(geom, k, kv_size)
        assert store.read_path(nodes[:k], window_of(nodes, geom, k), target)
        cold, local_end, global_end = states[k - 1]
        assert geom.cursors(k) == (global_end, local_end)
        for (rk, rv), (ck, cv) in zip(target.kv, cold):
            assert torch.equal(rk[:, :local_end], ck[:, :local_end])
            assert torch.equal(rv[:, :local_end], cv[:, :local_end])
            assert not rk[:, local_end:].any()
        for got, want in zip(target.latents, latents[:k]):
            assert torch.equal(got, want)
    assert parts["client"].live_handles() == (0, 0)
    assert store.stats.read_hits == n_chunks


def test_a_rolled_restore_is_three_runs_per_tensor(make_store):
    geom, n_chunks = GEOMETRIES["sink_plus_recent"]
    store, parts = make_store("fake_cuda")
    nodes, _, _, kv_size = ingest(store, geom, 3)
    target = target_for(geom, 3, kv_size)
    parts["transfer"].batches.clear()
    assert store.read_path(nodes, window_of(nodes, geom, 3), target)
    (batch,) = parts["transfer"].batches  # one batch: the KV runs, then the latents
    kv_batch, latent_batch = batch[: 3 * N_LAYERS * 2], batch[3 * N_LAYERS * 2 :]
    assert len(latent_batch) == 3 and [d.dst for d in latent_batch] == [t.data_ptr() for t in target.latents]
    assert {d.direction for d in batch} == {Direction.H2D}
    rings = [t for pair in target.kv for t in pair]
    # chunk-major runs, then layer, then K before V; destinations inside the ring tensors
    for i, d in enumerate(kv_batch):
        run, rest = divmod(i, N_LAYERS * 2)
        ring = rings[rest]
        assert d.dst == ring.data_ptr() + target.runs[run].dst_token * TOKEN_BYTES
        assert d.nbytes == target.runs[run].n_tokens * TOKEN_BYTES


READ_CALLS = ("get_start", "get_transfer", "copy_batch", "cudaStreamWaitEvent", "cudaEventSynchronize",
              "release_views", "cancel_get_transfer", "cudaStreamSynchronize")


def test_read_order_on_the_producer_stream_one_get_one_batch_one_sync_then_views_released(make_store):
    """Where the runtime moves the batch as fast on the producer stream (the batch API is offered
    on stream 7), the read goes there: the stream orders it, no event is waited for."""
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("fake_cuda")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    log, fake = parts["log"], parts["fake"]
    log.clear()
    waits_before = len(fake.calls_named("cudaStreamWaitEvent"))
    assert store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    seq = [e[1] for e in log if e[1] in READ_CALLS]
    assert seq == ["get_start", "get_transfer", "copy_batch", "cudaEventSynchronize", "release_views"]
    (keys,) = [e[2] for e in log if e[1] == "get_start"]
    h0, h1 = nodes[0].blob.locator, nodes[1].blob.locator
    assert keys == [n.skeleton.latent_locator for n in nodes] + [
        f"{h}:L{i}:{x}" for h in (h0, h1) for i in range(N_LAYERS) for x in "kv"]
    assert fake.calls_named("cudaMemcpyBatchAsync")[-1].args[-1] == 7  # the producer stream itself
    assert len(fake.calls_named("cudaStreamWaitEvent")) == waits_before
    assert fake.live_events() == parts["runtime"].idle_events


def test_read_order_on_the_read_stream_after_the_producer_and_before_it(make_store):
    """On the legacy default stream the batch API is refused: the read goes on the store's read
    stream, after an event of the producer stream, and the producer waits for its completion."""
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("fake_cuda", stream=0)
    nodes, _, _, kv_size = ingest(store, geom, 2)
    log, fake = parts["log"], parts["fake"]
    log.clear()
    assert store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    seq = [e[1] for e in log if e[1] in READ_CALLS]
    assert seq == ["get_start", "get_transfer", "copy_batch", "cudaStreamWaitEvent", "cudaStreamWaitEvent",
                   "cudaEventSynchronize", "release_views"]
    read_stream = parts["transfer"].streams[-1]
    assert read_stream not in (0, 1, 7)
    assert fake.calls_named("cudaMemcpyBatchAsync")[-1].args[-1] == read_stream  # the batch API, on the read stream
    waits = fake.calls_named("cudaStreamWaitEvent")[-2:]
    assert waits[0].args[0] == read_stream and waits[1].args[0] == 0  # producer -> read -> producer
    assert fake.live_events() == parts["runtime"].idle_events


def kv_untouched(target):
    return all(not t.any() for pair in target.kv for t in pair)


def test_partial_transferable_prefix_is_a_miss_with_nothing_copied(make_store, transfer_kind):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store(transfer_kind)
    nodes, _, _, kv_size = ingest(store, geom, 3)
    parts["client"].remove(f"{nodes[1].blob.locator}:L1:v")
    target = target_for(geom, 3, kv_size)
    parts["transfer"].batches.clear()
    assert store.read_path(nodes, nodes, target) is False
    assert kv_untouched(target)
    assert parts["transfer"].batches == []  # not even the latents: one get, all or nothing
    assert parts["client"].live_handles() == (0, 0)
    assert store.stats.read_misses == 1


def test_missing_latent_is_a_miss_before_any_kv_is_read(make_store, transfer_kind):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store(transfer_kind)
    nodes, _, _, kv_size = ingest(store, geom, 3)
    parts["client"].remove(nodes[2].skeleton.latent_locator)
    target = target_for(geom, 3, kv_size)
    parts["log"].clear()
    parts["transfer"].batches.clear()
    assert store.read_path(nodes, nodes, target) is False
    assert kv_untouched(target) and parts["transfer"].batches == []
    assert [e[1] for e in parts["log"] if e[1] == "get_start"] == ["get_start"]
    assert parts["client"].live_handles() == (0, 0)


def test_node_without_ready_blob_or_skeleton_is_a_miss_without_store_calls(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    nodes[1].blob.ready = False
    parts["log"].clear()
    assert store.read_path(nodes, nodes, target_for(geom, 2, kv_size)) is False
    nodes[1].blob.ready = True
    nodes[0].skeleton = None
    assert store.read_path(nodes, nodes, target_for(geom, 2, kv_size)) is False
    assert not [e for e in parts["log"] if e[1] == "get_start"]


@pytest.mark.parametrize("field, value", [("n_layers", N_LAYERS + 1), ("nbytes", 12345)])
def test_layout_mismatch_is_refused_before_reading(make_store, field, value):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    setattr(nodes[0].blob, field, value)
    parts["log"].clear()
    with pytest.raises(LayoutMismatchError):
        store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    assert not [e for e in parts["log"] if e[1] == "get_start"]


def test_window_or_latent_count_mismatch_is_refused(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, _ = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    with pytest.raises(LayoutMismatchError, match="window depths"):
        store.read_path(nodes, nodes[1:], target_for(geom, 2, kv_size))
    with pytest.raises(LayoutMismatchError, match="latent targets"):
        store.read_path(nodes[:1], nodes, target_for(geom, 2, kv_size))


def test_kv_copy_failure_synchronizes_and_releases_views(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("fake_cuda", batch_api=None, stream=0)
    nodes, _, _, kv_size = ingest(store, geom, 2)
    fake, log = parts["fake"], parts["log"]
    fake.fail("cudaMemcpyAsync", nth=3)  # the batch's third copy (a KV run; the latents come last)
    log.clear()
    with pytest.raises(TransferError):
        store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    tail = [e[1] for e in log if e[1] in ("cudaStreamSynchronize", "cudaEventSynchronize", "release_views")]
    assert tail == ["cudaStreamSynchronize", "release_views"]  # what went out landed, then the views
    assert fake.pending() == 0 and parts["client"].live_handles() == (0, 0) and fake.live_events() == parts["runtime"].idle_events


def test_get_transfer_failure_cancels_the_plan(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    parts["faults"].arm("get_transfer")  # the read's one get
    with pytest.raises(PlanError, match="injected"):
        store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    assert "cancel_get_transfer" in [e[1] for e in parts["log"]]
    assert store.stats.gets_cancelled == 1 and parts["client"].live_handles() == (0, 0)


def test_decode_failure_on_read_releases_views(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    parts["faults"].arm("table_count")
    target = target_for(geom, 2, kv_size)
    with pytest.raises(PlanTableError):
        store.read_path(nodes, nodes, target)
    assert kv_untouched(target) and parts["client"].live_handles() == (0, 0)


def test_get_start_failure_leaves_no_handle(make_store):
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("host")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    parts["faults"].arm("get_start")
    with pytest.raises(PlanError):
        store.read_path(nodes, nodes, target_for(geom, 2, kv_size))
    assert parts["client"].live_handles() == (0, 0)


def test_read_stages_nothing_through_cpu_copies(make_store, monkeypatch):
    geom, _ = GEOMETRIES["sink_plus_recent"]
    store, parts = make_store("host")
    nodes, states, _, kv_size = ingest(store, geom, 4)
    target = target_for(geom, 4, kv_size)

    def refuse(*_a, **_k):
        raise AssertionError("the Plan tier must not stage through CPU copies")

    for name in ("cpu", "to", "numpy", "clone", "contiguous", "pin_memory", "copy_"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    assert store.read_path(nodes, window_of(nodes, geom, 4), target)
    monkeypatch.undo()
    cold, local_end, _ = states[3]
    assert torch.equal(target.kv[1][1][:, :local_end], cold[1][1][:, :local_end])


@pytest.mark.parametrize("wider", ["latent", "kv"])
def test_a_value_shorter_than_its_target_is_refused_before_any_copy(make_store, wider):
    """The real client's first failure: a bf16 latent restored into a float32 target read past the
    stored value. Every value's length is checked against its target before the first copy."""
    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("fake_cuda")
    nodes, _, _, kv_size = ingest(store, geom, 2)
    target = target_for(geom, 2, kv_size)
    if wider == "latent":  # twice the stored latent's bytes, as float64 is to float32
        target = RestoreTarget(kv=target.kv, runs=target.runs, window_depths=target.window_depths,
                               token_bytes=target.token_bytes, chunk_tokens=target.chunk_tokens,
                               latents=tuple(torch.zeros(t.shape, dtype=torch.float64) for t in target.latents))
    else:  # the blob's nbytes say the values are what the ring takes, but one is not
        victim = f"{nodes[1].blob.locator}:L1:v"
        client = parts["client"]
        client.remove(victim)
        plan, table = client.local_fast_put_start([victim], 8)
        client.local_fast_put_commit(plan).result()
    parts["transfer"].batches.clear()
    with pytest.raises(LayoutMismatchError, match="restore target takes"):
        store.read_path(nodes, window_of(nodes, geom, 2), target)
    # every length, latents and KV, is checked before the one batch is built
    assert parts["transfer"].batches == []
    assert not any(t.any() for pair in target.kv for t in pair)
    assert parts["client"].live_handles() == (0, 0)


def test_a_ring_is_declared_once_and_another_ring_is_checked_again(make_store, monkeypatch):
    """The ring's device ranges are checked with ``device_range`` on the first restore into it
    only; a restore into another ring (new tensors, or one tensor at the same address with
    another size) checks every tensor again, and every restore lands byte for byte."""
    geom, n_chunks = GEOMETRIES["sink_plus_recent"]
    store, parts = make_store("fake_cuda")
    nodes, states, _, kv_size = ingest(store, geom, n_chunks)
    checked = []
    inner = type(parts["runtime"]).device_range
    monkeypatch.setattr(type(parts["runtime"]), "device_range",
                        lambda self, t: checked.append(t.data_ptr()) or inner(self, t))
    target = target_for(geom, n_chunks, kv_size)
    ring_tensors = 2 * N_LAYERS
    for again in range(3):
        for t in target.kv[0]:
            t.zero_()
        assert store.read_path(nodes, window_of(nodes, geom, n_chunks), target)
        assert len(checked) == ring_tensors + n_chunks  # the ring and the same latent targets, once
    cold, local_end, _ = states[-1]
    assert torch.equal(target.kv[0][0][:, :local_end], cold[0][0][:, :local_end])

    other = target_for(geom, n_chunks, kv_size)
    before = len(checked)
    assert store.read_path(nodes, window_of(nodes, geom, n_chunks), other)
    assert len(checked) - before == ring_tensors + n_chunks
    longer = torch.zeros(1, kv_size + 1, *other.kv[0][0].shape[2:], dtype=other.kv[0][0].dtype)
    resized = RestoreTarget(kv=((longer, other.kv[0][1]),) + other.kv[1:], runs=other.runs,
                            window_depths=other.window_depths, token_bytes=other.token_bytes,
                            chunk_tokens=other.chunk_tokens, latents=other.latents)
    before = len(checked)
    assert store.read_path(nodes, window_of(nodes, geom, n_chunks), resized)
    assert len(checked) - before == ring_tensors + n_chunks


def test_run_arrays_of_a_window_without_runs_are_empty():
    from cacheseek.stores.plan_tier.read import runs_as_arrays

    slot, src, dst, size = runs_as_arrays((), (0,), 128)
    assert [a.shape for a in (slot, src, dst, size)] == [(0,)] * 4
    with pytest.raises(ValueError):
        src[:] = 1  # shared by every restore of the shape: read-only


def _stalled_restore(make_store):
    """A restore whose copies do not land within the transfer runtime's bound (issue 23 item 6)."""
    from cacheseek.errors import TransferTimeoutError

    geom, _ = GEOMETRIES["full_length"]
    store, parts = make_store("fake_cuda")  # the batch on the producer stream: nothing else reaches it
    nodes, _, _, kv_size = ingest(store, geom, 2)
    parts["runtime"].wait_timeout_s = 0.05
    parts["fake"].not_ready_queries = 10**9  # every copy stays in flight until told
    parts["log"].clear()
    target = target_for(geom, 2, kv_size)  # the runtime's ring: alive while its copies may land
    with pytest.raises(TransferTimeoutError) as err:
        store.read_path(nodes, nodes, target)
    assert "views stay held" in "".join(getattr(err.value, "__notes__", [])) or "views stay held" in str(err.value)
    return store, parts, nodes, geom, kv_size, target


def test_a_timed_out_restore_keeps_its_views_until_its_copies_land(make_store):
    store, parts, nodes, geom, kv_size, ring = _stalled_restore(make_store)
    released = [e for e in parts["log"] if e[1] in ("release_views", "cancel_get_transfer")]
    assert released == [] and parts["client"].live_handles()[1] == 1  # never released under DMA
    assert store.stats.views_held == 1
    parts["fake"].not_ready_queries = 0  # the copies land
    assert store.read_path(nodes, nodes, target_for(geom, 2, kv_size))  # the next read ends the late one
    assert parts["client"].live_handles() == (0, 0)
    assert store.stats.views_held == 0 and store.stats.views_released_late == 1 and store.stats.views_leaked == 0
    del ring  # its late copies have landed


def test_a_restore_still_copying_at_close_is_leaked_and_counted_not_released(make_store):
    from cacheseek.errors import StoreTimeoutError

    store, parts, *_, ring = _stalled_restore(make_store)
    with pytest.raises(StoreTimeoutError, match="still in flight at close"):
        store.close()
    assert parts["client"].live_handles()[1] == 1 and not [e for e in parts["log"] if e[1] == "release_views"]
    assert store.stats.views_leaked == 1
    parts["fake"].streams.execute_all()  # the copies land (into the ring, still alive) before it goes
    del ring
