"""Issue 5 item 1: capacity accounting and automatic eviction.

- generic tiers count the bytes of their live values (KV and latents, in flight included), give
  them back on free or failure, refuse a write that does not fit before writing anything, track
  the peak; a reopened LocalDisk root counts its files;
- above the high watermark the manager evicts leaf-first, least recently used, down to the low
  watermark (exact LRU: a parent that becomes a leaf joins the queue), reclaiming the latents of
  dead subtrees; without ``free_skeleton`` evicted nodes keep their skeletons;
- pinned (sink) nodes, referenced nodes and writes in flight (and their parents) are never victims;
- a store write that reports `StoreFullError` makes room and is retried once; a second refusal
  drops the write (counted) and leaves no value behind;
- the Plan tier's capacity (its segment) is respected through the real embedded client;
- no forest lock is held while the store frees values; the clock is real by default;
- policies come from the `EVICTION_POLICIES` registry; the config section is typed and checked.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hydra.errors import ConfigCompositionException

from cacheseek.errors import ConfigError, StoreFullError
from cacheseek.eviction import Candidate, EvictionConfig, LruPolicy, make_policy
from cacheseek.orchestrator import build_stack
from cacheseek.registry import EVICTION_POLICIES
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVConfig, WorldKVManager
from cacheseek.reuse.exact_prefix.keys import layer_keys, node_key
from cacheseek.reuse.exact_prefix.types import NodeState, Tier
from cacheseek.stores.kv_tier import KeyValueTier
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import DictBackend, InMemoryTierStore

from prodkit import (
    ACTS,
    FULL,
    ROLLING,
    WAIT_S,
    acts,
    check_invariants,
    close_plan,
    cold_hashes,
    new_manager,
    nodes,
    plan_store,
    run_session,
    store_keys,
)

ROOT = b"R" * 32
CHUNK = 256  # a string chunk below: one layer of K and V (200 B) plus a latent (56 B)


def payload():
    return [("k" * 100, "v" * 100)]


LATENT = "l" * 56


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def manager(store, *, sink_chunks=0, high=0.9, low=0.7, clock=None, enabled=True):
    cfg = WorldKVConfig(window_chunks=0, sink_chunks=sink_chunks, break_even_k=1)
    return WorldKVManager(NamespaceForest(), store, cfg, clock=clock,
                          eviction=EvictionConfig(high_watermark=high, low_watermark=low, enabled=enabled))


def put_chain(mgr, actions, *, clock=None, start=None, parent=None):
    """Ingest a chain of string chunks under ``parent`` (default the root); returns the nodes."""
    ns = mgr.forest.get_or_create_namespace(ROOT, b"C")
    parent = parent or ns.root
    out = []
    for a in actions:
        if clock is not None:
            clock.t += 1
        node = mgr.ingest(ns, parent, a, node_key(parent.node_key, a), parent.depth + 1, payload(), LATENT)
        out.append(node)
        parent = node
    return out


# -- generic tiers account their bytes -----------------------------------------------------------


@pytest.fixture(params=["memory", "localdisk", "localdisk-write-back"])
def tier(request, tmp_path):
    if request.param == "memory":
        s = InMemoryTierStore(capacity_bytes=10_000)
    else:
        s = LocalDiskTierStore(str(tmp_path / "kv"), write_back=request.param.endswith("back"),
                               capacity_bytes=10_000)
    yield s
    s.close()


def tensors(n_layers=2, tokens=4):
    return [(torch.ones(1, tokens, 2, 4, dtype=torch.bfloat16), torch.zeros(1, tokens, 2, 4, dtype=torch.bfloat16))
            for _ in range(n_layers)]


def size(tier, key, value):
    """A value's bytes in the tier's unit: file bytes on LocalDisk, payload bytes elsewhere."""
    sized = getattr(tier.backend, "stored_nbytes", None)
    return sized(key, value) if sized else value.nbytes


def test_tier_counts_live_values_and_gives_them_back(tier):
    kv, latent = tensors(), torch.ones(1, 4, 3, 2, 4, dtype=torch.bfloat16)
    kv_bytes = sum(size(tier, key, t) for i, (k, v) in enumerate(kv)
                   for key, t in zip(layer_keys("aa:kv", i), (k, v)))
    lat_bytes = size(tier, "aa:lat", latent)
    tier.put_skeleton("aa:lat", latent)
    h = tier.put_async("aa:kv", kv, tier=Tier.CPU)
    tier.flush()
    u = tier.usage()
    assert (u.used_bytes, u.capacity_bytes, u.n_values) == (kv_bytes + lat_bytes, 10_000, 5)
    assert tier.contains(["aa:lat", "aa:kv:L0:k", "nope"]) == [True, True, False]
    tier.free(h)
    assert tier.usage().used_bytes == lat_bytes
    tier.free(h)  # idempotent: nothing counted twice
    tier.free_skeleton("aa:lat")
    tier.free_skeleton("aa:lat")
    u = tier.usage()
    assert u.used_bytes == 0 and u.peak_bytes == kv_bytes + lat_bytes and u.n_values == 0
    assert tier.stats.as_dict()["peak_bytes"] == u.peak_bytes
    assert tier.keys() == []


def test_full_tier_refuses_before_writing_anything(tier):
    kv = tensors()  # 256 B of payload (more in files on LocalDisk)
    used = sum(size(tier, key, t) for i, (k, v) in enumerate(kv) for key, t in zip(layer_keys("aa:kv", i), (k, v)))
    small = torch.ones(16, dtype=torch.bfloat16)
    tier.capacity_bytes = used + size(tier, "bb:lat", small) + 12
    h = tier.put_async("aa:kv", kv, tier=Tier.CPU)
    tier.flush()
    assert h.ready and tier.usage().used_bytes == used
    with pytest.raises(StoreFullError, match="full"):
        tier.put_async("bb:kv", tensors(), tier=Tier.CPU)
    with pytest.raises(StoreFullError):
        tier.put_skeleton("bb:lat", torch.ones(64, dtype=torch.bfloat16))
    tier.flush()
    assert tier.keys() == sorted(k for i in range(2) for k in layer_keys("aa:kv", i))
    assert tier.usage().used_bytes == used and tier.stats.pending_writes == 0
    assert tier.stats.refused_full == 2
    tier.put_skeleton("bb:lat", small)  # still fits
    assert tier.usage().used_bytes == used + size(tier, "bb:lat", small) <= tier.capacity_bytes


def test_failed_write_gives_its_bytes_back(tier):
    class Failing:
        def __init__(self, inner):
            self.inner, self.n = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def write(self, key, value):
            self.n += 1
            if self.n == 3:
                raise OSError(28, "No space left on device (injected)")
            self.inner.write(key, value)

    tier.backend = Failing(tier.backend)
    h = tier.put_async("aa:kv", tensors(), tier=Tier.CPU)
    tier.flush()
    assert h.error is not None and not h.ready
    assert tier.usage().used_bytes == 0 and tier.keys() == []


def test_overwrite_counts_only_the_difference():
    s = InMemoryTierStore(capacity_bytes=100)
    s.put_skeleton("x", b"a" * 60)
    s.put_skeleton("x", b"b" * 90)  # replaces: 90, not 150
    assert s.usage().used_bytes == 90
    s.put_skeleton("x", b"c" * 10)
    assert s.usage().used_bytes == 10 and s.usage().peak_bytes == 90


@pytest.mark.parametrize("bad", [-1, "lots", 1.5, True])
def test_capacity_must_be_null_or_a_non_negative_int(bad):
    with pytest.raises(ConfigError) as ei:
        InMemoryTierStore(capacity_bytes=bad)
    assert ei.value.field == "store.capacity_bytes"


def test_reopened_localdisk_counts_the_files_it_finds(tmp_path):
    s = LocalDiskTierStore(str(tmp_path / "kv"))
    s.put_async("aa:kv", tensors(), tier=Tier.DISK)
    s.put_skeleton("aa:lat", torch.ones(3, dtype=torch.bfloat16))
    before = s.usage().used_bytes
    s.free_skeleton("aa:lat")
    s.close()
    again = LocalDiskTierStore(str(tmp_path / "kv"), capacity_bytes=1 << 20)
    try:
        on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.name != ".lock")
        # one unit: file bytes, at write time and at reopen alike
        assert before == on_disk + size(again, "aa:lat", torch.ones(3, dtype=torch.bfloat16))
        assert again.usage().used_bytes == on_disk > 256
        assert again.usage().n_values == 4
    finally:
        again.close()


# -- the manager evicts leaf-first LRU between the watermarks ------------------------------------


def test_above_high_watermark_evicts_leaf_first_lru_down_to_low():
    clock = Clock()
    store = InMemoryTierStore(capacity_bytes=10 * CHUNK)  # high 2304 B, low 1792 B
    mgr = manager(store, clock=clock)
    a = put_chain(mgr, [b"a0", b"a1", b"a2"], clock=clock)
    b = put_chain(mgr, [b"b0", b"b1"], clock=clock)
    c = put_chain(mgr, [b"c0", b"c1", b"c2"], clock=clock)
    d = put_chain(mgr, [b"d0"], clock=clock)
    assert store.usage().used_bytes == 9 * CHUNK and mgr.metrics.evictions == 0  # at, not above, high
    d += put_chain(mgr, [b"d1"], clock=clock, parent=d[0])
    # 2560 > 2304: the oldest leaf a2 goes, then its parent a1 (now the oldest leaf), then a0;
    # each victim's latent is reclaimed with it (its subtree is dead); 1792 <= low: stop.
    assert [n.has_kv for n in a] == [False] * 3 and all(n.skeleton is None for n in a)
    assert all(n.has_kv and n.skeleton is not None for n in b + c + d)
    assert store.usage().used_bytes == 7 * CHUNK
    m = mgr.metrics.as_dict()
    assert (m["evictions"], m["skeletons_freed"], m["evicted_bytes"]) == (3, 3, 600)
    assert m["store_peak_bytes"] == 10 * CHUNK <= m["store_capacity_bytes"]
    assert check_invariants(mgr.forest, store.keys()) == []


def test_without_free_skeleton_evicted_nodes_keep_their_skeletons():
    class KeepsLatents(InMemoryTierStore):
        free_skeleton = None  # the capability is absent

    clock = Clock()
    store = KeepsLatents(capacity_bytes=10 * CHUNK)
    mgr = manager(store, clock=clock)
    a = put_chain(mgr, [b"a0", b"a1", b"a2"], clock=clock)
    b = put_chain(mgr, [b"b0", b"b1"], clock=clock)
    c = put_chain(mgr, [b"c0", b"c1", b"c2"], clock=clock)
    d = put_chain(mgr, [b"d0", b"d1"], clock=clock)
    # KV only (200 B each) comes back: a2, a1, a0, then b1 (the next least recently used leaf)
    assert [n.has_kv for n in a + b] == [False, False, False, True, False]
    assert all(n.skeleton is not None for n in a + b + c + d)
    assert all(n.has_kv for n in c + d)
    assert store.usage().used_bytes == 10 * CHUNK - 4 * 200 <= 0.7 * 10 * CHUNK


def test_unreachable_blobs_go_first():
    clock = Clock()
    store = InMemoryTierStore(capacity_bytes=100 * CHUNK)
    mgr = manager(store, clock=clock)
    a = put_chain(mgr, [b"a0", b"a1", b"a2"], clock=clock)
    b = put_chain(mgr, [b"b0"], clock=clock)
    a[0].blob.ready = False  # a0 lost its KV (e.g. invalidated): a1, a2 cannot be hit
    a[0].blob.error = RuntimeError("gone")
    order = [c.node for c in mgr.policy.order(mgr.evictor.collect()[1])]
    assert order == [a[2], b[0]]  # a2 (unreachable) before the older, reachable b0... b0 is the only other leaf
    clock.t = 100
    assert mgr.evictor.evict(0) == 3  # a2, then a1 joins (unreachable), then b0; a0 holds a failed handle
    assert not any(n.has_kv for n in a + b)


def test_lru_policy_orders_unreachable_then_oldest_then_deepest():
    def cand(t, depth, reachable=True):
        return Candidate(object(), 1, t, depth, reachable)

    c1, c2, c3, c4 = cand(5, 1), cand(1, 1), cand(1, 3), cand(9, 0, reachable=False)
    assert LruPolicy().order([c1, c2, c3, c4]) == [c4, c3, c2, c1]
    assert "lru" in EVICTION_POLICIES and isinstance(make_policy("lru"), LruPolicy)


def test_pinned_referenced_and_in_flight_are_never_victims():
    gate, entered = threading.Event(), threading.Event()

    class Gated(DictBackend):
        def write(self, key, value):
            if key.startswith(node_key(node_key(ROOT, b"x0"), b"p1").hex() + ":kv"):
                entered.set()
                assert gate.wait(WAIT_S)
            super().write(key, value)

    store = KeyValueTier(Gated(), write_back=True, queue_depth=8, capacity_bytes=100 * CHUNK)
    try:
        mgr = manager(store, sink_chunks=1)
        x0, r1 = put_chain(mgr, [b"x0", b"r1"])
        q1, = put_chain(mgr, [b"q1"], parent=x0)
        p1, = put_chain(mgr, [b"p1"], parent=x0)  # its write blocks in the write-back thread
        assert entered.wait(WAIT_S)
        r1.ref_count = 1  # being read
        assert x0.pinned and p1.blob.in_flight and q1.has_kv
        assert mgr.evictor.evict(0) == 1
        assert x0.has_kv and r1.has_kv and p1.blob.in_flight  # pinned, referenced, in flight
        assert not q1.has_kv
        r1.ref_count = 0
        gate.set()
        store.flush()
        assert p1.has_kv
    finally:
        gate.set()
        store.close()


def test_a_parent_of_an_in_flight_write_is_not_a_leaf():
    store = InMemoryTierStore(capacity_bytes=100 * CHUNK)
    mgr = manager(store)
    a0, a1 = put_chain(mgr, [b"a0", b"a1"])
    a1.blob.ready = False  # pretend the child's write is still in flight
    assert mgr.evictor.candidate(a0) is None and mgr.evictor.evict(0) == 0 and a0.has_kv


# -- store full: evict and retry once --------------------------------------------------------------


def test_store_full_makes_room_and_retries_once():
    store = InMemoryTierStore(capacity_bytes=4 * CHUNK)
    mgr = manager(store, high=1.0, low=1.0)  # the watermarks never fire: only a refusal evicts
    clock_nodes = put_chain(mgr, [b"a", b"b", b"c", b"d"])
    assert store.usage().used_bytes == 4 * CHUNK
    e, = put_chain(mgr, [b"e"])
    assert e.has_kv and not clock_nodes[-1].has_kv
    m = mgr.metrics.as_dict()
    assert m["store_full_retries"] == 1 and m["dropped_writes"] == 0 and m["evictions"] == 1
    assert store.usage().used_bytes <= 4 * CHUNK
    assert check_invariants(mgr.forest, store.keys()) == []


def test_second_refusal_drops_the_write_and_leaves_nothing():
    store = InMemoryTierStore(capacity_bytes=4 * CHUNK)
    mgr = manager(store, high=1.0, low=1.0)
    held = put_chain(mgr, [b"a", b"b", b"c", b"d"])
    for n in held:
        n.ref_count = 1  # all being read: nothing is evictable
    ns = mgr.forest.resolve(ROOT)
    with pytest.raises(StoreFullError):
        mgr.ingest(ns, ns.root, b"e", node_key(ROOT, b"e"), 0, payload(), LATENT)
    e = ns.root.children[b"e"]
    assert e.state is NodeState.EMPTY
    assert mgr.metrics.dropped_writes == 1 and mgr.metrics.dropped_writes == 1
    for n in held:
        n.ref_count = 0
    assert check_invariants(mgr.forest, store.keys()) == []
    assert all(n.has_kv for n in held)


def test_eviction_disabled_drops_instead():
    store = InMemoryTierStore(capacity_bytes=2 * CHUNK)
    mgr = manager(store, enabled=False)
    put_chain(mgr, [b"a", b"b"])
    with pytest.raises(StoreFullError):
        put_chain(mgr, [b"c"])
    assert mgr.metrics.evictions == 0 and mgr.metrics.dropped_writes == 1


# -- the Plan tier's capacity is its segment ---------------------------------------------------------


def test_plan_tier_capacity_is_respected_through_the_embedded_client():
    """Sessions of tensors through the binding into a segment that holds about 4 chunks: the
    client refuses what does not fit, the manager evicts, nothing escapes, all stays consistent.
    (Full-length attention: no sink chunk is pinned, so every chunk is evictable.)"""
    store, client = plan_store(segment_bytes=4 * 1280 + 512)  # tiny: 1024 B of KV + 256 B latent
    try:
        mgr = new_manager(store, FULL)
        for v in range(4):
            actions = acts(variant=v)
            b, rt, hashes = run_session(mgr, FULL, actions)
            assert hashes == cold_hashes(FULL, actions) and b.ingest_errors == 0
            u = client.usage()
            assert u.used_bytes <= u.capacity_bytes
        m = mgr.metrics.as_dict()
        assert m["evictions"] > 0 and m["dropped_writes"] == 0
        assert m["store_capacity_bytes"] == client.usage().capacity_bytes
        assert m["store_peak_bytes"] <= m["store_capacity_bytes"]
        assert check_invariants(mgr.forest, store_keys(store)) == []
        # the last session's prefix is still there and hits
        b, _, hashes = run_session(mgr, FULL, acts(variant=3), ingest=False)
        assert b.last_fast_forward > 0 and hashes == cold_hashes(FULL, acts(variant=3))
    finally:
        close_plan(store, client)


def test_pinned_sinks_stay_even_when_the_store_is_full():
    """Sink chunks are never victims: sessions with distinct first chunks pin one chunk each; once
    the pins fill the segment, later writes are dropped (counted), never a pinned blob evicted."""
    store, client = plan_store(segment_bytes=2 * 1280 + 512)
    try:
        mgr = new_manager(store, ROLLING)
        for v in range(3):
            b, _, hashes = run_session(mgr, ROLLING, acts(variant=v))
            assert hashes == cold_hashes(ROLLING, acts(variant=v))
        sinks = [n for n in nodes(mgr.forest) if n.depth == 0]
        assert all(n.pinned for n in sinks) and sum(n.has_kv for n in sinks) == 2
        assert mgr.metrics.dropped_writes > 0
        assert check_invariants(mgr.forest, store_keys(store)) == []
    finally:
        close_plan(store, client)


# -- locking, clock, config --------------------------------------------------------------------------


def test_the_forest_lock_is_free_while_the_store_frees_values():
    seen = []

    class Probe(InMemoryTierStore):
        def free(self, handle):
            got = []

            def probe():
                ok = mgr.forest.lock.acquire(timeout=2)
                got.append(ok)
                if ok:
                    mgr.forest.lock.release()

            t = threading.Thread(target=probe)
            t.start()
            t.join()
            seen.append(got[0])
            super().free(handle)

    store = Probe(capacity_bytes=3 * CHUNK)
    mgr = manager(store)
    put_chain(mgr, [b"a", b"b", b"c", b"d", b"e"])
    assert seen and all(seen)


def test_the_clock_is_real_by_default_and_injectable():
    mgr = manager(InMemoryTierStore())
    assert mgr.clock is time.monotonic
    before = time.monotonic()
    (n,) = put_chain(mgr, [b"a"])
    assert before <= n.last_access <= time.monotonic()
    clock = Clock()
    clock.t = 42.0
    mgr = manager(InMemoryTierStore(), clock=clock)
    (n,) = put_chain(mgr, [b"a"])
    assert n.last_access == 42.0


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(high_watermark=0.0), "manager.eviction.high_watermark"),
        (dict(high_watermark=1.5), "manager.eviction.high_watermark"),
        (dict(low_watermark="x"), "manager.eviction.low_watermark"),
        (dict(high_watermark=0.5, low_watermark=0.6), "manager.eviction.low_watermark"),
    ],
)
def test_eviction_config_is_checked(kw, field):
    with pytest.raises(ConfigError) as ei:
        EvictionConfig(**kw)
    assert ei.value.field == field


def test_unknown_policy_names_the_field_and_the_known_ones(compose_cfg, tmp_path):
    with pytest.raises(ConfigError) as ei:
        make_policy("fifo")
    assert ei.value.field == "manager.eviction.policy" and "lru" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        build_stack(compose_cfg("manager.eviction.policy=fifo"), run_dir=tmp_path)
    assert ei.value.field == "manager.eviction.policy"


@pytest.mark.parametrize("override", ["manager.eviction.hgh_watermark=0.5", "manager.eviction.low_watermark=low"])
def test_typos_in_the_new_sections_are_rejected_at_compose(compose_cfg, override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(*override.split())


def test_a_capacity_that_is_not_a_size_is_rejected_before_the_store_is_built(compose_cfg, tmp_path):
    cfg = compose_cfg("+store=memory", "store.capacity_bytes=lots")  # sizes are strings with units
    with pytest.raises(ConfigError) as ei:
        build_stack(cfg, run_dir=tmp_path)
    assert ei.value.field == "store.capacity_bytes" and "512MiB" in str(ei.value)


def test_the_config_reaches_the_store_and_the_managers(compose_cfg, tmp_path):
    cfg = compose_cfg("+store=memory", "store.capacity_bytes=4096", "manager.eviction.low_watermark=0.5")
    stack = build_stack(cfg, run_dir=tmp_path)
    try:
        assert stack.store.capacity_bytes == 4096
        mgr = stack.new_manager()
        assert (mgr.eviction.high_watermark, mgr.eviction.low_watermark) == (0.9, 0.5)
        assert mgr.metrics is stack.metrics and isinstance(mgr.policy, LruPolicy)
    finally:
        stack.close()


@pytest.mark.parametrize("kind", ["memory", "plan"])
def test_nodes_being_read_are_not_evicted_mid_restore(kind):
    """An eviction pass that runs while a restore is reading (another thread under pressure)
    takes nothing of the path being read; the restore completes, bit-identical to cold."""
    passes = []
    if kind == "memory":
        class Racing(InMemoryTierStore):
            def get_layer(self, handle, layer):
                if not passes:
                    passes.append(mgr.evictor.evict(0))
                return super().get_layer(handle, layer)

        store, client = Racing(), None
    else:
        store, client = plan_store()
        real = store.read_path

        def read_path(path, window, target):
            passes.append(mgr.evictor.evict(0))
            return real(path, window, target)

        store.read_path = read_path
    try:
        mgr = new_manager(store, FULL)
        run_session(mgr, FULL, ACTS)
        run_session(mgr, FULL, acts(variant=4))  # another chain: evictable while the first is read
        passes.clear()
        b, _, hashes = run_session(mgr, FULL, ACTS, ingest=False)
        assert passes == [len(ACTS)]  # the other chain went; the path being read stayed
        assert b.last_fast_forward == len(ACTS) and hashes == cold_hashes(FULL, ACTS)
    finally:
        if client is not None:
            close_plan(store, client)
        else:
            store.close()
