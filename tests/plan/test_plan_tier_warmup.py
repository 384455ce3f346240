"""The Plan tier's background warm-up (issue 14): the store returns before its segment is ready,
serves every read as a miss and refuses every write until then, then behaves as a store warmed in
the foreground; a failed warm-up leaves a store that refuses writes and says why; close() never
tears down under the warm-up."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cacheseek.errors import ConfigError, StoreWarmingError
from cacheseek.kv.handles import BlobHandle, Skeleton, Tier
from cacheseek.kv.ring import RingGeometry
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.reuse.exact_prefix.types import TrieNode
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime
from plan_testkit import ingest, restore_target

GEOM = RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=7, sink_size=3)


def test_a_warming_store_serves_misses_and_drops_writes_then_serves_everything(gated):
    store, client = gated()
    store.session_starting().release()  # the first session's start-up came and went: the warm-up goes on
    assert client.asked.wait(5) and not store.ready  # the constructor returned while the segment waits
    with pytest.raises(StoreWarmingError, match="still warming up"):
        ingest(store, GEOM, 1)
    target = restore_target(GEOM, 1, 7 * 2)
    node = TrieNode(b"\x01" * 32, b"a", 0, None, skeleton=Skeleton("01" * 32 + ":lat"),
                    blob=BlobHandle(Tier.FLUXON_DRAM, "01" * 32 + ":kv", 2 * 2 * 14 * 32, 2, ready=True))
    assert store.read_path([node], [node], target) is False
    assert store.contains(["x", "y"]) == [False, False] and store.get_skeleton("x", nbytes=4) is None
    assert store.usage() is None
    stats = store.stats
    assert (stats.warmup, stats.ready, stats.reads_while_warming, stats.writes_while_warming) == ("background", False, 1, 1)
    assert stats.read_misses == 1 and stats.puts == 0

    client.gate.set()
    assert store.wait_ready(5) and store.ready
    nodes, states, latents, kv_size = ingest(store, GEOM, 5)
    target = restore_target(GEOM, 5, kv_size)
    assert store.read_path(nodes, [nodes[d] for d in GEOM.window_depths(5)], target)
    ring, local_end, _ = states[-1]
    assert all(torch.equal(a[:, :local_end], b[:, :local_end]) for pa, pb in zip(target.kv, ring) for a, b in zip(pa, pb))
    assert store.stats.ready and store.stats.warmup_error is None


def test_a_failed_background_warm_up_refuses_writes_naming_the_cause(gated):
    store, client = gated(fail=True)
    client.gate.set()
    assert store.wait_ready(5) is False
    with pytest.raises(StoreWarmingError, match="warm-up failed: .*Cannot allocate memory"):
        store.put_skeleton("k:lat", torch.zeros(4))
    assert "Cannot allocate memory" in store.stats.warmup_error


def test_close_waits_for_the_warm_up_before_tearing_down(gated):
    store, client = gated()
    store.session_starting().release()
    assert client.asked.wait(5)
    threading.Timer(0.3, client.gate.set).start()
    t0 = time.perf_counter()
    store.close()
    assert time.perf_counter() - t0 >= 0.25 and store.ready  # it waited, then tore a ready store down


def test_a_foreground_store_is_ready_when_built_and_an_unknown_mode_is_refused():
    client = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1)
    try:
        store = PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False)
        assert store.ready and store.stats.warmup == "foreground" and store.stats.ready
        store.close()
        with pytest.raises(ConfigError, match="store.warmup"):
            PlanTierStore(plan_client=client, transfer=HostTransferRuntime(), overlap=False, warmup="lazy")
    finally:
        client.close()
