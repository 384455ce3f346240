"""A demotion into a full level makes room there first (the manager's leaf-first LRU victims of
that level: demoted further down from a middle level, evicted from the lowest), then retries
once; a level where every candidate is protected (being read, pinned by a live namespace, on the
demoted node's or the current request's path) refuses cleanly; a failed make-room eviction or a
failed retry loses nothing. After each, the trie's residency must match what every level holds.

Sizes: a chunk is 2 layers x K,V of 192 B (256 B blocks in the HBM and Plan tiers: 1024 B) plus
a 16 B latent (one 256 B block there); the in-memory level counts raw bytes (768 + 16 B).
"""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import StoreError
from cacheseek.eviction import EvictionConfig
from cacheseek.kv.locators import blob_keys
from cacheseek.report import metrics_block
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVConfig, WorldKVManager
from cacheseek.reuse.exact_prefix.keys import kv_locator, node_key
from plan_testkit import latent_levels  # tests/plan is on the path (conftest)

ROOT = b"R" * 32
STORED = 1280  # one chunk and its latent in the HBM or the Plan tier


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def manager(store, *, sink_chunks: int = 0) -> WorldKVManager:
    """Automatic passes off while a test lays out the levels (`enable` turns them on)."""
    cfg = WorldKVConfig(window_chunks=0, sink_chunks=sink_chunks, break_even_k=1)
    return WorldKVManager(NamespaceForest(), store, cfg, clock=Clock(), eviction=EvictionConfig(enabled=False))


def enable(mgr: WorldKVManager) -> None:
    mgr.eviction = EvictionConfig(high_watermark=0.9, low_watermark=0.7)


def put(mgr: WorldKVManager, action: bytes, parent=None):
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    parent = parent or ns.root
    fill = float(len(list(ns.iter_nodes())) + 1)
    payload = [(torch.full((1, 6, 2, 4), fill + i), torch.full((1, 6, 2, 4), -fill - i)) for i in range(2)]
    node = mgr.ingest(ns, parent, action, node_key(parent.node_key, action), parent.depth + 1, payload,
                      torch.full((4,), fill))
    mgr.store.flush()
    return node


def all_nodes(mgr):
    return [n for ns in mgr.forest.namespaces() for n in ns.iter_nodes()]


def check_residency(mgr) -> None:
    """Every node's recorded levels are exactly the levels whose store holds its whole blob (none
    for a node without a blob), and likewise for its latent."""
    store = mgr.store
    for n in all_nodes(mgr):
        keys = blob_keys(kv_locator(n.node_key), 2)
        holding = tuple(i for i, lv in enumerate(store.levels) if all(lv.contains(keys)))
        if n.blob is None:
            assert holding == (), f"{n!r} has no blob but levels {holding} hold it"
        else:
            assert n.blob.ready and store.levels_of(n.blob) == holding and holding, (n, holding)
        if n.skeleton is not None:
            loc = n.skeleton.latent_locator
            assert latent_levels(store, loc), f"{n!r}'s latent is in no level"


def row(store, name: str) -> dict:
    return next(r for r in store.stats.as_dict()["tiers"] if r["name"] == name)


def plan_full(mgr, parts, *actions):
    """Chains written to HBM, then demoted into the Plan tier, deepest first (no room made)."""
    nodes, parent = [], None
    for a in actions:
        parent = put(mgr, a, parent)
        nodes.append(parent)
    for n in reversed(nodes):
        assert mgr.store.demote(n.blob, 0)
    return nodes


def test_a_full_plan_tier_evicts_its_lru_leaf_and_takes_the_demotion(levels):
    store, parts = levels("host", hbm_bytes=4 * STORED, plan_bytes=2 * STORED, write_through=False)
    mgr = manager(store)
    a0, a1 = plan_full(mgr, parts, b"a0", b"a1")
    b0 = put(mgr, b"b0")
    b1 = put(mgr, b"b1", b0)
    assert store.tier_usages()[1].usage.used_bytes == 2 * STORED
    assert not store.demote(b1.blob, 0)  # without room made: refused, kept above
    assert row(store, "hbm")["demotion_no_room"] == 1 and store.levels_of(b1.blob) == (0,)
    enable(mgr)
    assert mgr.demoter.demote(b1, 0, frozenset())
    assert a1.blob is None and a1.skeleton is None  # the LRU leaf of the Plan tier, its latent too
    assert store.levels_of(a0.blob) == (1,) and store.levels_of(b0.blob) == (0,)
    assert store.levels_of(b1.blob) == (1,) and latent_levels(store, b1.skeleton.latent_locator) == (1,)
    assert row(store, "fluxon_plan")["evictions_for_demotion"] == 1
    m = mgr.metrics.as_dict()
    assert (m["evictions_for_demotion"], m["evictions"], m["demotion_no_room"]) == (1, 1, 0)
    assert "tier 1 fluxon_plan (fluxon_dram): 2 chunks" in metrics_block(m) and "1 moved out to make room" in metrics_block(m)
    assert parts["plan_client"].live_handles() == (0, 0)
    check_residency(mgr)
    # the next one: a0 is the Plan tier's leaf now (b1 was just written there)
    assert mgr.demoter.demote(b0, 0, frozenset())
    assert a0.blob is None and store.levels_of(b0.blob) == store.levels_of(b1.blob) == (1,)
    check_residency(mgr)


def test_three_levels_a_middle_victim_is_demoted_further_and_the_lowest_evicts(levels):
    store, parts = levels("host", ("hbm", "fluxon_plan", "memory"), hbm_bytes=4 * STORED,
                          plan_bytes=2 * STORED, memory_bytes=1000, write_through=False)
    mgr = manager(store)
    c0 = put(mgr, b"c0")
    assert store.demote(c0.blob, 0) and store.demote(c0.blob, 1)  # the memory level is full
    a0, a1 = plan_full(mgr, parts, b"a0", b"a1")  # so is the Plan tier
    b0 = put(mgr, b"b0")
    enable(mgr)
    assert mgr.demoter.demote(b0, 0, frozenset())
    assert c0.blob is None  # evicted from the lowest level to let a1 in
    assert store.levels_of(a1.blob) == (2,) and latent_levels(store, a1.skeleton.latent_locator) == (2,)
    assert store.levels_of(a0.blob) == (1,) and store.levels_of(b0.blob) == (1,)
    assert row(store, "fluxon_plan")["evictions_for_demotion"] == 1
    assert row(store, "memory")["evictions_for_demotion"] == 1
    assert row(store, "fluxon_plan")["demotions"] == 1 + 1  # c0 in setup, a1 to make room
    assert mgr.metrics.as_dict()["evictions_for_demotion"] == 2
    assert parts["plan_client"].live_handles() == (0, 0)
    check_residency(mgr)


def test_a_lowest_victim_held_above_too_only_loses_its_lowest_copy(levels):
    store, parts = levels("host", hbm_bytes=4 * STORED, plan_bytes=2 * STORED, write_through=True)
    mgr = manager(store)
    a0 = put(mgr, b"a0")  # HBM and the Plan tier
    x0 = put(mgr, b"x0")
    assert store.demote(x0.blob, 0)
    with mgr.forest.lock:
        a0.last_access = 0.0  # the LRU of the Plan tier, yet hot above
    b0 = put(mgr, b"b0")  # the Plan tier is full: HBM only
    assert store.levels_of(b0.blob) == (0,)
    enable(mgr)
    assert mgr.demoter.demote(b0, 0, frozenset())
    assert store.levels_of(a0.blob) == (0,) and a0.blob.ready  # still a blob, from HBM
    assert store.levels_of(x0.blob) == (1,) and store.levels_of(b0.blob) == (1,)
    assert mgr.metrics.as_dict()["evictions"] == 0 and row(store, "fluxon_plan")["evicted_copies"] == 1
    check_residency(mgr)


@pytest.mark.parametrize("why", ["reading", "pinned", "own_path", "request_path"])
def test_room_is_never_made_from_protected_nodes(levels, why):
    store, parts = levels("host", hbm_bytes=4 * STORED, plan_bytes=STORED, write_through=False)
    mgr = manager(store, sink_chunks=1 if why == "pinned" else 0)
    if why == "own_path":
        (held,) = plan_full(mgr, parts, b"p0")
        node = put(mgr, b"p1", held)  # its parent is the Plan tier's only candidate
    else:
        (held,) = plan_full(mgr, parts, b"a0")
        node = put(mgr, b"b0")
    if why == "reading":
        held.ref_count = 1
    guard = frozenset({id(held)}) if why == "request_path" else frozenset()
    enable(mgr)
    assert not mgr.demoter.demote(node, 0, guard)
    assert held.blob is not None and store.levels_of(held.blob) == (1,)
    assert node.blob.ready and store.levels_of(node.blob) == (0,)
    assert all(parts["hbm"].contains(blob_keys(node.blob.locator, 2)))
    hbm = row(store, "hbm")
    assert (hbm["demotion_failures"], hbm["demotion_no_room"]) == (1, 1)
    m = mgr.metrics.as_dict()
    assert (m["demotion_no_room"], m["evictions_for_demotion"], m["evictions"]) == (1, 0, 0)
    check_residency(mgr)
    held.ref_count = 0


def test_a_pass_protects_the_current_requests_path(levels):
    store, parts = levels("host", hbm_bytes=2 * STORED, plan_bytes=STORED, write_through=False)
    mgr = manager(store)
    (a0,) = plan_full(mgr, parts, b"a0")
    b0, c0 = put(mgr, b"b0"), put(mgr, b"c0")  # HBM at 100%: above the high watermark
    enable(mgr)
    assert mgr.demoter.demote_tiers(protect=a0) == 0
    assert store.levels_of(a0.blob) == (1,) and mgr.metrics.as_dict()["demotion_no_room"] >= 1
    assert mgr.demoter.demote_tiers() == 1  # unprotected: a0 makes room for the LRU of HBM
    assert a0.blob is None and store.levels_of(b0.blob) == (1,) and store.levels_of(c0.blob) == (0,)
    check_residency(mgr)


def test_a_failed_make_room_eviction_loses_nothing(levels, monkeypatch):
    store, parts = levels("host", hbm_bytes=4 * STORED, plan_bytes=STORED, write_through=False)
    mgr = manager(store)
    (a0,) = plan_full(mgr, parts, b"a0")
    b0 = put(mgr, b"b0")
    enable(mgr)

    def refused(handle):  # the victim's free fails before removing anything
        raise StoreError("cannot remove")

    monkeypatch.setattr(parts["fluxon_plan"], "free", refused)
    assert not mgr.demoter.demote(b0, 0, frozenset())
    assert a0.blob is not None and a0.blob.ready and store.levels_of(a0.blob) == (1,)  # put back
    assert store.levels_of(b0.blob) == (0,) and all(parts["hbm"].contains(blob_keys(b0.blob.locator, 2)))
    m = mgr.metrics.as_dict()
    assert (m["demotion_errors"], m["evictions_for_demotion"], m["demotion_no_room"]) == (1, 0, 1)
    assert row(store, "hbm")["demotion_no_room"] == 1
    assert parts["plan_client"].live_handles() == (0, 0)
    check_residency(mgr)
    monkeypatch.undo()
    assert mgr.demoter.demote(b0, 0, frozenset())  # the free works again: room is made this time
    check_residency(mgr)


def test_a_failed_retry_after_making_room_keeps_the_copy_above(levels):
    store, parts = levels("host", hbm_bytes=4 * STORED, plan_bytes=STORED, write_through=False)
    mgr = manager(store)
    (a0,) = plan_full(mgr, parts, b"a0")
    b0 = put(mgr, b"b0")
    enable(mgr)
    parts["plan_faults"].arm("put_start", nth=2)  # the first write finds the tier full; the retry fails
    assert not mgr.demoter.demote(b0, 0, frozenset())
    assert parts["plan_faults"].fired == ["put_start"]
    assert a0.blob is None  # the victim was evicted: that is what eviction is
    assert store.levels_of(b0.blob) == (0,) and all(parts["hbm"].contains(blob_keys(b0.blob.locator, 2)))
    assert latent_levels(store, b0.skeleton.latent_locator) == (0,)
    hbm, plan = row(store, "hbm"), row(store, "fluxon_plan")
    assert (hbm["demotion_failures"], hbm.get("demotion_no_room", 0), plan["evictions_for_demotion"]) == (1, 0, 1)
    assert parts["plan_client"].live_handles() == (0, 0) and parts["plan_client"].usage().used_bytes == 0
    check_residency(mgr)
    assert mgr.demoter.demote(b0, 0, frozenset()) and store.levels_of(b0.blob) == (1,)
    check_residency(mgr)


def test_a_middle_levels_room_is_not_made_from_the_demoted_nodes_own_prefix(levels):
    # p0 would move on to the memory level without harm to its data, but the chain p0 > p1 would
    # end up split the wrong way round (the child above its parent's level): p0 is protected
    store, parts = levels("host", ("hbm", "fluxon_plan", "memory"), hbm_bytes=4 * STORED, plan_bytes=STORED,
                          memory_bytes=10_000, write_through=False)
    mgr = manager(store)
    (p0,) = plan_full(mgr, parts, b"p0")
    p1 = put(mgr, b"p1", p0)
    enable(mgr)
    assert mgr.demoter.demote(p1, 0, frozenset())  # into the memory level, the next one down
    assert store.levels_of(p0.blob) == (1,) and store.levels_of(p1.blob) == (2,)
    assert row(store, "hbm")["demotion_no_room"] == 1 and mgr.metrics.as_dict()["evictions_for_demotion"] == 0
    check_residency(mgr)
