"""The tiered store's roles, each without the facade: building and describing the levels, the
residency record (locating a snapshot's blob, settling writes), reading a generic level,
demotion and removal over two in-memory levels, and the stats."""

from __future__ import annotations

import logging

import pytest
import torch

from cacheseek.errors import ConfigError, LayoutMismatchError, StoreError, WriteNotCompleteError
from cacheseek.kv.handles import BlobHandle, Tier
from cacheseek.kv.locators import blob_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.stores.memory import InMemoryTierStore
from cacheseek.stores.tiered import demotion, levels as levels_mod, residency, write
from cacheseek.stores.tiered.generic_level import as_tensors, cpu_snapshot, device_of, read_generic
from cacheseek.stores.tiered.levels import (
    Level,
    build_stores,
    close_levels,
    make_levels,
    shared_transfer,
    storage_format,
)
from cacheseek.stores.tiered.residency import Copies, Residency, TieredHandle, latent_of
from cacheseek.metrics import store_stats
from cacheseek.stores.base import as_store
from cacheseek.stores.tiered.stats import TieredStats, tier_usages, tiered_stats
from plan_testkit import ingest, restore_target

FULL = RingGeometry(chunk_size=3, frame_tokens=2)
LOC = "ab" * 32 + ":kv"
LAT = "ab" * 32 + ":lat"


class PathStore:
    """Looks like a path level (restores the ring itself, takes device views)."""

    accepts_device_views = True
    storage_format = "raw"

    def read_path(self, path, window, target):  # pragma: no cover - never called here
        return False


class KeysStore:
    """A level that holds ``keys`` and answers ``contains``, counting the questions."""

    def __init__(self, keys=(), fail: bool = False):
        self.keys, self.fail, self.asked = set(keys), fail, 0

    def contains(self, keys):
        self.asked += 1
        if self.fail:
            raise OSError("cannot tell")
        return [k in self.keys for k in keys]


def book_of(*stores, names=None) -> Residency:
    names = names or [f"l{i}" for i in range(len(stores))]
    return Residency(make_levels(list(zip(names, stores))))


def kv(n_layers: int = 2, fill: float = 1.0):
    return [(torch.full((2, 3), fill + i), torch.full((2, 3), -fill - i)) for i in range(n_layers)]


# -- levels ---------------------------------------------------------------------------------------

def test_levels_know_their_tier_and_whether_they_restore_the_ring():
    lv = make_levels([("hbm", PathStore()), ("localdisk", KeysStore()), ("custom", KeysStore())])
    assert [(x.index, x.tier, x.path) for x in lv] == [
        (0, Tier.HBM_STAGING, True), (1, Tier.DISK, False), (2, Tier.CPU, False)]
    with pytest.raises(ConfigError, match="store.tiers"):
        make_levels([])


def test_building_levels_rejects_bad_lists_and_closes_what_it_built(monkeypatch):
    with pytest.raises(ConfigError, match="lists a store twice"):
        build_stores(["memory", "memory"], {}, None)
    with pytest.raises(ConfigError, match="unknown tier 'nope'.*use some of: .*memory"):
        build_stores(["nope"], {}, None)
    with pytest.raises(ConfigError, match="unknown tier 'tiered'"):
        build_stores(["tiered"], {}, None)
    closed, seen = [], []

    class Built:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

    def fake_instantiate(node, transfer):
        seen.append((node, transfer))
        return Built(node["_target_"])

    monkeypatch.setattr(levels_mod, "instantiate", fake_instantiate)
    nodes = {"memory": {"_target_": "m"}, "per_tensor": {"_target_": "p"}}
    with pytest.raises(ConfigError, match="tier 'localdisk' has no config node"):
        build_stores(["memory", "per_tensor", "localdisk"], nodes, "T")
    assert closed == ["p", "m"] and seen == [({"_target_": "m"}, "T"), ({"_target_": "p"}, "T")]
    built = build_stores(["per_tensor"], nodes, "T")
    assert [(n, s.name) for n, s in built] == [("per_tensor", "p")]


def test_the_storage_format_is_shared_when_the_levels_agree_else_names_each():
    assert storage_format(make_levels([("hbm", PathStore()), ("fluxon_plan", PathStore())])) == "raw"
    mixed = make_levels([("hbm", PathStore()), ("x", KeysStore())])
    assert storage_format(mixed) == f"cacheseek.tiered.v1[hbm=raw,x={__name__}.KeysStore]"


def test_close_levels_closes_last_first_and_goes_on_after_a_failure(caplog):
    order = []

    class Closing:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            order.append(self.name)
            if self.fail:
                raise OSError("stuck")

    lv = make_levels([("a", Closing("a")), ("b", Closing("b", fail=True)), ("c", object())])
    with caplog.at_level(logging.WARNING, logger="cacheseek"):
        close_levels(lv)
    assert order == ["b", "a"] and "closing b failed: stuck" in caplog.text


def test_the_shared_transfer_is_the_given_one_else_the_first_levels():
    class WithTransfer:
        transfer = "T1"

    lv = make_levels([("a", object()), ("b", WithTransfer())])
    assert shared_transfer(None, lv) == "T1" and shared_transfer("T0", lv) == "T0"
    assert shared_transfer(None, make_levels([("a", object())])) is None


# -- residency ------------------------------------------------------------------------------------

def test_a_snapshot_blob_is_located_once_in_the_levels_holding_all_of_it(caplog):
    keys = blob_keys(LOC, 2)
    top, mid, low = KeysStore(keys[:1]), KeysStore(fail=True), KeysStore(keys)
    book = book_of(top, mid, low, names=["hbm", "fluxon_plan", "localdisk"])
    handle = BlobHandle(Tier.HBM_STAGING, LOC, 64, 2, ready=True)
    with caplog.at_level(logging.WARNING, logger="cacheseek"):
        rec = book.copies(handle)
    assert "fluxon_plan cannot say whether it holds" in caplog.text
    assert list(rec.at) == [2] and rec.at[2].ready and rec.at[2].tier is Tier.DISK
    assert handle.tier is Tier.DISK  # the outer handle names the nearest level holding it
    assert book.copies(handle) is rec and low.asked == 1
    assert book.levels_of(handle) == (2,) and book.pending_levels_of(handle) == ()


def test_the_first_ready_copy_publishes_the_outer_handle_once():
    book = book_of(KeysStore(), KeysStore(), names=["hbm", "localdisk"])
    outer = TieredHandle(Tier.HBM_STAGING, LOC, 64, 2)
    published = []
    rec = Copies(outer, on_ready=published.append)
    for level in (1, 0):
        book.settle(rec, level, BlobHandle(book.levels[level].tier, LOC, 64, 2))
    assert set(book.pending) == {id(rec)} and not outer.ready
    book.on_level_ready(rec, 1, None)
    assert published == [outer] and outer.ready and outer.tiers == (Tier.DISK,) and outer.tier is Tier.DISK
    book.on_level_ready(rec, 0, None)
    assert published == [outer] and outer.tiers == (Tier.HBM_STAGING, Tier.DISK)
    assert [lv.counters["writes"] for lv in book.levels] == [1, 1]
    book.reap()
    assert book.pending == {}


def test_reap_drops_failed_copies_and_fails_a_blob_with_none_left():
    book = book_of(KeysStore(), KeysStore())
    outer = TieredHandle(Tier.CPU, LOC, 64, 2)
    rec = Copies(outer)
    with book.lock:
        book.blobs[LOC] = rec
    copies = [BlobHandle(Tier.CPU, LOC, 64, 2) for _ in range(2)]
    for level, h in enumerate(copies):
        book.settle(rec, level, h)
    copies[0].error = OSError("first")
    book.reap()
    assert list(rec.at) == [1] and outer.error is None and id(rec) in book.pending
    copies[1].error = OSError("second")
    book.reap()
    assert rec.at == {} and isinstance(outer.error, OSError) and LOC not in book.blobs
    assert [lv.counters["write_failures"] for lv in book.levels] == [1, 1] and book.pending == {}


def test_latent_of_names_the_chunks_latent():
    assert latent_of(LOC) == LAT and latent_of("something-else") is None


# -- generic levels -------------------------------------------------------------------------------

def test_a_cpu_snapshot_is_made_once_and_owns_its_values():
    layers = kv(1)
    cache: list = []
    snap = cpu_snapshot(layers, cache)
    assert cpu_snapshot(layers, cache) is snap
    layers[0][0].fill_(99)
    assert snap[0][0][0, 0].item() == 1.0 and cpu_snapshot(["text"], []) == ["text"]


def test_raw_bytes_become_flat_uint8_tensors_and_devices_are_inferred():
    k, v = as_tensors((b"\x01\x02", bytearray(b"\x03")))
    assert k.dtype is torch.uint8 and k.tolist() == [1, 2] and v.tolist() == [3]

    class Cuda:
        class transfer:
            device_kind = "cuda"

    class OnDevice:
        device = "cuda:1"

    assert device_of(as_store(Cuda())) == "cuda" and device_of(as_store(OnDevice())) == "cuda:1"
    assert device_of(as_store(object())) == "cpu"


def test_a_generic_level_restores_a_path_or_changes_nothing():
    store = InMemoryTierStore()
    try:
        nodes, states, latents, kv_size = ingest(store, FULL, 2)
        target = restore_target(FULL, 2, kv_size)
        assert read_generic(store, nodes, nodes, target)
        ring, local_end, _ = states[1]
        assert all(torch.equal(t[:, :local_end], r[:, :local_end]) for pair, rp in zip(target.kv, ring)
                   for t, r in zip(pair, rp))
        assert all(torch.equal(got, want) for got, want in zip(target.latents, latents))

        store.free_skeleton(nodes[1].skeleton.latent_locator)
        empty = restore_target(FULL, 2, kv_size)
        assert not read_generic(store, nodes, nodes, empty)
        assert all(not t.any() for pair in empty.kv for t in pair) and not any(x.any() for x in empty.latents)

        store.put_skeleton(nodes[1].skeleton.latent_locator, torch.zeros(3))
        with pytest.raises(LayoutMismatchError, match="its target takes"):
            read_generic(store, nodes, nodes, empty)
        assert not any(x.any() for x in empty.latents)
    finally:
        store.close()


# -- demotion and removal over two generic levels -------------------------------------------------

@pytest.fixture
def two_memories():
    made = []

    def _make(low_bytes=None):
        top, low = InMemoryTierStore(), InMemoryTierStore(capacity_bytes=low_bytes)
        made.extend([top, low])
        return Residency(make_levels([("memory", top), ("per_tensor", low)])), top, low

    yield _make
    for store in made:
        store.close()


def test_demotion_writes_the_blob_and_its_latent_below_then_frees_them_above(two_memories):
    book, top, low = two_memories()
    handle = write.put_chunk(book, LOC, kv(), write_through=False)
    top.put_skeleton(LAT, torch.ones(4))
    book.add_latent(LAT, 0)
    assert book.levels_of(handle) == (0,)
    assert demotion.demote(book, handle, 0)
    assert book.levels_of(handle) == (1,) and handle.tier is Tier.CPU
    assert top.contains(blob_keys(LOC, 2) + [LAT]) == [False] * 5
    assert all(low.contains(blob_keys(LOC, 2) + [LAT]))
    assert book.latent_levels(LAT) == (1,)
    assert torch.equal(low.get_layer(BlobHandle(Tier.CPU, LOC, 0, 2), 1)[0], kv()[1][0])
    assert book.levels[0].counters["demotions"] == 1 and book.levels[1].counters["demoted_in"] == 1
    assert not demotion.demote(book, handle, 1)  # the last level's only copy: eviction, not demotion
    assert not demotion.demote(book, handle, 0)  # not held there any more


def test_demotion_changes_nothing_when_no_level_below_takes_the_blob(two_memories):
    book, top, low = two_memories(low_bytes=8)
    handle = write.put_chunk(book, LOC, kv(), write_through=False)
    assert not demotion.demote(book, handle, 0)
    assert book.levels_of(handle) == (0,) and all(top.contains(blob_keys(LOC, 2)))
    assert book.levels[0].counters["demotion_failures"] == 1


def test_removal_tries_every_level_and_keeps_the_copy_that_failed(two_memories):
    book, top, low = two_memories()
    handle = write.put_chunk(book, LOC, kv(), write_through=True)
    assert book.levels_of(handle) == (0, 1)

    def broken(h):
        raise StoreError("cannot remove")

    top.free = broken
    with pytest.raises(StoreError, match="cannot remove"):
        residency.free_blob(book, handle)
    assert book.levels_of(handle) == (0,) and not any(low.contains(blob_keys(LOC, 2)))
    del top.free
    residency.free_blob(book, handle)
    assert LOC not in book.blobs and not any(top.contains(blob_keys(LOC, 2)))
    residency.free_blob(book, handle)  # idempotent


def test_removal_refuses_a_blob_with_a_write_in_flight(two_memories):
    book, top, low = two_memories()
    rec = Copies(TieredHandle(Tier.CPU, LOC, 64, 2))
    with book.lock:
        book.blobs[LOC] = rec
    book.settle(rec, 1, BlobHandle(Tier.CPU, LOC, 64, 2))
    with pytest.raises(WriteNotCompleteError):
        residency.free_blob(book, rec.outer)


def test_a_latent_is_removed_from_every_level_and_forgotten(two_memories):
    book, top, low = two_memories()
    write.put_latent(book, LAT, torch.ones(4))
    assert book.latent_levels(LAT) == (0, 1)
    residency.free_latent(book, LAT)
    assert book.latent_levels(LAT) == () and LAT not in book.latents and LAT not in book.probed
    assert top.contains([LAT]) == low.contains([LAT]) == [False]


# -- stats ----------------------------------------------------------------------------------------

def test_stats_rows_sum_into_the_report_totals(two_memories):
    book, top, low = two_memories()
    write.put_chunk(book, LOC, kv(), write_through=True)
    usages = tier_usages(book, closed=False)
    assert [(u.level, u.name, u.blobs) for u in usages] == [(0, "memory", 1), (1, "per_tensor", 1)]
    assert all(u.usage.used_bytes > 0 for u in usages)
    assert [u.usage for u in tier_usages(book, closed=True)] == [None, None]
    book.count(1, write_failures=2)
    d = tiered_stats(book, usages).as_dict()
    assert d["puts"] == 1 and d["put_failures"] == 2 and d["pending_writes"] == 0
    assert [r["store"]["puts"] for r in d["tiers"]] == [1, 1]
    rows = [dict(store={"pending_writes": 2, "register_seconds": 0.5}), dict(store={}, write_failures=1)]
    assert TieredStats({"puts": 0}, rows).as_dict() == dict(puts=0, tiers=rows, put_failures=1,
                                                            pending_writes=2, register_seconds=0.5)


def test_a_levels_own_stats_are_read_defensively():
    class Raises:
        @property
        def stats(self):
            raise RuntimeError("closed")

    class Plain:
        stats = {"hits": 1}

    assert store_stats(Raises()) == {} and store_stats(Plain()) == {"hits": 1} and store_stats(object()) == {}
    assert isinstance(Level(0, "x", as_store(object())).counters, dict)
