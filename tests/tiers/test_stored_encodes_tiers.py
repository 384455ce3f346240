"""A session's stored encode (`reuse.exact_prefix.encodes`) on every store and tier: written
through the small-value path, read back bit for bit (a Plan-style store by length, head then
body), counted in the store's usage; a head under another encode's name, or a body that does
not match its head, is a miss and removed; a store too full drops it."""

from __future__ import annotations

import pytest
import torch

from cacheseek.kv.locators import encode_locators
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import make_full_kv_config
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))
KINDS = ["memory", "localdisk", "hbm", "fluxon_plan", "tiered"]


@pytest.fixture(params=KINDS)
def manager(request, levels, tmp_path):
    kind = request.param
    if kind == "memory":
        store = InMemoryTierStore()
    elif kind == "localdisk":
        store = LocalDiskTierStore(str(tmp_path / "disk"))
    elif kind == "tiered":
        store, _ = levels("host", ("hbm", "fluxon_plan"))
    else:
        (store,), _ = levels("host", (kind,), tiered=False)
    yield WorldKVManager(NamespaceForest(), store, make_full_kv_config())
    if kind in ("memory", "localdisk"):
        store.close()


def _encode() -> torch.Tensor:
    return torch.randn((1, 7, 24), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _used(store) -> int:
    usage = store.usage()
    return usage.used_bytes if usage is not None else 0


def test_an_encode_round_trips_bit_for_bit_and_counts_in_the_store(manager):
    enc, t = manager.encodes, _encode()
    before = _used(manager.store)
    assert enc.read(KEY, "cpu") is None and manager.metrics.as_dict()["encodes_missing"] == 1
    assert enc.write(KEY, t)
    assert _used(manager.store) >= before + t.numel() * t.element_size()
    got = enc.read(KEY, "cpu")
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(_bits(got), _bits(t))
    m = manager.metrics.as_dict()
    assert (m["encodes_written"], m["encodes_loaded"]) == (1, 1)
    assert enc.read(OTHER, "cpu") is None  # another key: nothing
    enc.free(KEY)
    assert enc.read(KEY, "cpu") is None


def test_a_head_under_another_encodes_name_is_a_miss_and_removed(manager):
    enc = manager.encodes
    assert enc.write(KEY, _encode())
    assert enc.write(OTHER, _encode()[:, :3])
    store = manager.store
    head_loc, body_loc = encode_locators(KEY)
    other_head, _ = encode_locators(OTHER)
    raw = store.get_skeleton(other_head, nbytes=128) if store.reads_paths else store.get_skeleton(other_head)
    store.free_skeleton(head_loc)
    value = torch.frombuffer(bytearray(bytes(raw) if not isinstance(raw, torch.Tensor) else raw.cpu().numpy().tobytes()),
                             dtype=torch.uint8)
    store.put_skeleton(head_loc, value)
    assert enc.read(KEY, "cpu") is None
    assert manager.metrics.as_dict()["encodes_corrupt"] == 1
    assert enc.read(KEY, "cpu") is None and manager.metrics.as_dict()["encodes_missing"] >= 1  # removed
    got = enc.read(OTHER, "cpu")  # the other encode is untouched
    assert got is not None and torch.equal(_bits(got), _bits(_encode()[:, :3]))


def test_a_full_store_drops_the_encode(levels):
    (store,), _ = levels("host", ("fluxon_plan",), tiered=False, plan_bytes=64 << 10)
    manager = WorldKVManager(NamespaceForest(), store, make_full_kv_config())
    big = torch.zeros((1, 512, 1024), dtype=torch.bfloat16)  # 1 MiB: more than the store holds
    assert not manager.encodes.write(KEY, big)
    m = manager.metrics.as_dict()
    assert (m["encodes_dropped"], m["encodes_written"], m["evictions"]) == (1, 0, 0)
    assert manager.encodes.read(KEY, "cpu") is None


def test_a_second_writer_of_the_same_encode_leaves_it_readable(manager):
    """Two workers that both missed store the same bits under the same key."""
    enc, t = manager.encodes, _encode()
    assert enc.write(KEY, t)
    enc.write(KEY, t)
    got = enc.read(KEY, "cpu")
    assert got is not None and torch.equal(_bits(got), _bits(t))
