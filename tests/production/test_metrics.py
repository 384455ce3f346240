"""Issue 5 item 4: one stats object (`CacheMetrics`, attrs, ``as_dict()``) owned by the manager
(shared by the stack's managers), with hits, misses and partial hits by depth, bytes and seconds
per direction, registration seconds, store usage (used/capacity/peak), evictions,
invalidations, dropped/failed/pending writes; shown in the CLI report after the request table
and written to ``results.json`` under ``"metrics"`` (``"store_stats"`` kept)."""

from __future__ import annotations

import json
import threading

import attrs
import pytest

from cacheseek.cli import run
from cacheseek.metrics import CacheMetrics
from cacheseek.report import metrics_block
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.stores.memory import InMemoryTierStore

from prodkit import ACTS, FULL, N, acts, chain, new_manager, run_session

KV_CHUNK = 384  # tiny geometry: 2 layers x K,V x 96 B
LATENT = 192

KEYS = {
    "lookups", "misses", "below_break_even", "hits", "full_hits", "partial_hits", "hits_by_depth",
    "partial_hits_by_depth", "hit_rate", "restores", "restore_bytes", "restore_seconds", "restore_retries",
    "restore_failures", "writes", "write_bytes", "write_seconds", "reingest_kept", "dropped_writes",
    "store_full_retries", "failed_writes", "pending_writes", "evictions", "evicted_bytes",
    "eviction_passes", "eviction_errors", "demotions", "demoted_bytes", "demotion_passes", "demotion_errors",
    "evictions_for_demotion", "demotion_no_room",
    "skeletons_freed", "invalidations", "hook_failures", "hook_failures_by_hook", "registration_seconds",
    "sessions_bypassed_warming", "action_key_errors", "chunks_unkeyed",
    "live_lookups", "live_hits", "live_hits_by_chunk", "live_misses", "live_restore_failures",
    "store_used_bytes", "store_capacity_bytes", "store_peak_bytes", "peak_used_bytes",
    "index_probes", "index_keys_probed", "index_adopted", "index_published", "index_recheck_misses",
    "index_claims", "index_waits", "index_wait_adopted", "index_wait_seconds",
    # issue 34: the parts of lookups and hits, per tier and per hook/error, the histograms, the store's label
    "prefix_lookups", "live_not_cached", "chunks_restored", "hits_by_tier", "hook_failures_by_error",
    "histograms", "store",
    "frames_handed_out", "frames_read_bytes", "frames_missing", "frames_corrupt", "frames_written",
    "frames_write_bytes", "frames_dropped", "materializations", "chunks_materialized", "decoder_replays",
    "recomputed_chunks", "decoder_states_written", "decoder_state_write_bytes", "decoder_states_dropped",
    "decoder_states_restored", "decoder_state_read_bytes", "decoder_states_missing", "decoder_states_corrupt",
    "encodes_loaded", "encodes_missing", "encodes_corrupt", "encodes_written", "encodes_dropped",
}  # and "records" where the store's chunk records are shared (the memory and LocalDisk tiers)


def test_metrics_of_a_known_sequence_of_sessions():
    store = InMemoryTierStore(capacity_bytes=100_000)
    mgr = new_manager(store, FULL)
    run_session(mgr)                                         # miss, writes 5 chunks
    nodes = chain(mgr.forest)
    run_session(mgr)                                         # full hit K=5
    run_session(mgr, actions=ACTS[:3] + acts(variant=9)[3:])  # partial hit K=3, writes 2
    store.backend.delete(layer_keys(nodes[1].blob.locator, 0)[0])
    run_session(mgr, ingest=False)                           # node 1 stale: K=1 after a retry
    mgr.evict_blob(nodes[4])

    m = mgr.metrics.as_dict()
    assert set(m) - {"records"} == KEYS
    assert (m["lookups"], m["misses"], m["hits"], m["full_hits"], m["partial_hits"]) == (4, 1, 3, 1, 2)
    assert m["hits_by_depth"] == {1: 1, 3: 1, 5: 1} and m["partial_hits_by_depth"] == {1: 1, 3: 1}
    assert m["hit_rate"] == 0.75
    assert (m["writes"], m["write_bytes"]) == (7, 7 * KV_CHUNK) and m["write_seconds"] > 0
    assert m["restores"] == 3 and m["restore_seconds"] > 0 and m["restore_bytes"] > 0
    assert (m["restore_retries"], m["invalidations"], m["evictions"], m["evicted_bytes"]) == (1, 1, 1, KV_CHUNK)
    assert m["reingest_kept"] == 0  # sessions resume past their cached chunks: nothing re-ingested
    assert (m["dropped_writes"], m["failed_writes"], m["pending_writes"]) == (0, 0, 0)
    used = store.usage().used_bytes
    assert m["store_used_bytes"] == used and m["store_capacity_bytes"] == 100_000
    assert m["store_peak_bytes"] == 7 * (KV_CHUNK + LATENT) >= used
    assert m["registration_seconds"] == 0.0  # a generic tier registers nothing


def test_one_object_shared_by_managers_and_safe_across_threads():
    metrics = CacheMetrics()
    store = InMemoryTierStore()
    mgrs = [new_manager(store, FULL, metrics=metrics) for _ in range(2)]
    assert all(m.metrics is metrics for m in mgrs)

    def work():
        for _ in range(2000):
            metrics.add(prefix_lookups=1)
            metrics.record_transfer("restore", None, 3, 0.001)
            metrics.record_hit(2, 5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = metrics.as_dict()
    assert (d["lookups"], d["restore_bytes"], d["hits"], d["partial_hits_by_depth"]) == (8000, 24000, 8000, {2: 8000})
    assert attrs.has(CacheMetrics)


def test_usage_timeline_is_kept_on_request():
    store = InMemoryTierStore(capacity_bytes=4 * (KV_CHUNK + LATENT))
    mgr = new_manager(store, FULL)
    run_session(mgr)
    d = mgr.metrics.as_dict(timeline=True)
    assert "timeline" not in mgr.metrics.as_dict()
    samples = d["timeline"]
    assert [s[3] for s in samples].count("write") == N and "evict" in [s[3] for s in samples]
    assert all(s[2] == store.capacity_bytes and s[1] <= s[2] for s in samples)
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)


def test_report_block_renders_every_group():
    store = InMemoryTierStore(capacity_bytes=4 * (KV_CHUNK + LATENT))
    mgr = new_manager(store, FULL)
    run_session(mgr)
    run_session(mgr, ingest=False)
    text = metrics_block(mgr.metrics.as_dict())
    for word in ("lookups", "hits by depth", "restore:", "write:", "registration", "store:", "peak",
                 "evictions", "invalidations", "dropped", "failed", "pending"):
        assert word in text, word
    assert len(text.splitlines()) <= 6


@pytest.mark.parametrize("store", ["memory", "fluxon_plan"])
def test_cli_task_prints_the_block_and_writes_metrics(compose_cfg, tmp_path, capsys, store):
    overrides = [] if store == "memory" else ["+store=fluxon_plan", "store.segment_bytes=1048576"]
    results = run(compose_cfg(*overrides), tmp_path)
    out = capsys.readouterr().out
    lines = out.splitlines()
    table_end = max(i for i, line in enumerate(lines) if line.startswith("D "))
    assert lines[table_end + 1].startswith("metrics:")
    saved = json.loads((tmp_path / "results.json").read_text())
    m = saved["metrics"]
    assert set(m) - {"records"} == KEYS and "store_stats" in saved and saved["passed"]
    assert m["hits_by_depth"] == {"2": 2, "4": 1, "1": 1, "3": 1}  # B, C and the ring check
    # B is served from frames (no restore); C restores its prefix at its divergence, the ring check at each depth
    assert m["lookups"] == 7 and m["writes"] == 6 and m["restores"] == 4
    assert m["frames_handed_out"] == 4 + 2 and m["materializations"] == 4 and m["frames_written"] == 6
    if store == "fluxon_plan":
        assert m["store_capacity_bytes"] == 1048576 and m["registration_seconds"] >= 0
        assert m["store_used_bytes"] > 0 and saved["store_stats"]["puts"] == 6
    else:
        assert m["store_capacity_bytes"] is None and m["store_used_bytes"] > 0
    assert results["metrics"]["lookups"] == 7
