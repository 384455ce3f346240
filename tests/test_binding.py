"""The runtime binding end to end (real binding + synthetic runtime + in-memory and LocalDisk
tiers): every "fix what the first version got wrong" item of issue 2.

- a failed restore (store error, corrupt file, wrong layout) publishes nothing and the session
  runs cold, D-equivalent; values gone from the store (missing latent, partial layer) invalidate
  the stale node and restore the longest whole prefix (issue 5);
- re-ingesting an existing ready (or in-flight) node never replaces its blob;
- the namespace root covers every field that changes the bits (a change is a cold miss);
- ``evict_blob`` refuses a blob whose write has not completed;
- the hooks work from a thread with a running event loop;
- the rolling geometry is validated with errors naming the field;
- generic tiers get owned CPU snapshots, never views of the ring;
- a saved forest snapshot lets a new manager hit every chunk.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from cacheseek.kv.ring import RingGeometry
from cacheseek import namespace
from cacheseek.errors import CorruptValueError, GeometryError, StoreError, WriteNotCompleteError
from cacheseek.layout.bshd import BshdLayout
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.reuse.exact_prefix.trie import load_forest_snapshot, save_forest_snapshot
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier
from cacheseek.runtime.geometry import Geometry
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory, SyntheticWorldRuntime, snapshot_diff
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

WAIT_S = 10.0
N = 5  # chunks per session: with L=7, S=3, c=3 the ring rolls at chunk 3
FULL = (-1, 0)
ROLLING = (7, 3)
MODES = [FULL, ROLLING]
MODE_IDS = ["full", "L7S3"]
TIERS = ["memory", "localdisk"]


def acts(n: int = N, *, variant: int = 0) -> list[list[float]]:
    return [[0.1 * i + variant, -0.05 * i, 0.02 * variant, 0.3 * (i % 2)] for i in range(n)]


ACTS = acts()


def make_store(tier: str, tmp_path: Path, **kw):
    if tier == "memory":
        return InMemoryTierStore()
    return LocalDiskTierStore(str(tmp_path / "kv"), **kw)


@pytest.fixture(params=TIERS)
def store(request, tmp_path):
    s = make_store(request.param, tmp_path)
    yield s
    s.close()


@pytest.fixture(params=MODES, ids=MODE_IDS)
def mode(request):
    return request.param


def factory(mode=FULL, **kw) -> SyntheticRuntimeFactory:
    """Sessions with the eager creation-time restore (``handout=False``): what TeleFuser main and
    a session's materialization at divergence run; tests/test_handout.py covers the frames."""
    kw.setdefault("handout", False)
    return SyntheticRuntimeFactory(geometry="tiny", local_attn_size=mode[0], sink_size=mode[1], **kw)


def manager_cfg(mode=FULL, break_even_k: int = 1):
    if mode[0] == -1:
        return make_full_kv_config(break_even_k=break_even_k)
    return make_rolling_config(local_attn_size=mode[0], sink_size=mode[1], chunk_size=3,
                               break_even_k=break_even_k)


def binding_for(store, forest, mode=FULL, *, cfg=None, ingest=True, shared_index=True, **kw) -> LingBotWorldKVBinding:
    mgr = WorldKVManager(forest, store, cfg if cfg is not None else manager_cfg(mode),
                         shared_index={"enabled": shared_index})
    return LingBotWorldKVBinding(mgr, forest, ingest_enabled=ingest, **kw)


def run_session(store, forest, mode=FULL, actions=ACTS, *, fac=None, ingest=True, **kw):
    """One full session; returns (binding, runtime, frame hashes)."""
    b = binding_for(store, forest, mode, ingest=ingest, **kw)
    rt = (fac or factory(mode)).make(actions, hooks=b)
    hashes = rt.generate()
    store.flush()
    return b, rt, hashes


def cold_hashes(mode=FULL, actions=ACTS, fac=None) -> list[bytes]:
    return (fac or factory(mode)).make(actions, hooks=None).generate()


def trie_state(forest: NamespaceForest) -> dict:
    """Everything about the trie a failed restore must not change (node and blob identity too)."""
    out = {"n_namespaces": len(forest)}
    for ns in forest.namespaces():
        for n in ns.iter_nodes():
            out[id(n)] = (
                ns.root_hash, n.node_key, n.depth, id(n.parent), id(n.blob),
                None if n.blob is None else (n.blob.ready, n.blob.locator, n.blob.nbytes,
                                             n.blob.n_layers, n.blob.error),
                n.skeleton, n.ref_count, n.pinned, n.last_access, tuple(sorted(n.children)),
            )
    return out


def nodes_by_depth(forest: NamespaceForest) -> dict[int, object]:
    (ns,) = forest.namespaces()
    out = {}
    for n in ns.iter_nodes():
        assert n.depth not in out, "one chain expected"
        out[n.depth] = n
    return out


def stored_bytes(store, key: str) -> bytes:
    if key.endswith(":rec"):  # a chunk record: its own bytes
        return store.disk.read_raw(key)
    v = store.backend.read(key)
    assert v is not None, key
    return v.contiguous().view(torch.uint8).numpy().tobytes()


def all_values(store) -> dict[str, bytes]:
    keys = store.keys()
    return {k: stored_bytes(store, k) for k in keys}


# -- a failed restore publishes nothing -----------------------------------------------------------


def _delete_latent(store, nodes):
    store.backend.delete(nodes[1].skeleton.latent_locator)  # a non-window node in rolling mode


def _delete_v_of_layer1(store, nodes):  # K without V
    store.backend.delete(layer_keys(nodes[N - 1].blob.locator, 1)[1])


def _delete_k_of_layer0(store, nodes):  # V without K
    store.backend.delete(layer_keys(nodes[N - 1].blob.locator, 0)[0])


def _get_layer_error(store, nodes):
    calls = {"n": 0}
    real = store.get_layer

    def get_layer(handle, layer):
        calls["n"] += 1
        if calls["n"] == 4:  # after some layers were fetched successfully
            raise StoreError("injected get_layer failure")
        return real(handle, layer)

    store.get_layer = get_layer


def _get_skeleton_error(store, nodes):
    calls = {"n": 0}
    real = store.get_skeleton

    def get_skeleton(locator):
        calls["n"] += 1
        if calls["n"] == N:  # the last latent of the path
            raise StoreError("injected get_skeleton failure")
        return real(locator)

    store.get_skeleton = get_skeleton


def _wrong_layout_layer1(store, nodes):
    """A stored value of the wrong dtype in layer 1: layer 0 is checked and copied first."""
    key = layer_keys(nodes[N - 1].blob.locator, 1)[0]
    v = store.backend.read(key)
    store.backend.write(key, v.to(torch.float32))


FAILURES = {
    "store_error_get_layer": _get_layer_error,
    "store_error_get_skeleton": _get_skeleton_error,
}
# Values gone from the store (issue 5 item 2): the stale node is invalidated and the restore
# retries the longest whole prefix; value = (the stale node's depth, the depth restored instead).
MISSING = {
    "missing_latent": (_delete_latent, 1, 1),
    "partial_layer_k_without_v": (_delete_v_of_layer1, N - 1, N - 1),
    "partial_layer_v_without_k": (_delete_k_of_layer0, N - 1, N - 1),
    # A value that does not fit the ring (issue 23, item 2): that chunk is dropped like a missing one,
    # so later sessions do not fail on it again.
    "wrong_layout": (_wrong_layout_layer1, N - 1, N - 1),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_failed_restore_publishes_nothing_and_runs_cold(store, mode, failure):
    forest = NamespaceForest()
    _, _, hashes_a = run_session(store, forest, mode)
    cold = cold_hashes(mode)
    assert hashes_a == cold
    FAILURES[failure](store, nodes_by_depth(forest))
    before = trie_state(forest)
    values_before = store.keys()

    b = binding_for(store, forest, mode)
    rt = factory(mode).make(ACTS, hooks=b)
    fresh = factory(mode).make(ACTS, hooks=None)
    assert rt.generate(stop_after=0) == []

    assert b.last_fast_forward == 0 and b.bytes_restored == 0
    assert rt.world_kv_cached_latents == {}
    for layer in rt.self_kv_cache:
        assert layer["global_end_index"] == 0 and layer["local_end_index"] == 0
    assert snapshot_diff(rt.state_snapshot(), fresh.state_snapshot()) == []
    assert torch.equal(rt.generator.get_state(), fresh.generator.get_state())
    for mine, ref in zip(rt.self_kv_cache, fresh.self_kv_cache):  # nothing was copied at all
        assert torch.equal(mine["k"], ref["k"]) and torch.equal(mine["v"], ref["v"])
    assert trie_state(forest) == before
    assert all(n.ref_count == 0 for ns in forest.namespaces() for n in ns.iter_nodes())
    assert b.manager.metrics.restore_failures == 1 and b.manager.metrics.hits == 0

    # The session then runs cold and is D-equivalent; its re-ingests keep the ready blobs.
    assert rt.generate() == cold
    assert rt.restored_chunks == []
    store.flush()
    assert trie_state(forest) == before
    assert store.keys() == values_before


@pytest.mark.parametrize("failure", sorted(MISSING))
def test_missing_values_invalidate_and_restore_the_longest_whole_prefix(store, mode, failure):
    forest = NamespaceForest()
    run_session(store, forest, mode)
    cold = cold_hashes(mode)
    damage, stale_depth, expect_k = MISSING[failure]
    nodes = nodes_by_depth(forest)
    damage(store, nodes)
    stale = nodes[stale_depth]

    b = binding_for(store, forest, mode)
    rt = factory(mode).make(ACTS, hooks=b)
    rt.generate(stop_after=0)
    assert b.last_fast_forward == expect_k
    assert b.manager.metrics.invalidations == 1 and b.manager.metrics.restore_failures == 0
    assert stale.blob is None  # invalidated: its remaining KV values were freed
    assert all(n.ref_count == 0 for ns in forest.namespaces() for n in ns.iter_nodes())
    # The session resumes at K, recomputes the rest (bit-identical to cold) and re-ingests the
    # stale chunk, skeleton included; the deeper nodes keep their blobs.
    assert rt.generate() == cold
    assert rt.restored_chunks == list(range(expect_k))
    store.flush()
    assert stale.has_kv and store.get_skeleton(stale.skeleton.latent_locator) is not None
    b2, rt2, hashes = run_session(store, forest, mode, ingest=False)
    assert b2.last_fast_forward == N and hashes == cold


def test_corrupt_value_file_is_a_miss_and_its_node_is_invalidated(tmp_path):
    """A truncated LocalDisk value file is a corrupt value (issue 12): the backend names it, the
    tier reads it as missing and removes it, the manager invalidates its node and restores the
    longest whole prefix before it; frames equal a cold run's."""
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        forest = NamespaceForest()
        run_session(store, forest)
        nodes = nodes_by_depth(forest)
        key = layer_keys(nodes[2].blob.locator, 1)[0]
        path = store.disk.path_of(key)
        data = path.read_bytes()
        path.write_bytes(data[:-3])
        with pytest.raises(CorruptValueError):
            store.disk.read(key)
        b, rt, hashes = run_session(store, forest, ingest=False)
        assert b.last_fast_forward == 2 and rt.restored_chunks == [0, 1]
        assert hashes == cold_hashes()
        assert nodes[2].blob is None and not path.exists() and store.stats.corrupt_values == 1
    finally:
        store.close()


def test_store_raising_corrupt_kv_value_invalidates_the_node_that_named_it():
    """A store may raise `CorruptValueError` on read instead of returning a miss: the manager
    finds the window node whose KV the key names, invalidates it and restores the prefix before."""

    class RaisingTier(InMemoryTierStore):
        bad_key = ""

        def get_layer(self, handle, layer):
            if self.bad_key in (layer_keys(handle.locator, layer)):
                raise CorruptValueError(self.bad_key, "checksum mismatch")
            return super().get_layer(handle, layer)

    store = RaisingTier()
    forest = NamespaceForest()
    run_session(store, forest)
    nodes = nodes_by_depth(forest)
    store.bad_key = layer_keys(nodes[2].blob.locator, 1)[1]
    b, rt, hashes = run_session(store, forest, ingest=False)
    assert b.last_fast_forward == 2 and rt.restored_chunks == [0, 1]
    assert hashes == cold_hashes()
    assert nodes[2].blob is None and nodes[1].has_kv


def test_partial_window_only_layer_missing_is_a_miss_on_every_depth(store):
    """A prefix whose node lacks one layer's V is a miss for that node, not a crash: every depth
    that needs it restores the longest prefix before it; a shorter prefix still hits."""
    forest = NamespaceForest()
    run_session(store, forest)
    nodes = nodes_by_depth(forest)
    store.backend.delete(layer_keys(nodes[2].blob.locator, 1)[1])
    for k in (1, 2, 3, N):
        b = binding_for(store, forest, ingest=False)
        rt = factory().make(ACTS[:k] + acts(N, variant=5)[k:], hooks=b)
        rt.generate(stop_after=0)
        # depth >= 3 needs node 2: it is invalidated, the restore retries depth 2 (issue 5 item 2)
        assert b.last_fast_forward == min(k, 2), k
    assert nodes[2].blob is None


# -- re-ingest never replaces a ready blob --------------------------------------------------------


def test_reingest_through_binding_keeps_ready_blobs(store, mode):
    forest = NamespaceForest()
    run_session(store, forest, mode)
    nodes = nodes_by_depth(forest)
    blobs = {d: n.blob for d, n in nodes.items()}
    values = all_values(store)
    puts = store.stats.puts
    before = trie_state(forest)

    # The manager sees every node ready but the hit is below break-even: the session runs cold
    # and re-ingests every chunk.
    b = binding_for(store, forest, mode, cfg=manager_cfg(mode, break_even_k=N + 1))
    rt = factory(mode).make(ACTS, hooks=b)
    assert rt.generate() == cold_hashes(mode)
    store.flush()
    assert b.last_fast_forward == 0
    assert b.manager.metrics.reingest_kept == N and b.manager.metrics.writes == 0
    for d, n in nodes_by_depth(forest).items():
        assert n.blob is blobs[d] and n.blob.ready
    assert trie_state(forest) == before
    assert store.stats.puts == puts
    assert all_values(store) == values


def test_reingest_reports_no_bytes_written(store):
    """A kept re-ingest writes nothing, so the binding must not count it as bytes written."""
    forest = NamespaceForest()
    run_session(store, forest)
    b = binding_for(store, forest, cfg=manager_cfg(FULL, break_even_k=N + 1))
    factory().make(ACTS, hooks=b).generate()
    assert b.manager.metrics.reingest_kept == N
    assert b.bytes_written == 0


def test_reingest_directly_keeps_ready_and_in_flight_blobs(store):
    forest = NamespaceForest()
    b, _, _ = run_session(store, forest)
    mgr = b.manager
    nodes = nodes_by_depth(forest)
    node = nodes[1]
    ready = node.blob
    values = all_values(store)
    other = [(torch.ones(1, 6, 2, 4, dtype=torch.bfloat16), torch.ones(1, 6, 2, 4, dtype=torch.bfloat16))] * 2
    lat = torch.ones(1, 4, 3, 2, 4, dtype=torch.bfloat16)
    again = mgr.ingest(forest.resolve(b.root), nodes[0], node.action, node.node_key, 1, other, lat)
    store.flush()
    assert again is node and node.blob is ready and node.blob.ready
    assert all_values(store) == values

    # An in-flight (pending) handle is not replaced either.
    pending = BlobHandle(Tier.CPU, ready.locator, ready.nbytes, ready.n_layers, ready=False)
    node.blob = pending
    mgr.ingest(forest.resolve(b.root), nodes[0], node.action, node.node_key, 1, other, lat)
    assert node.blob is pending and all_values(store) == values

    # A failed handle is replaced by a fresh write (the chunk becomes cacheable again).
    failed = BlobHandle(Tier.CPU, ready.locator, ready.nbytes, ready.n_layers, ready=False,
                        error=StoreError("earlier write failed"))
    node.blob = failed
    mgr.ingest(forest.resolve(b.root), nodes[0], node.action, node.node_key, 1, other, lat)
    store.flush()
    assert node.blob is not failed and node.blob.ready


# -- the namespace root covers everything that changes the bits -----------------------------------


class OtherFormatLayout(BshdLayout):
    storage_format = "cacheseek.kv.bshd.v2-test"


OTHER_LATENT = Geometry("tiny_wide", n_layers=2, n_heads=2, head_dim=4, latent_channels=4,
                        latent_h=2, latent_w=8, chunk_size=3)


def _variant(name):
    """(mode, factory kwargs, binding kwargs, runtime builder or None)."""
    return {
        "seed": (ROLLING, {"seed": 99}, {}, None),
        "attention_window_L": ((8, 3), {}, {}, None),
        "attention_window_S": ((7, 0), {}, {}, None),
        "full_length": (FULL, {}, {}, None),
        "num_steps": (ROLLING, {"num_steps": 3}, {}, None),
        "dtype_float32": (ROLLING, {"dtype": "float32"}, {}, None),
        "model_fingerprint": (ROLLING, {}, {"model_fingerprint": b"another-model"}, None),
        "weights_compute": (ROLLING, {"compute_gemm_dim": 8}, {}, None),
        "weights_attribute": (ROLLING, {}, {}, "weights"),
        "storage_format": (ROLLING, {}, {"layout": OtherFormatLayout()}, None),
        "latent_size": (ROLLING, {}, {}, "geometry"),
        "prompt": (ROLLING, {"prompt": "a blue boat"}, {}, None),
    }[name]


VARIANTS = ["seed", "attention_window_L", "attention_window_S", "full_length", "num_steps",
            "dtype_float32", "model_fingerprint", "weights_compute", "weights_attribute",
            "storage_format", "latent_size", "prompt"]


def _make_variant_runtime(kind, mode, fac, hooks):
    if kind == "geometry":
        return SyntheticWorldRuntime(OTHER_LATENT, actions=ACTS, local_attn_size=mode[0],
                                     sink_size=mode[1], hooks=hooks, prompt=fac.prompt,
                                     seed=fac.seed, num_steps=fac.num_steps, dtype=fac.dtype)
    rt = fac.make(ACTS, hooks=hooks)
    if kind == "weights":
        rt.weights_fingerprint = bytes(32)  # a runtime whose weights differ
    return rt


def test_base_config_hits_itself(store):
    """Control for the variants below: the unchanged config hits every chunk."""
    forest = NamespaceForest()
    a, _, hashes = run_session(store, forest, ROLLING)
    b, _, hashes_b = run_session(store, forest, ROLLING, ingest=False)
    assert b.root == a.root and b.last_fast_forward == N and hashes_b == hashes


@pytest.mark.parametrize("variant", VARIANTS)
def test_namespace_root_covers(store, variant):
    forest = NamespaceForest()
    base, _, _ = run_session(store, forest, ROLLING)
    mode, fac_kw, bind_kw, kind = _variant(variant)
    fac = factory(mode, **fac_kw)
    b = binding_for(store, forest, mode, ingest=False, **bind_kw)
    rt = _make_variant_runtime(kind, mode, fac, b)
    hashes = rt.generate()
    assert b.root is not None and b.root != base.root
    assert b.last_fast_forward == 0 and rt.restored_chunks == []
    assert b.manager.metrics.misses == 1
    # The variant's own outputs come from a cold run (nothing reinterpreted).
    ref = _make_variant_runtime(kind, mode, fac, None)
    assert hashes == ref.generate()


def test_weights_fingerprint_is_real():
    """The runtime's fingerprint is of its weights: extra weights change it, the session does not."""
    a = factory(ROLLING).make(ACTS)
    b = factory(ROLLING, compute_gemm_dim=8).make(ACTS)
    c = factory(FULL, seed=5).make(acts(2))
    assert a.weights_fingerprint != b.weights_fingerprint
    assert a.weights_fingerprint == c.weights_fingerprint


# -- evict_blob refuses an incomplete write -------------------------------------------------------


class BlockingBackend:
    """Blocks KV value writes until ``release`` is set (latents pass through)."""

    def __init__(self, inner):
        self.inner = inner
        self.release = threading.Event()
        self.blocked = threading.Event()

    def write(self, key, value):
        if ":kv:" in key:
            self.blocked.set()
            if not self.release.wait(WAIT_S):
                raise TimeoutError("test gate never released")
        self.inner.write(key, value)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_evict_refuses_blob_whose_write_is_in_flight(tmp_path):
    store = LocalDiskTierStore(str(tmp_path / "kv"), write_back=True, queue_depth=8)
    gate = BlockingBackend(store.backend)
    store.backend = gate
    try:
        forest = NamespaceForest()
        b = binding_for(store, forest)
        rt = factory().make(ACTS, hooks=b)
        rt.generate(stop_after=2)
        assert gate.blocked.wait(WAIT_S)
        nodes = nodes_by_depth(forest)
        node = nodes[0]
        handle = node.blob
        assert handle is not None and handle.in_flight and not node.has_kv
        assert not node.pinned and node.ref_count == 0
        assert b.manager.evict_blob(node) is False
        assert node.blob is handle and b.manager.metrics.evictions == 0
        with pytest.raises(WriteNotCompleteError):
            store.free(handle)
        gate.release.set()
        store.flush()
        assert node.has_kv
        kv_files = [k for k in store.keys() if k.startswith(handle.locator)]
        assert len(kv_files) == 2 * handle.n_layers
        assert b.manager.evict_blob(node) is True
        assert node.blob is None and node.skeleton is not None
        assert not [k for k in store.keys() if k.startswith(handle.locator)]
    finally:
        gate.release.set()
        store.close()


def test_evict_refuses_pending_handle_over_stored_values(store):
    """A pending handle whose values happen to exist: evict refuses and frees nothing."""
    forest = NamespaceForest()
    b, _, _ = run_session(store, forest)
    node = nodes_by_depth(forest)[N - 1]
    values = all_values(store)
    ready = node.blob
    node.blob = BlobHandle(ready.tier, ready.locator, ready.nbytes, ready.n_layers, ready=False)
    assert b.manager.evict_blob(node) is False
    assert node.blob is not None and all_values(store) == values
    node.blob = ready
    assert b.manager.evict_blob(node) is True


# -- hooks from a thread with a running event loop -------------------------------------------------


def _a_then_b(store, mode):
    forest = NamespaceForest()
    asyncio.get_running_loop()  # raises unless a loop is running in this thread
    _, _, ha = run_session(store, forest, mode)
    b, rt, hb = run_session(store, forest, mode)
    return ha, hb, b.last_fast_forward, rt.restored_chunks


def test_hooks_under_asyncio_run(store, mode):
    async def main():
        return _a_then_b(store, mode)

    ha, hb, k, restored = asyncio.run(main())
    assert ha == hb == cold_hashes(mode)
    assert k == N and restored == list(range(N))


def test_hooks_from_worker_thread_with_its_own_loop(store, mode):
    out = {}

    def worker():
        async def main():
            return _a_then_b(store, mode)

        try:
            out["result"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join(WAIT_S * 3)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    ha, hb, k, restored = out["result"]
    assert ha == hb == cold_hashes(mode)
    assert k == N and restored == list(range(N))


# -- rolling geometry validation -------------------------------------------------------------------


@pytest.mark.parametrize("L, S", [(5, 3), (3, 1), (2, 0)])
def test_ring_geometry_rejects_L_below_S_plus_c(L, S):
    with pytest.raises(GeometryError) as ei:
        RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=L, sink_size=S)
    assert ei.value.field == "runtime.local_attn_size"
    assert "runtime.local_attn_size" in str(ei.value)
    with pytest.raises(GeometryError) as ei:
        factory((L, S))
    assert ei.value.field == "runtime.local_attn_size"
    with pytest.raises(GeometryError) as ei:
        make_rolling_config(local_attn_size=L, sink_size=S, chunk_size=3)
    assert ei.value.field == "runtime.local_attn_size"


def test_ring_geometry_accepts_L_equal_S_plus_c():
    RingGeometry(chunk_size=3, frame_tokens=2, local_attn_size=6, sink_size=3)
    factory((6, 3))


@pytest.mark.parametrize(
    "cfg, mode",
    [
        (make_rolling_config(local_attn_size=13, sink_size=3, chunk_size=3), ROLLING),  # window
        (make_rolling_config(local_attn_size=7, sink_size=0, chunk_size=3), ROLLING),  # sink
        (make_full_kv_config(), ROLLING),  # full-length manager, rolling runtime
        (make_rolling_config(local_attn_size=7, sink_size=3, chunk_size=3), FULL),
    ],
    ids=["window", "sink", "full_vs_rolling", "rolling_vs_full"],
)
def test_manager_window_must_agree_with_runtime(cfg, mode):
    store = InMemoryTierStore()
    forest = NamespaceForest()
    b = binding_for(store, forest, mode, cfg=cfg)
    rt = factory(mode).make(ACTS, hooks=b)
    with pytest.raises(GeometryError) as ei:
        rt.generate(stop_after=0)
    assert ei.value.field == "manager.window_chunks"
    assert "manager.window_chunks" in str(ei.value)
    assert b.last_fast_forward == 0 and len(forest) == 0 and store.keys() == []


# -- generic tiers get owned CPU snapshots ----------------------------------------------------------


class TailRecorder:
    """Wraps a binding: after each hook, records a clone of the ring tail and the storages."""

    def __init__(self, binding):
        self.binding = binding
        self.tails = {}

    def on_runtime_created(self, rt, sc):
        self.binding.on_runtime_created(rt, sc)

    def on_chunk_finalized(self, rt, idx, denoised):
        self.binding.on_chunk_finalized(rt, idx, denoised)
        n = rt.chunk_size * rt.frame_tokens
        self.tails[idx] = [
            (c["k"][:, c["local_end_index"] - n: c["local_end_index"]].clone(),
             c["v"][:, c["local_end_index"] - n: c["local_end_index"]].clone())
            for c in rt.self_kv_cache
        ]


def _storage_span(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _overlaps(a, b):
    (a0, a1), (b0, b1) = _storage_span(a), _storage_span(b)
    return a0 < b1 and b0 < a1


def test_generic_tiers_get_owned_cpu_snapshots(store, mode):
    forest = NamespaceForest()
    b = binding_for(store, forest, mode)
    rec = TailRecorder(b)
    rt = factory(mode).make(ACTS, hooks=rec)
    rt.generate()
    store.flush()
    nodes = nodes_by_depth(forest)
    rings = [t for c in rt.self_kv_cache for t in (c["k"], c["v"])]
    for d, node in nodes.items():
        for layer in range(node.blob.n_layers):
            k, v = store.get_layer(node.blob, layer)
            for got, want in zip((k, v), rec.tails[d][layer]):
                assert got.device.type == "cpu"
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (d, layer)
                assert not any(_overlaps(got, r) for r in rings)
        lat = store.get_skeleton(node.skeleton.latent_locator)
        assert torch.equal(lat, rt.latents[d]) and not _overlaps(lat, rt.latents[d])
    # Mutating the live ring (and latents) after the hooks changes nothing stored.
    before = all_values(store)
    for c in rt.self_kv_cache:
        c["k"].fill_(3.0)
        c["v"].fill_(-3.0)
    for lat in rt.latents:
        lat.fill_(1.0)
    assert all_values(store) == before
    if isinstance(store, InMemoryTierStore):  # the in-memory tier keeps the tensors themselves
        for key in store.keys():
            val = store.backend.read(key)
            assert not any(_overlaps(val, r) for r in rings)


# -- forest snapshot --------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_snapshot_then_new_manager_hits_every_chunk(tier, tmp_path, mode):
    snap = tmp_path / "forest.json"
    store = make_store(tier, tmp_path)
    try:
        forest = NamespaceForest()
        a, _, hashes_a = run_session(store, forest, mode, snapshot_path=str(snap),
                                     snapshot_on_finalize=True)
        a.flush_snapshot()
        assert snap.exists()
        if tier == "localdisk":  # a restarted worker: a new store on the same root
            store.close()
            store = make_store(tier, tmp_path)
        loaded = load_forest_snapshot(snap)
        assert loaded is not forest and len(loaded) == 1
        b, rt, hashes_b = run_session(store, loaded, mode, ingest=False)
        assert b.root == a.root
        assert b.last_fast_forward == N and rt.restored_chunks == list(range(N))
        assert hashes_b == hashes_a
        # ... and a divergent request still restores the shared prefix and matches a cold run.
        other = ACTS[:2] + acts(N, variant=3)[2:]
        c, rt_c, hashes_c = run_session(store, loaded, mode, other, ingest=False)
        assert c.last_fast_forward == 2 and hashes_c == cold_hashes(mode, other)
    finally:
        store.close()


def test_snapshot_path_is_loaded_at_construction_into_an_empty_forest(tmp_path):
    """As upstream: a binding given ``snapshot_path`` loads it when the forest is empty, so a new
    process hits without calling load_forest_snapshot itself; a forest in use is left alone."""
    snap = tmp_path / "forest.json"
    store = InMemoryTierStore()
    a, _, hashes_a = run_session(store, NamespaceForest(), snapshot_path=str(snap))
    a.flush_snapshot()

    fresh = NamespaceForest()
    b = binding_for(store, fresh, ingest=False, snapshot_path=str(snap))
    assert len(fresh) == 1  # before any hook ran
    rt = factory().make(ACTS, hooks=b)
    assert rt.generate() == hashes_a and b.last_fast_forward == N

    busy = NamespaceForest()
    busy.get_or_create_namespace(b"\x01" * 32, b"cfg")
    binding_for(store, busy, snapshot_path=str(snap))
    assert len(busy) == 1 and busy.resolve(a.root) is None

    missing = NamespaceForest()
    binding_for(store, missing, snapshot_path=str(tmp_path / "none.json"))
    assert len(missing) == 0


def test_snapshot_persists_only_ready_blobs(tmp_path):
    store = InMemoryTierStore()
    forest = NamespaceForest()
    run_session(store, forest)
    nodes = nodes_by_depth(forest)
    ready = nodes[N - 1].blob
    nodes[N - 1].blob = BlobHandle(ready.tier, ready.locator, ready.nbytes, ready.n_layers)
    path = tmp_path / "f.json"
    save_forest_snapshot(forest, path)
    loaded = load_forest_snapshot(path)
    b, _, _ = run_session(store, loaded, ingest=False, shared_index=False)  # the snapshot alone
    assert b.last_fast_forward == N - 1
    assert load_forest_snapshot(tmp_path / "missing.json").namespaces() == []


def test_the_store_format_is_part_of_the_namespace():
    """A Plan tier stores bare bytes, a generic tier its own encoding, under the same key names; on
    one shared Fluxon service they must never read each other's values."""
    from cacheseek.stores.plan_tier import PlanTierStore

    class BytesLikeTier(InMemoryTierStore):
        storage_format = PlanTierStore.storage_format

    assert PlanTierStore.storage_format != InMemoryTierStore.storage_format
    roots = []
    for store in (InMemoryTierStore(), BytesLikeTier()):
        b, _, _ = run_session(store, NamespaceForest(), ROLLING, ingest=False)
        roots.append(b.root)
    assert roots[0] != roots[1]


COMPUTE_IDENTITY = {
    # field -> (object, attribute, another value): what another worker's build would report
    "torch_version": (torch, "__version__", "2.99.0+other"),
    "cuda_version": (torch.version, "cuda", "99.9"),
    "cpu_isa": (torch.backends.cpu, "get_cpu_capability", lambda: "AVX1024"),
}


@pytest.mark.parametrize("field", sorted(COMPUTE_IDENTITY))
def test_compute_identity_is_in_the_namespace_and_switchable(store, monkeypatch, field):
    """Another torch, CUDA or CPU instruction set gives other KV bits: a cold miss by default; a
    deployment that drops the field from ``namespace.fields`` shares the namespace again."""
    forest = NamespaceForest()
    base, _, _ = run_session(store, forest, ROLLING)
    without = [f for f in namespace.default_fields() if f != field]
    base_without = binding_for(store, NamespaceForest(), ROLLING, ingest=False,
                               fingerprint_fields=namespace.resolve_fields(without))
    factory(ROLLING).make(ACTS, hooks=base_without).generate(stop_after=0)

    obj, attr, other = COMPUTE_IDENTITY[field]
    monkeypatch.setattr(obj, attr, other)
    changed = binding_for(store, forest, ROLLING, ingest=False)
    factory(ROLLING).make(ACTS, hooks=changed).generate(stop_after=0)
    assert changed.root != base.root and changed.last_fast_forward == 0

    switched_off = binding_for(store, NamespaceForest(), ROLLING, ingest=False,
                               fingerprint_fields=namespace.resolve_fields(without))
    factory(ROLLING).make(ACTS, hooks=switched_off).generate(stop_after=0)
    assert switched_off.root == base_without.root


def test_compute_identity_fields_on_this_machine():
    rt = factory(ROLLING).make(ACTS)
    ctx = namespace.FingerprintContext({}, rt, BshdLayout())
    blob = namespace.config_blob(namespace.resolve_fields(["gpu_arch", "cpu_isa", "torch_version"]), ctx)
    assert blob == {"gpu_arch": None, "cpu_isa": torch.backends.cpu.get_cpu_capability(),
                    "torch_version": torch.__version__}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_arch_names_the_gpu_that_computes_the_kv():
    rt = factory(ROLLING, device="cuda").make(ACTS)
    ctx = namespace.FingerprintContext({}, rt, BshdLayout())
    blob = namespace.config_blob(namespace.resolve_fields(["gpu_arch", "cpu_isa", "cuda_version"]), ctx)
    props = torch.cuda.get_device_properties(0)
    assert blob["gpu_arch"] == {"name": props.name, "capability": f"sm_{props.major}{props.minor}",
                                "sm_count": props.multi_processor_count}
    assert blob["cpu_isa"] is None and blob["cuda_version"]["cuda"] == torch.version.cuda
    print("gpu_arch", blob["gpu_arch"], "cuda_version", blob["cuda_version"])
