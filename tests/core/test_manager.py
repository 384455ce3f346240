"""Manager behaviour on the in-memory tier with plain-object payloads (torch-free)."""

import pytest

from cacheseek.errors import StoreError
from cacheseek.reuse.exact_prefix import (
    InMemoryTierStore,
    NamespaceForest,
    WorldKVConfig,
    WorldKVManager,
)
from cacheseek.reuse.exact_prefix.keys import node_key
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier

ROOT = b"R" * 32


class RecordingWindow:
    def __init__(self):
        self.layers = {}
        self.latents = None
        self.depth = None
        self.seed_depths = set()

    def seed_latents(self, latents):
        self.latents = list(latents)

    def seed_layer(self, layer, blobs, depth):
        self.layers[layer] = blobs
        self.seed_depths.add(depth)

    def set_resume_depth(self, depth):
        self.depth = depth


def _ingest_chain(mgr, actions, n_layers=2):
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    parent = ns.root
    for d, a in enumerate(actions):
        payload = [(f"k{d}.{i}", f"v{d}.{i}") for i in range(n_layers)]
        parent = mgr.ingest(ns, parent, a, node_key(parent.node_key, a), d, payload, f"lat{d}")
    return ns


def make(window_chunks=0, sink_chunks=0, break_even=1, store=None):
    cfg = WorldKVConfig(window_chunks=window_chunks, sink_chunks=sink_chunks, break_even_k=break_even)
    return WorldKVManager(NamespaceForest(), store or InMemoryTierStore(), cfg)


def test_full_hit_seeds_window_then_publishes():
    mgr = make()
    _ingest_chain(mgr, [b"a", b"b", b"c"])
    w = RecordingWindow()
    res = mgr.try_fast_forward(ROOT, [b"a", b"b", b"c"], w)
    # K = 3 chunks restored; the window is told the deepest node's trie depth, K-1 (as upstream).
    assert res.start_chunk == 3 and res.node.depth == 2
    assert w.depth == 2 and w.seed_depths == {2}
    assert w.latents == ["lat0", "lat1", "lat2"]
    assert [d for d, _ in w.layers[1]] == [0, 1, 2]
    assert w.layers[1][2][1] == ("k2.1", "v2.1")


def test_rolling_window_is_sinks_plus_recent():
    mgr = make(window_chunks=2, sink_chunks=1)
    _ingest_chain(mgr, [b"a", b"b", b"c", b"d", b"e"])
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, [b"a", b"b", b"c", b"d", b"e"], w).start_chunk == 5
    assert [d for d, _ in w.layers[0]] == [0, 3, 4]
    assert len(w.latents) == 5


def test_sink_nodes_are_pinned_and_not_evictable():
    mgr = make(window_chunks=2, sink_chunks=1)
    ns = _ingest_chain(mgr, [b"a", b"b"])
    sink = ns.root.children[b"a"]
    assert sink.pinned and not mgr.evict_blob(sink)
    child = sink.children[b"b"]
    assert mgr.evict_blob(child) and child.blob is None and child.skeleton is not None


def test_below_break_even_runs_cold():
    mgr = make(break_even=3)
    _ingest_chain(mgr, [b"a", b"b"])
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, [b"a", b"b"], w).start_chunk == 0 and w.depth is None


def test_missing_latent_invalidates_the_node_and_restores_the_shorter_prefix():
    """Issue 5 item 2: the stale node loses its blob (its KV is freed, no orphan) and the restore
    retries the longest whole prefix instead of running cold."""
    mgr = make()
    ns = _ingest_chain(mgr, [b"a", b"b"])
    node = ns.root.children[b"a"].children[b"b"]
    kv_loc = node.blob.locator
    mgr.store.backend.delete(node.skeleton.latent_locator)
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, [b"a", b"b"], w).start_chunk == 1
    assert w.depth == 0 and w.latents == ["lat0"] and [d for d, _ in w.layers[0]] == [0]
    assert node.blob is None and node.skeleton is not None
    assert not [k for k in mgr.store.keys() if k.startswith(kv_loc)]
    assert mgr.metrics.invalidations == 1 and mgr.metrics.restore_retries == 1
    assert all(n.ref_count == 0 for n in ns.iter_nodes())


def test_partial_layer_is_a_miss_not_a_crash():
    mgr = make()
    ns = _ingest_chain(mgr, [b"a"])
    node = ns.root.children[b"a"]
    mgr.store.backend.delete(f"{node.blob.locator}:L1:v")
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, [b"a"], w).start_chunk == 0
    assert w.depth is None and w.layers == {}


def test_store_error_runs_cold_and_leaves_trie():
    class Broken(InMemoryTierStore):
        def get_layer(self, handle, layer):
            raise StoreError("disk on fire")

    mgr = make(store=Broken())
    ns = _ingest_chain(mgr, [b"a"])
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, [b"a"], w).start_chunk == 0
    assert w.depth is None and ns.root.children[b"a"].has_kv and ns.root.children[b"a"].ref_count == 0


def test_reingest_never_replaces_ready_blob():
    mgr = make()
    ns = _ingest_chain(mgr, [b"a"])
    node = ns.root.children[b"a"]
    ready = node.blob
    again = mgr.ingest(ns, ns.root, b"a", node.node_key, 0, [("x", "y")], "lat")
    assert again is node and node.blob is ready and node.blob.ready
    assert mgr.store.get_layer(ready, 0) == ("k0.0", "v0.0")


def test_evict_refuses_incomplete_write():
    mgr = make()
    ns = _ingest_chain(mgr, [b"a"])
    node = ns.root.children[b"a"]
    node.blob = BlobHandle(Tier.CPU, node.blob.locator, 1, 2, ready=False)
    assert not mgr.evict_blob(node)
    assert node.blob is not None


def test_evict_keeps_blob_when_free_fails():
    class NoFree(InMemoryTierStore):
        def free(self, handle):
            raise StoreError("remove failed")

    mgr = make(store=NoFree())
    ns = _ingest_chain(mgr, [b"a"])
    node = ns.root.children[b"a"]
    with pytest.raises(StoreError):
        mgr.evict_blob(node)
    assert node.has_kv


def test_referenced_node_is_not_evicted():
    mgr = make()
    ns = _ingest_chain(mgr, [b"a"])
    node = ns.root.children[b"a"]
    node.ref_count = 1
    assert not mgr.evict_blob(node)


def test_handle_is_published_by_the_completion_callback():
    """A store written to docs/api.md calls on_ready(handle) and leaves ``ready`` to the manager."""

    class CallbackOnly(InMemoryTierStore):
        def put_async(self, locator, payload, *, tier, on_ready=None):
            handle = BlobHandle(tier, locator, 0, len(payload))
            for i, (k, v) in enumerate(payload):
                self.backend.write(f"{locator}:L{i}:k", k)
                self.backend.write(f"{locator}:L{i}:v", v)
            if on_ready is not None:
                on_ready(handle)
            return handle

    mgr = make(store=CallbackOnly())
    ns = _ingest_chain(mgr, [b"a"])
    assert ns.root.children[b"a"].has_kv
    assert mgr.try_fast_forward(ROOT, [b"a"], RecordingWindow()).start_chunk == 1


# -- as upstream CacheSeek (issue 10) --------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_window_is_told_the_deepest_restored_nodes_depth(k):
    """K restored chunks: ``seed_layer`` and ``set_resume_depth`` get node.depth = K-1, the value
    upstream passes (a window written for upstream would otherwise sit one chunk off)."""
    mgr = make(window_chunks=2, sink_chunks=1)
    _ingest_chain(mgr, [b"a", b"b", b"c", b"d"])
    w = RecordingWindow()
    res = mgr.try_fast_forward(ROOT, [b"a", b"b", b"c", b"d"][:k] + [b"x"], w)
    assert res.start_chunk == k and res.node.depth == k - 1
    assert w.depth == k - 1 and w.seed_depths == {k - 1}
    assert [d for d, _ in w.layers[0]][-1] == k - 1  # the newest seeded chunk is that node


def test_a_cold_result_mounts_at_the_namespace_root():
    mgr = make(break_even=2)
    ns = _ingest_chain(mgr, [b"a"])
    assert mgr.try_fast_forward(ROOT, [b"a"], RecordingWindow()).node is ns.root  # below break-even
    assert mgr.try_fast_forward(ROOT, [b"z"], RecordingWindow()).node is ns.root  # no match
    miss = mgr.try_fast_forward(b"other" * 7, [b"a"], RecordingWindow())
    assert miss.node is None and miss.namespace is None


class UpstreamStyleStore:
    """A store written against upstream's KVTierStore protocol: ``put_async`` returns nothing and
    calls ``on_ready()`` without arguments, later (on ``flush``); layers are any objects."""

    def __init__(self):
        self.blobs, self.latents, self.pending = {}, {}, []

    def put_async(self, locator, payload, *, tier, on_ready=None):
        self.blobs[locator] = list(payload)
        if on_ready is not None:
            self.pending.append(on_ready)

    def flush(self):
        while self.pending:
            self.pending.pop(0)()

    def get_layer(self, handle, layer):
        return self.blobs[handle.locator][layer]

    def put_skeleton(self, locator, latent):
        self.latents[locator] = latent

    def get_skeleton(self, locator):
        return self.latents.get(locator)

    def free(self, handle):
        self.blobs.pop(handle.locator, None)


def test_a_store_written_for_upstream_works():
    store = UpstreamStyleStore()
    mgr = make(store=store)
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    parent = ns.root
    for d, a in enumerate(["u", "r"]):
        parent = mgr.ingest(ns, parent, a, node_key(parent.node_key, a.encode()), d, [f"kv{d}"], f"lat{d}")
    assert parent.blob is not None and not parent.has_kv  # published only from on_ready
    assert mgr.try_fast_forward(ROOT, ["u", "r"], RecordingWindow()).start_chunk == 0
    store.flush()
    w = RecordingWindow()
    assert mgr.try_fast_forward(ROOT, ["u", "r"], w).start_chunk == 2
    assert w.layers[0] == [(0, "kv0"), (1, "kv1")] and w.latents == ["lat0", "lat1"] and w.depth == 1
    assert mgr.evict_blob(parent) and "lat1" in store.latents.values() and len(store.blobs) == 1
