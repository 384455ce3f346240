"""Issue 5 item 2: the trie stays consistent with the store.

When a restore finds values missing (the store dropped them, a worker restarted), the nodes whose
values are gone lose their blobs (counted as invalidations; what is left of their values is
freed) and the restore retries the longest shorter prefix that is still whole, instead of
running cold. Generic tiers name the node by the first missing latent or layer plus their
``contains``; a `PathReadStore` by ``contains`` (the Plan tier probes with get plans). Every
restored session is bit-identical to a cold run, and a later session re-ingests the stale
chunks (skeleton included), after which the whole path hits again.
"""

from __future__ import annotations

import pytest

from cacheseek.reuse.exact_prefix import NamespaceForest
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.trie import load_forest_snapshot, save_forest_snapshot
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

from prodkit import (
    ACTS,
    FULL,
    MODES,
    N,
    chain,
    check_invariants,
    close_plan,
    cold_hashes,
    manager_cfg,
    new_manager,
    plan_store,
    run_session,
    store_keys,
)


PLAN_CLIENTS: dict = {}  # id(store) -> the embedded client of a plan tier made here (its caller closes both)


def make_tier(kind, tmp_path):
    if kind == "memory":
        return InMemoryTierStore()
    if kind == "localdisk":
        return LocalDiskTierStore(str(tmp_path / "kv"))
    store, client = plan_store()
    PLAN_CLIENTS[id(store)] = client
    return store


def close_tier(store):
    client = PLAN_CLIENTS.pop(id(store), None)
    if client is not None:
        close_plan(store, client)
    else:
        store.close()


@pytest.fixture(params=["memory", "localdisk", "plan"])
def tier(request, tmp_path):
    s = make_tier(request.param, tmp_path)
    yield s
    close_tier(s)


def remove(store, key):
    client = PLAN_CLIENTS.get(id(store))
    if client is not None:
        client.remove(key)
    else:
        store.backend.delete(key)


def kv_keys(node):
    return [k for layer in range(node.blob.n_layers) for k in layer_keys(node.blob.locator, layer)]


GONE = {
    "kv": lambda n: kv_keys(n)[-1:],  # one V of the last layer: a partial blob
    "latent": lambda n: [n.skeleton.latent_locator],
    "both": lambda n: kv_keys(n) + [n.skeleton.latent_locator],
}


@pytest.mark.parametrize("gone", sorted(GONE))
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_values_gone_from_one_node_restore_the_longest_whole_prefix(tier, mode, depth, gone):
    mode = MODES[mode]
    mgr = new_manager(tier, mode)
    run_session(mgr, mode)
    nodes = chain(mgr.forest)
    stale = nodes[depth]
    for key in GONE[gone](stale):
        remove(tier, key)
    # a KV value of a node outside the window of depth N is not needed to restore depth N
    needed = gone != "kv" or depth in manager_cfg(mode).window_depths(N)

    b, rt, hashes = run_session(mgr, mode)
    assert hashes == cold_hashes(mode)
    if not needed:
        assert b.last_fast_forward == N and mgr.metrics.invalidations == 0
        return
    assert b.last_fast_forward == depth
    assert rt.restored_chunks == list(range(depth))
    assert mgr.metrics.invalidations == 1 and mgr.metrics.restore_retries == 1
    assert mgr.metrics.restore_failures == 0
    m = mgr.metrics.as_dict()
    assert m["invalidations"] == 1 and m["partial_hits_by_depth"] == {depth: 1}
    # the session recomputed the stale chunk and re-ingested it, skeleton included
    assert stale.has_kv and all(n.has_kv for n in nodes.values())
    assert check_invariants(mgr.forest, store_keys(tier)) == []
    b2, _, hashes2 = run_session(mgr, mode, ingest=False)
    assert b2.last_fast_forward == N and hashes2 == cold_hashes(mode)


def test_several_stale_nodes_are_found_in_one_attempt(tier):
    mgr = new_manager(tier, FULL)
    run_session(mgr)
    nodes = chain(mgr.forest)
    remove(tier, kv_keys(nodes[4])[0])
    remove(tier, nodes[2].skeleton.latent_locator)
    b, _, hashes = run_session(mgr, ingest=False)
    assert hashes == cold_hashes() and b.last_fast_forward == 2
    assert mgr.metrics.invalidations == 2 and mgr.metrics.restore_retries == 1
    assert nodes[2].blob is None and nodes[4].blob is None and nodes[3].has_kv
    assert check_invariants(mgr.forest, store_keys(tier)) == []


def test_a_stale_node_below_break_even_runs_cold(tmp_path):
    store = InMemoryTierStore()
    mgr = new_manager(store, FULL)
    run_session(mgr)
    remove(store, chain(mgr.forest)[1].skeleton.latent_locator)
    from cacheseek.reuse.exact_prefix import WorldKVManager

    strict = WorldKVManager(mgr.forest, store, manager_cfg(FULL, break_even_k=3))
    b, _, hashes = run_session(strict, ingest=False)
    assert b.last_fast_forward == 0 and hashes == cold_hashes()
    assert strict.metrics.invalidations == 1 and strict.metrics.below_break_even == 1


def test_a_restarted_worker_with_an_empty_store_invalidates_and_recovers(tmp_path):
    old = InMemoryTierStore()
    mgr = new_manager(old, FULL)
    run_session(mgr)
    save_forest_snapshot(mgr.forest, tmp_path / "forest.json")

    fresh = InMemoryTierStore()  # the store came back empty
    forest = load_forest_snapshot(tmp_path / "forest.json")
    mgr2 = new_manager(fresh, FULL, forest=forest)
    b, _, hashes = run_session(mgr2)
    assert b.last_fast_forward == 0 and hashes == cold_hashes()
    assert mgr2.metrics.invalidations == N  # every node of the path named in one check
    assert check_invariants(forest, fresh.keys()) == []
    b2, _, hashes2 = run_session(mgr2, ingest=False)
    assert b2.last_fast_forward == N and hashes2 == cold_hashes()


def test_a_restarted_disk_worker_finds_what_survived(tmp_path):
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    mgr = new_manager(store, FULL)
    run_session(mgr)
    save_forest_snapshot(mgr.forest, tmp_path / "forest.json")
    lost = chain(mgr.forest)[3]
    lost_key = kv_keys(lost)[0]
    store.close()
    (store.disk.path_of(lost_key)).unlink()  # lost while the worker was down

    again = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        mgr2 = new_manager(again, FULL, forest=load_forest_snapshot(tmp_path / "forest.json"))
        b, _, hashes = run_session(mgr2)
        assert b.last_fast_forward == 3 and hashes == cold_hashes()
        assert mgr2.metrics.invalidations == 1
        assert check_invariants(mgr2.forest, again.keys()) == []
    finally:
        again.close()


def test_plan_tier_probe_ends_every_get_plan():
    store, client = plan_store()
    try:
        mgr = new_manager(store, FULL)
        run_session(mgr)
        nodes = chain(mgr.forest)
        client.remove(kv_keys(nodes[2])[1])
        keys = kv_keys(nodes[1]) + kv_keys(nodes[2]) + ["nope"]
        assert store.contains(keys) == [True] * 4 + [True, False, True, True] + [False]
        assert client.live_handles() == (0, 0)
        b, _, hashes = run_session(mgr, ingest=False)
        assert b.last_fast_forward == 2 and hashes == cold_hashes()
        assert client.live_handles() == (0, 0)
    finally:
        close_plan(store, client)


def test_a_path_store_that_cannot_name_missing_values_runs_cold():
    store, client = plan_store()
    try:
        store.contains = None  # the capability is absent: nothing can be named
        mgr = new_manager(store, FULL)
        run_session(mgr)
        nodes = chain(mgr.forest)
        client.remove(kv_keys(nodes[2])[0])
        b, _, hashes = run_session(mgr, ingest=False)
        assert b.last_fast_forward == 0 and hashes == cold_hashes()
        assert mgr.metrics.invalidations == 0 and mgr.metrics.restore_failures == 1
    finally:
        close_plan(store, client)


def test_a_blob_evicted_between_lookup_and_restore_retries_shorter():
    """The path loses a blob after the lookup (another thread evicted it): the restore sees the
    path is no longer whole and retries the longest prefix still whole."""
    store = InMemoryTierStore()
    mgr = new_manager(store, FULL)
    run_session(mgr)
    nodes = chain(mgr.forest)
    real_lookup = mgr.forest.lookup

    def lookup(root, actions):
        match = real_lookup(root, actions)
        if match.matched_len == N:
            assert mgr.evict_blob(nodes[N - 1])
        return match

    mgr.forest.lookup = lookup
    b, _, hashes = run_session(mgr, ingest=False)
    assert b.last_fast_forward == N - 1 and hashes == cold_hashes()
    assert mgr.metrics.restore_retries == 1 and mgr.metrics.invalidations == 0
    assert all(n.ref_count == 0 for n in nodes.values())


def test_materialize_alone_invalidates_what_it_finds_missing():
    store = InMemoryTierStore()
    mgr = new_manager(store, FULL)
    run_session(mgr)
    nodes = chain(mgr.forest)
    remove(store, kv_keys(nodes[1])[0])

    class Window:
        depth = None

        def seed_layer(self, layer, blobs, depth):
            raise AssertionError("nothing may be seeded")

        def set_resume_depth(self, depth):
            self.depth = depth

    w = Window()
    assert mgr.materialize(nodes[N - 1], w) is False and w.depth is None
    assert nodes[1].blob is None and mgr.metrics.invalidations == 1
    assert check_invariants(mgr.forest, store.keys()) == []


def test_audit_invalidates_what_the_store_lost(tier):
    mgr = new_manager(tier, FULL)
    run_session(mgr)
    nodes = chain(mgr.forest)
    remove(tier, kv_keys(nodes[3])[2])
    remove(tier, nodes[1].skeleton.latent_locator)
    assert mgr.audit() == 2
    assert [n.has_kv for n in nodes.values()] == [True, False, True, False, True]
    assert check_invariants(mgr.forest, store_keys(tier)) == []
    assert mgr.audit() == 0
