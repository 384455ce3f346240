"""The manager over the memory and LocalDisk tiers with a string per layer, as upstream
CacheSeek's flow tests and quickstart store them: hit, audit, eviction, and (LocalDisk) a
restarted worker that reloads the forest snapshot and reopens the same root."""

from __future__ import annotations

import pytest

from cacheseek.reuse.exact_prefix import (
    NamespaceForest,
    WorldKVConfig,
    WorldKVManager,
    build_action_chain,
    load_forest_snapshot,
    save_forest_snapshot,
)
from cacheseek.reuse.exact_prefix.keys import canonical_json_bytes
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

ROOT = b"\x11" * 32
ACTIONS = ["u", "u", "r", "r", "d"]
N_LAYERS = 2


def make_store(tier, tmp_path):
    return InMemoryTierStore() if tier == "memory" else LocalDiskTierStore(str(tmp_path / "kv"))


def payload(key: bytes) -> list[str]:
    return [f"{key.hex()[:8]}:L{i}" for i in range(N_LAYERS)]


class Window:
    def __init__(self):
        self.seeded, self.depth = {}, None

    def seed_layer(self, layer, blobs, depth):
        self.seeded[layer] = list(blobs)

    def set_resume_depth(self, depth):
        self.depth = depth


def manager(forest, store):
    return WorldKVManager(forest, store, WorldKVConfig(window_chunks=2, sink_chunks=1, break_even_k=1))


def ingest_all(mgr):
    ns = mgr.forest.get_or_create_namespace(ROOT, b"cfg")
    chain = build_action_chain(ROOT, [canonical_json_bytes(a) for a in ACTIONS])
    node = ns.root
    for i, a in enumerate(ACTIONS):
        node = mgr.ingest(ns, node, a, chain[i], i, payload(chain[i]), latent=f"x0@{i}")
    mgr.store.flush()
    return chain


@pytest.mark.parametrize("tier", ["memory", "localdisk"])
def test_string_layers_hit_audit_and_evict(tier, tmp_path):
    store = make_store(tier, tmp_path)
    try:
        mgr = manager(NamespaceForest(), store)
        chain = ingest_all(mgr)
        w = Window()
        res = mgr.try_fast_forward(ROOT, ACTIONS, w)
        assert res.start_chunk == 5 and w.depth == 4
        assert w.seeded[1] == [(d, payload(chain[d])[1]) for d in (0, 3, 4)]  # sink + 2 recent
        assert mgr.audit() == 0  # the single-value keys are found: nothing is invalidated
        tip = res.node
        assert mgr.evict_blob(tip) and tip.blob is None
        assert store.get_skeleton(tip.skeleton.latent_locator) == "x0@4"
        assert not [k for k in store.keys() if k.startswith(f"{chain[4].hex()}:kv")]
        assert mgr.try_fast_forward(ROOT, ACTIONS, Window()).start_chunk == 4
    finally:
        store.close()


def test_a_restarted_localdisk_worker_restores_string_layers(tmp_path):
    store = make_store("localdisk", tmp_path)
    mgr = manager(NamespaceForest(), store)
    chain = ingest_all(mgr)
    snap = tmp_path / "forest.json"
    save_forest_snapshot(mgr.forest, snap)
    store.close()

    again = make_store("localdisk", tmp_path)  # a new process on the same root
    try:
        w = Window()
        res = manager(load_forest_snapshot(snap), again).try_fast_forward(ROOT, ACTIONS, w)
        assert res.start_chunk == 5 and w.depth == 4
        assert w.seeded[0] == [(d, payload(chain[d])[0]) for d in (0, 3, 4)]
    finally:
        again.close()
