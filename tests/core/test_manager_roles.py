"""The manager's parts on a caller's own store (torch-free): the restore outcome's retry rule,
invalidation, the restore's references and publication, eviction's single-blob lifetime and
predicates, the write side's make-room-and-retry, and the store contract's adapter."""

from __future__ import annotations

import pytest

from cacheseek.errors import HandleStateError, StoreError, StoreFullError, WriteNotCompleteError
from cacheseek.reuse.exact_prefix import InMemoryTierStore, NamespaceForest, WorldKVConfig, WorldKVManager
from cacheseek.reuse.exact_prefix.capacity import evictable, holds_blob, subtree_has_blob
from cacheseek.reuse.exact_prefix.invalidation import owner_of
from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator, layer_keys, node_key
from cacheseek.reuse.exact_prefix.manager import cold
from cacheseek.reuse.exact_prefix.restore import NOT_WHOLE, OK, Outcome
from cacheseek.stores.base import TierStore, as_store
from cacheseek.reuse.exact_prefix.types import BlobHandle, BlobState, NodeState, Skeleton, Tier, TrieNode

ROOT = b"R" * 32


class FakeStore:
    """Records frees; ``gone``: keys ``contains`` reports missing; ``free_error``: raised by free."""

    def __init__(self, *, gone=(), free_error=None, contains=True):
        self.gone = set(gone)
        self.free_error = free_error
        self.freed: list[str] = []
        if contains:
            self.contains = lambda keys: [k not in self.gone for k in keys]

    def free(self, handle):
        if self.free_error is not None:
            raise self.free_error
        self.freed.append(handle.locator)


def manager_on(store, forest=None, *, eviction=None, window_chunks=0, sink_chunks=0):
    return WorldKVManager(forest or NamespaceForest(), store,
                          WorldKVConfig(window_chunks=window_chunks, sink_chunks=sink_chunks, break_even_k=1),
                          clock=lambda: 42.0, eviction=eviction)


def chain(n, *, ready=True, n_layers=2):
    """A hand-built path of ``n`` nodes under a virtual root, each with a skeleton and a blob."""
    root = TrieNode(ROOT, b"", -1, None)
    parent, nodes = root, []
    for d in range(n):
        key = node_key(parent.node_key, bytes([d]))
        node = TrieNode(key, bytes([d]), d, parent, skeleton=Skeleton(latent_locator(key)),
                        blob=BlobHandle(Tier.CPU, kv_locator(key), 10, n_layers, ready=ready))
        parent.children[node.action] = node
        parent = node
        nodes.append(node)
    return nodes


# --- restore outcome and lookup ------------------------------------------------------------------


def test_retry_limit_stops_before_the_shallowest_missing_node():
    nodes = chain(6)
    assert Outcome(False, (nodes[2], nodes[4])).retry_limit(6) == 2
    # a missing node deeper than the match still shortens the prefix by one
    assert Outcome(False, (nodes[5],)).retry_limit(5) == 4


def test_retry_limit_of_a_changed_path_is_one_chunk_shorter():
    assert NOT_WHOLE.retry_limit(4) == 3
    assert NOT_WHOLE.retryable and Outcome(False, chain(1)).retryable
    assert not Outcome(False).retryable and not OK.retryable


def test_cold_names_the_virtual_root_or_nothing():
    forest = NamespaceForest()
    ns = forest.get_or_create_namespace(ROOT, b"C")
    assert cold(ns).start_chunk == 0 and cold(ns).node is ns.root and cold(ns).namespace is ns
    assert cold(None).node is None and cold(None).namespace is None


# --- invalidation --------------------------------------------------------------------------------


def test_find_missing_adds_what_contains_reports_sorted_by_depth():
    nodes = chain(4)
    store = FakeStore(gone={nodes[3].skeleton.latent_locator, layer_keys(nodes[1].blob.locator, 1)[1]})
    inv = manager_on(store).invalidator
    assert inv.find_missing(nodes, nodes, nodes[2]) == (nodes[1], nodes[2], nodes[3])


def test_find_missing_without_contains_or_with_a_failing_one_is_only_the_first():
    nodes = chain(3)
    assert manager_on(FakeStore(contains=False)).invalidator.find_missing(nodes, nodes, nodes[1]) == (nodes[1],)
    store = FakeStore()
    store.contains = lambda keys: (_ for _ in ()).throw(OSError("down"))
    assert manager_on(store).invalidator.find_missing(nodes, nodes, None) == ()


def test_invalidate_frees_an_unread_node_and_only_marks_a_read_one():
    a, b = chain(2)
    b.ref_count = 1
    store = FakeStore()
    ctx = manager_on(store)
    inv = ctx.invalidator
    assert inv.invalidate([a, b]) == 2
    assert a.state is NodeState.EMPTY and store.freed == [kv_locator(a.node_key)]
    assert b.state is NodeState.INVALID and b.blob.state is BlobState.FAILED
    assert ctx.metrics.invalidations == 2
    # the last reader's release frees it
    b.ref_count = 0
    inv.free_invalidated(b)
    assert b.blob is None and b.state is NodeState.EMPTY
    assert store.freed == [kv_locator(a.node_key), kv_locator(b.node_key)]


def test_invalidate_skips_in_flight_and_blobless_nodes():
    a, b = chain(2, ready=False)  # pending: a write in flight
    b.blob = None
    store = FakeStore()
    assert manager_on(store).invalidator.invalidate([a, b]) == 0 and store.freed == [] and a.blob is not None


def test_a_failed_free_keeps_the_handle_as_a_failed_blob():
    (a,) = chain(1)
    handle = a.blob
    manager_on(FakeStore(free_error=OSError("io"))).invalidator.invalidate([a])
    assert a.blob is handle and a.state is NodeState.FAILED


def test_owner_of_finds_the_latent_or_kv_owner():
    nodes = chain(3)
    assert owner_of(nodes[1].skeleton.latent_locator, nodes, nodes) is nodes[1]
    assert owner_of(layer_keys(nodes[2].blob.locator, 1)[0], nodes, nodes) is nodes[2]
    assert owner_of(layer_keys(nodes[2].blob.locator, 1)[0], nodes, nodes[:2]) is None
    assert owner_of("nobody", nodes, nodes) is None


# --- restore -------------------------------------------------------------------------------------


class Window:
    def __init__(self):
        self.calls = []

    def seed_layer(self, layer, blobs, depth):
        self.calls.append(("seed", layer, [d for d, _ in blobs], depth))

    def set_resume_depth(self, depth):
        self.calls.append(("publish", depth))


def test_release_refuses_a_reference_never_taken_and_changes_nothing():
    a, b = chain(2)
    a.ref_count = 1
    restorer = manager_on(FakeStore()).restorer
    with pytest.raises(HandleStateError):
        restorer.release([a, b], ())
    assert (a.ref_count, b.ref_count) == (1, 0)


def test_a_path_not_whole_takes_no_references():
    nodes = chain(3)
    nodes[1].blob.ready = False
    restorer = manager_on(FakeStore()).restorer
    assert restorer.restore(nodes[2], Window()) is NOT_WHOLE
    assert [n.ref_count for n in nodes] == [0, 0, 0]


def test_a_missing_layer_seeds_nothing_invalidates_it_and_drops_the_references():
    store = InMemoryTierStore()
    mgr = WorldKVManager(NamespaceForest(), store, WorldKVConfig(window_chunks=0, sink_chunks=0, break_even_k=1))
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    parent = ns.root
    for d in range(3):
        a = bytes([d])
        parent = mgr.ingest(ns, parent, a, node_key(parent.node_key, a), d, [("k", "v")], f"lat{d}")
    nodes = parent.path()
    store.free(nodes[1].blob)  # the store lost chunk 1's KV behind the trie's back
    w = Window()
    out = mgr.restorer.restore(nodes[2], w)
    assert not out.ok and out.missing == (nodes[1],) and out.retry_limit(3) == 1
    assert w.calls == []  # nothing seeded, nothing published
    assert [n.ref_count for n in nodes] == [0, 0, 0] and nodes[1].blob is None
    # the shorter prefix is whole: everything is seeded, then published last
    assert mgr.restorer.restore(nodes[0], w).ok
    assert w.calls == [("seed", 0, [0], 0), ("publish", 0)]
    assert nodes[0].ref_count == 0


# --- eviction ------------------------------------------------------------------------------------


def test_eviction_predicates():
    a, b = chain(2)
    assert holds_blob(a) and subtree_has_blob(a)
    assert not evictable(a, pin_holds=False)  # b below holds a ready blob: not a leaf
    assert evictable(b, pin_holds=False) and not evictable(b, pin_holds=True)
    b.ref_count = 1
    assert not evictable(b, pin_holds=False)
    b.ref_count = 0
    b.blob.error = StoreError("failed")
    b.blob.ready = False
    assert not holds_blob(b) and evictable(a, pin_holds=False)
    b.blob = None
    a.blob = None
    assert not subtree_has_blob(a)
    a.detach()
    assert a.state is NodeState.FREEING and holds_blob(a)


def test_evict_blob_puts_the_blob_back_when_free_fails():
    (a,) = chain(1)
    handle = a.blob
    store = FakeStore(free_error=OSError("io"))
    ctx = manager_on(store)
    ev = ctx.evictor
    with pytest.raises(OSError):
        ev.evict_blob(a, honour_pins=True)
    assert a.blob is handle and a.state is NodeState.READY and ctx.metrics.evictions == 0
    store.free_error = WriteNotCompleteError("still writing")
    assert ev.evict_blob(a, honour_pins=True) is False and a.blob is handle


def test_evict_blob_refuses_pinned_read_and_in_flight_nodes():
    a, b, c = chain(3)
    a.pinned, b.ref_count, c.blob.ready = True, 1, False
    store = FakeStore()
    ctx = manager_on(store)
    ev = ctx.evictor
    assert not any(ev.evict_blob(n, honour_pins=True) for n in (a, b, c)) and store.freed == []
    c.blob.ready = True
    assert ev.evict_blob(c, honour_pins=True) and c.blob is None and c.skeleton is not None
    assert ctx.metrics.evictions == 1 and store.freed == [kv_locator(c.node_key)]


def test_demotion_is_a_no_op_on_a_store_without_tiers():
    assert manager_on(FakeStore()).demoter.demote_tiers() == 0


# --- write side ----------------------------------------------------------------------------------


class FakeEvictor:
    def __init__(self):
        self.calls = []

    def evict(self, target, *, at_least_one=False):
        self.calls.append((target, at_least_one))
        return 1


class Usage:
    def __init__(self, used, capacity):
        self.used_bytes, self.capacity_bytes = used, capacity


def test_with_room_evicts_at_least_one_then_retries_once():
    store = FakeStore()
    store.usage = lambda: Usage(900, 1000)
    ev = FakeEvictor()
    ing = manager_on(store)
    ing.evictor = ev
    attempts = []

    def write():
        attempts.append(1)
        if len(attempts) < 3:
            raise StoreFullError("full")
        return "ok"

    with pytest.raises(StoreFullError):  # the retry is refused too: the write is dropped
        ing.with_room(write, need=500)
    assert len(attempts) == 2 and ev.calls == [(500, True)]  # min(0.7 * 1000, 1000 - 500)
    attempts[:] = [1]  # next: refused once, then accepted
    assert ing.with_room(write, need=100) == "ok" and ev.calls[-1] == (700, True) and len(attempts) == 3


def test_with_room_without_eviction_raises_at_once():
    store = FakeStore()
    store.usage = lambda: Usage(900, 1000)
    ev = FakeEvictor()
    ing = manager_on(store, eviction={"enabled": False})
    ing.evictor = ev
    with pytest.raises(StoreFullError):
        ing.with_room(lambda: (_ for _ in ()).throw(StoreFullError("full")), need=1)
    assert ev.calls == []


# --- the store contract ---------------------------------------------------------------------------


def test_a_callers_store_is_wrapped_once_with_what_it_has():
    store = FakeStore()
    mgr = manager_on(store)
    assert isinstance(mgr.store, TierStore) and mgr.store.wrapped is store and as_store(mgr.store) is mgr.store
    assert mgr.store.knows_contents and not mgr.store.frees_latents and not mgr.store.lists_values
    assert not mgr.store.reads_paths and mgr.store.usage() is None and mgr.store.tier_usages() == ()
    assert not manager_on(FakeStore(contains=False)).store.knows_contents
    mgr.store = other = InMemoryTierStore()  # a product store is taken as it is
    assert mgr.store is other and mgr.restorer.ctx is mgr
