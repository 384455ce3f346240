"""Overlapped writes of the Plan tier: the snapshot the ring cannot overwrite, the side stream and
its event, commit on the completion thread, readiness only after commit, backpressure, flush,
failures after submission (no orphans), and warm-up timers. CUDA paths run over the fake cudart
(copies land only when something waits for them); the host runtime covers the thread logic."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cacheseek.errors import ConfigError, StoreError, WriteNotCompleteError
from cacheseek.reuse.exact_prefix.types import BlobState, Tier
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.batch import Direction
from test_plan_tier_write import as_bytes, ring_tail_payload

from fakes.cudart_types import cudaError_t

TIER = Tier.FLUXON_DRAM


class Gate:
    """Holds every fake copy in flight (event queries answer not-ready) until opened."""

    def __init__(self, fake) -> None:
        self.fake = fake
        fake.not_ready_queries = 10**9

    def open(self) -> None:
        self.fake.not_ready_queries = 0


def overwrite(payload) -> None:
    for k, v in payload:
        k.fill_(-7.0)
        v.fill_(-9.0)


def test_overlap_is_on_for_cuda_runtimes_and_off_for_the_host(make_store):
    cuda_store, _ = make_store("fake_cuda", overlap=None)
    host_store, _ = make_store("host", overlap=None)
    assert cuda_store.overlap is True and host_store.overlap is False
    assert cuda_store.stats.overlap is True


def test_pending_until_the_copies_land_and_the_snapshot_survives_ring_writes(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    gate = Gate(parts["fake"])
    payload, _ = ring_tail_payload(n_layers=3)
    want = [(as_bytes(k), as_bytes(v)) for k, v in payload]
    ready = []
    handle = store.put_async("ov:kv", payload, tier=TIER, on_ready=ready.append)
    overwrite(payload)  # the runtime writes the next chunk into the ring at once
    time.sleep(0.05)
    assert handle.state is BlobState.PENDING and ready == [] and store.stats.pending_writes == 1
    assert parts["client"].keys() == []  # nothing published before the commit
    with pytest.raises(WriteNotCompleteError):
        store.free(handle)
    gate.open()
    store.flush()
    assert handle.ready and ready == [handle] and store.stats.pending_writes == 0
    assert [store.get_layer(handle, i) for i in range(3)] == want
    s = store.stats
    assert s.puts == 1 and s.snapshot_bytes == handle.nbytes and s.plans_committed == 1
    assert s.inflight_bytes == 0 and s.peak_inflight_bytes == handle.nbytes
    assert parts["fake"].live_events() == parts["runtime"].idle_events and parts["client"].live_handles() == (0, 0)


def test_snapshot_on_the_producer_stream_then_d2h_on_the_write_stream(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    fake, rec = parts["fake"], parts["transfer"]
    payload, _ = ring_tail_payload(tokens=4, v_tokens=2)
    rec.batches.clear()
    rec.streams.clear()
    handle = store.put_async("so:kv", payload, tier=TIER, stream=7)
    store.flush()
    snap, d2h = rec.batches
    assert {d.direction for d in snap} == {Direction.D2D} and {d.direction for d in d2h} == {Direction.D2H}
    views = [t for pair in payload for t in pair]
    assert [d.src for d in snap] == [t.data_ptr() for t in views]  # straight from the ring views
    assert {d.src for d in d2h} == {d.dst for d in snap}  # the D2H reads the snapshot only
    producer, write_stream = rec.streams
    assert producer == 7 and write_stream not in (0, 1, 7)
    batch_calls = fake.calls_named("cudaMemcpyBatchAsync")
    assert [c.args[-1] for c in batch_calls[-2:]] == [7, write_stream]  # batch API on both
    (wait,) = [c for c in fake.calls_named("cudaStreamWaitEvent") if c.args[0] == write_stream][-1:]
    assert wait.args[1].stream == 7  # the write stream waits for the producer's snapshot event
    assert handle.ready


def test_commit_only_after_the_copies_landed(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    gate = Gate(parts["fake"])
    log = parts["log"]
    log.clear()
    store.put_async("co:kv", ring_tail_payload()[0], tier=TIER)
    time.sleep(0.05)
    assert "local_fast_put_commit" not in [e[1] for e in log]
    gate.open()
    store.flush()
    seq = [e[1] for e in log if e[1] in ("cudaEventSynchronize", "local_fast_put_commit")]
    assert seq.index("local_fast_put_commit") > seq.index("cudaEventSynchronize")


def test_backpressure_blocks_when_every_slot_is_in_flight(make_store):
    store, parts = make_store("fake_cuda", overlap=True, staging_slots=1)
    gate = Gate(parts["fake"])
    first, _ = ring_tail_payload(seed=1)
    second, _ = ring_tail_payload(seed=2)
    want = [(as_bytes(k), as_bytes(v)) for k, v in second]
    h1 = store.put_async("bp1:kv", first, tier=TIER)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("h", store.put_async("bp2:kv", second, tier=TIER)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and "h" not in box  # blocked: the only slot is in flight
    gate.open()
    t.join(5)
    store.flush()
    assert h1.ready and box["h"].ready
    assert [store.get_layer(box["h"], i) for i in range(2)] == want
    s = store.stats
    assert s.backpressure_waits == 1 and s.backpressure_seconds > 0.05 and s.staging_bytes > 0


def test_max_inflight_bytes_bounds_pending_writes(make_store):
    payload, _ = ring_tail_payload()
    nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in payload)
    store, parts = make_store("host", overlap=True, staging_slots=4, max_inflight_bytes=nbytes)
    for i in range(4):
        store.put_async(f"mi{i}:kv", payload, tier=TIER)
    store.flush()
    s = store.stats
    assert s.puts == 4 and s.peak_inflight_bytes <= nbytes


def test_host_runtime_overlap_round_trip_with_threads(make_store):
    store, parts = make_store("host", overlap=True)
    handles, wants = [], []
    for i in range(5):
        payload, _ = ring_tail_payload(seed=i, tokens=4)
        wants.append([(as_bytes(k), as_bytes(v)) for k, v in payload])
        handles.append(store.put_async(f"h{i}:kv", payload, tier=TIER))
        overwrite(payload)
    store.flush()
    for handle, want in zip(handles, wants):
        assert handle.ready and [store.get_layer(handle, j) for j in range(2)] == want
    assert store.stats.puts == 5 and parts["client"].live_handles() == (0, 0)


@pytest.mark.parametrize("fault", ["commit_status", "key_code", "commit_raise"])
def test_failure_after_submission_leaves_nothing_and_sets_the_error(make_store, fault, transfer_kind):
    store, parts = make_store(transfer_kind, overlap=True)
    if fault == "key_code":
        parts["faults"].key_codes["kf:kv:L1:v"] = 6000
    else:
        parts["faults"].arm(fault)
    ready = []
    handle = store.put_async("kf:kv", ring_tail_payload(tokens=4, v_tokens=2)[0], tier=TIER, on_ready=ready.append)
    store.flush()  # never raises: the failure is on the handle
    assert not handle.ready and isinstance(handle.error, StoreError) and ready == []
    assert handle.state is BlobState.FAILED
    assert parts["client"].keys() == [] and parts["client"].usage().used_bytes == 0
    assert parts["client"].live_handles() == (0, 0)
    s = store.stats
    assert s.put_failures == 1 and s.puts == 0 and s.inflight_bytes == 0
    store.free(handle)  # a failed write is not in flight: freeing it is allowed (removes nothing)


def test_copy_failure_found_by_the_completion_thread_aborts_every_plan(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    parts["fake"].fail("cudaEventQuery", cudaError_t.cudaErrorIllegalAddress)
    handle = store.put_async("cq:kv", ring_tail_payload(tokens=4, v_tokens=2)[0], tier=TIER)
    store.flush()
    assert isinstance(handle.error, StoreError) and "cudaErrorIllegalAddress" in str(handle.error)
    assert store.stats.plans_aborted == 2 and parts["client"].live_handles() == (0, 0)
    assert parts["client"].usage().used_bytes == 0 and parts["fake"].live_events() == parts["runtime"].idle_events


def test_submission_failure_raises_in_put_async_and_rolls_back(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    fake = parts["fake"]
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue, nth=2)  # the D2H, after the snapshot
    with pytest.raises(StoreError, match="cudaMemcpyBatchAsync"):
        store.put_async("sx:kv", ring_tail_payload()[0], tier=TIER)
    assert fake.pending() == 0 and fake.live_events() == parts["runtime"].idle_events
    s = store.stats
    assert s.plans_aborted == 1 and s.put_failures == 1 and s.inflight_bytes == 0 and s.pending_writes == 0
    assert parts["client"].live_handles() == (0, 0) and parts["client"].usage().used_bytes == 0
    handle = store.put_async("sx:kv", ring_tail_payload()[0], tier=TIER)  # the slot was given back
    store.flush()
    assert handle.ready


def test_store_full_raises_before_any_copy(make_store):
    store, parts = make_store("fake_cuda", overlap=True, segment_bytes=1 << 12)
    payload, _ = ring_tail_payload(n_layers=5, tokens=8, heads=2, dim=8)
    parts["transfer"].batches.clear()
    with pytest.raises(StoreError, match="store full"):
        store.put_async("sf:kv", payload, tier=TIER)
    assert parts["transfer"].batches == [] and store.stats.inflight_bytes == 0


def test_close_waits_for_pending_writes(make_store):
    store, parts = make_store("fake_cuda", overlap=True)
    gate = Gate(parts["fake"])
    handle = store.put_async("cl:kv", ring_tail_payload()[0], tier=TIER)
    threading.Timer(0.1, gate.open).start()
    store.close()
    assert handle.ready and parts["fake"].live_streams() == []


def test_overlap_needs_an_async_runtime():
    class SyncOnly:
        device_kind = "cuda"

        def register(self, mappings): ...

        def unregister(self, mappings): ...

    with pytest.raises(ConfigError, match="store.overlap"):
        PlanTierStore(segment_bytes=1 << 20, transfer=SyncOnly(), overlap=True)


def test_warm_up_stage_timers_in_stats(make_store):
    store, parts = make_store("fake_cuda")
    s = store.stats
    (seg,) = parts["client"].wait_local_segments_ready()
    assert s.warmup_seconds >= s.segment_ready_seconds > 0 and s.register_seconds > 0
    assert s.fault_method in ("madvise", "touch") and s.fault_threads >= 1 and s.fault_seconds > 0
    (m,) = s.mappings
    assert (m["ptr"], m["length"]) == (seg.ptr, seg.length) and m["register_seconds"] > 0
    d = s.as_dict()
    assert d["mappings"][0]["length"] == seg.length and "transfer_d2h_bytes" in d


def test_staging_preallocated_at_warm_up(make_store):
    store, _ = make_store("fake_cuda", overlap=True, staging_slots=2, staging_slot_bytes=1 << 20)
    assert store.stats.staging_bytes == 2 * (2 << 20)


def test_hugepages_on_a_private_segment():
    store = PlanTierStore(segment_bytes=8 << 20, backing="private", hugepages=True, device="cpu")
    s = store.stats
    assert s.huge_page_bytes >= 0  # how much the kernel granted depends on THP settings
    store.close()


def test_split_cuts_copies_into_pieces_that_cover_every_byte():
    import numpy as np

    from cacheseek.stores.plan_tier.capacity import split
    from cacheseek.transfer.batch import CopyBatch

    batch = CopyBatch.of([1000, 5000, 9000], [100000, 200000, 300000], [300, 50, 700], Direction.D2H)
    pieces = split(batch, 256)
    covered = [(int(d), int(s), int(n)) for p in pieces for d, s, n in zip(p.dsts, p.srcs, p.sizes)]
    assert sum(n for _, _, n in covered) == batch.nbytes and all(p.nbytes <= 2 * 256 for p in pieces)
    assert covered[0] == (1000, 100000, 256) and covered[1] == (1256, 100256, 44)
    assert sorted(covered) == covered and len(pieces) > 3
    assert split(batch, 0) == [batch] and split(batch, 1 << 20) == [batch]
    assert all(np.all(p.codes == Direction.D2H.code) for p in pieces)


def test_pieces_trickle_at_most_n_in_flight_and_land_intact(make_store):
    store, parts = make_store("fake_cuda", overlap=True, write_piece_bytes=64, write_pieces_in_flight=2)
    fake = parts["fake"]
    gate = Gate(fake)
    payload, _ = ring_tail_payload(n_layers=3, tokens=4)  # 6 values of 128 B: 12 pieces of 64 B
    want = [(as_bytes(k), as_bytes(v)) for k, v in payload]
    before = len(fake.calls_named("cudaMemcpyBatchAsync"))
    handle = store.put_async("tp:kv", payload, tier=TIER)
    overwrite(payload)
    time.sleep(0.1)
    submitted = fake.calls_named("cudaMemcpyBatchAsync")[before:]
    assert len(submitted) == 1 + 2  # the snapshot, then two pieces: the rest waits for them
    assert not handle.ready
    gate.open()
    store.flush()
    assert handle.ready and [store.get_layer(handle, i) for i in range(3)] == want
    assert store.stats.write_pieces == 12 and fake.live_events() == parts["runtime"].idle_events


@pytest.mark.parametrize("bad", [0, -0.001, 2.0, True, "1ms"])
def test_a_write_poll_outside_0_to_1_s_is_one_error_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"store\.write_poll_s.*must be seconds in \(0, 1\]"):
        PlanTierStore(segment_bytes=1 << 20, device="cpu", write_poll_s=bad)


def test_pieces_polled_coarsely_land_intact(make_store):
    store, parts = make_store("fake_cuda", overlap=True, write_piece_bytes=64, write_poll_s=0.01)
    payload, _ = ring_tail_payload(n_layers=3, tokens=4)
    want = [(as_bytes(k), as_bytes(v)) for k, v in payload]
    handle = store.put_async("coarse:kv", payload, tier=TIER)
    overwrite(payload)
    store.flush()
    assert handle.ready and [store.get_layer(handle, i) for i in range(3)] == want
    assert store.stats.write_pieces == 12 and parts["fake"].live_events() == parts["runtime"].idle_events


def test_a_piece_that_fails_on_the_completion_thread_rolls_back(make_store):
    store, parts = make_store("fake_cuda", overlap=True, write_piece_bytes=64)
    fake = parts["fake"]
    fake.fail("cudaMemcpyBatchAsync", cudaError_t.cudaErrorInvalidValue, nth=3)  # snapshot, piece 1, piece 2
    handle = store.put_async("pf:kv", ring_tail_payload(tokens=4)[0], tier=TIER)
    store.flush()
    assert isinstance(handle.error, StoreError) and "cudaMemcpyBatchAsync" in str(handle.error)
    assert fake.pending() == 0 and fake.live_events() == parts["runtime"].idle_events
    assert parts["client"].live_handles() == (0, 0) and parts["client"].usage().used_bytes == 0
    s = store.stats
    assert s.put_failures == 1 and s.plans_aborted == 1 and s.inflight_bytes == 0


# -- bounded waits (issue 12 item 7) ------------------------------------------------------------


def test_flush_is_bounded_and_close_leaves_a_live_worker_its_resources(make_store):
    from cacheseek.errors import StoreTimeoutError

    store, parts = make_store("fake_cuda", overlap=True, commit_timeout_s=0.3)
    gate = Gate(parts["fake"])
    handle = store.put_async("bw:kv", ring_tail_payload()[0], tier=TIER)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="1 writes still pending"):
        store.flush(timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    streams = list(parts["fake"].live_streams())
    registered = parts["transfer"].registered()
    with pytest.raises(StoreTimeoutError):
        store.close()  # the write is stuck: the completion thread cannot stop
    assert parts["fake"].live_streams() == streams and parts["transfer"].registered() == registered
    gate.open()  # the copy lands: the worker ends on its own, on resources still in place
    store.completion_thread.join(10)
    assert not store.completion_thread.is_alive()


def test_pending_batch_wait_is_bounded_and_stays_pending():
    from cacheseek.errors import TransferTimeoutError
    from cacheseek.transfer.batch import CopyBatch
    from cacheseek.transfer.host_transfer import HostTransferRuntime
    from cacheseek.transfer.pending import PendingBatch

    class Unlanded(HostTransferRuntime):
        """Its copies do not land until told (the event hook a runtime's backend supplies)."""

        landed = False

        def _event_query(self, event):
            return self.landed

    runtime = Unlanded()
    event = runtime.record_event(None)
    pending = PendingBatch(runtime, CopyBatch.of([], [], [], Direction.H2D), None, event, time.perf_counter())
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="not landed after 0.05 s"):
        pending.wait(timeout_s=0.05)
    assert time.monotonic() - t0 < 1.0 and not pending.done()
    runtime.wait_timeout_s = 0.02
    with pytest.raises(TransferTimeoutError):
        pending.wait()  # the runtime's default bound
    runtime.landed = True
    pending.wait()  # a later wait succeeds
    assert pending.done() and pending.seconds is not None
    runtime.close()
