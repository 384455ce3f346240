"""Conformance suite of the generic (per-layer) tiers: the same tests run against every tier.

A new generic tier joins by adding one entry to ``TIERS``: a name and a factory
``make(tmp_path) -> store``. Tests wrap ``store.backend`` (the `ValueBackend` the shared
`KeyValueTier` mechanism writes through) to inject slow or failing writes.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cacheseek.errors import StoreClosedError, WriteNotCompleteError
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

WAIT_S = 5.0  # upper bound of every wait; the tests themselves finish in milliseconds


def _memory(tmp_path):
    return InMemoryTierStore()


def _localdisk(tmp_path):
    return LocalDiskTierStore(str(tmp_path / "kv"))


def _localdisk_write_back(tmp_path):
    return LocalDiskTierStore(str(tmp_path / "kv"), write_back=True, queue_depth=2)


TIERS: dict[str, Callable[[Any], Any]] = {
    "memory": _memory,
    "localdisk": _localdisk,
    "localdisk-write-back": _localdisk_write_back,
}


@pytest.fixture(params=sorted(TIERS))
def store(request, tmp_path):
    s = TIERS[request.param](tmp_path)
    yield s
    s.close()


def is_write_back(store) -> bool:
    return store.write_back


# -- backend wrappers ---------------------------------------------------------------------------


class _Wrapper:
    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, value):
        self.inner.write(key, value)


class BlockingBackend(_Wrapper):
    """Every write waits for ``gate``; ``entered`` is set when the first write starts waiting."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, key, value):
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("test gate never opened")
        self.inner.write(key, value)


class FailingBackend(_Wrapper):
    """The ``fail_on``-th write (1-based) fails as a full disk would."""

    def __init__(self, inner, fail_on: int) -> None:
        super().__init__(inner)
        self.fail_on = fail_on
        self.writes = 0

    def write(self, key, value):
        self.writes += 1
        if self.writes == self.fail_on:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.inner.write(key, value)


# -- payloads -----------------------------------------------------------------------------------


def bf16_payload(n_layers: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layers):
        k = torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16)
        out.append((k, v))
    # bit patterns a float round trip could lose: -0.0, inf, NaN, a subnormal
    out[0][0].view(-1)[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40]).to(torch.bfloat16)
    return out


def clone_payload(payload):
    return [(k.clone(), v.clone()) for k, v in payload]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


LOC = "ab" * 32 + ":kv"


def put(store, payload, locator=LOC, on_ready=None):
    return store.put_async(locator, payload, tier=Tier.CPU, on_ready=on_ready)


# -- tests --------------------------------------------------------------------------------------


def test_put_async_makes_ready_and_calls_on_ready_once(store):
    calls = []
    payload = bf16_payload()
    h = put(store, clone_payload(payload), on_ready=calls.append)
    store.flush()
    assert h.ready and h.error is None
    assert len(calls) == 1 and calls[0] is h
    assert (h.locator, h.n_layers, h.tier) == (LOC, 2, Tier.CPU)
    assert h.nbytes == sum(k.nbytes + v.nbytes for k, v in payload)
    assert store.stats.puts == 1 and store.stats.pending_writes == 0


def test_get_layer_round_trips_bf16_bit_exact(store):
    payload = bf16_payload(n_layers=3)
    h = put(store, clone_payload(payload))
    store.flush()
    for i, (k, v) in enumerate(payload):
        got = store.get_layer(h, i)
        assert got is not None
        assert got[0].device.type == "cpu" and got[1].device.type == "cpu"
        assert same_bits(got[0], k) and same_bits(got[1], v)
    assert store.stats.gets == 3
    with pytest.raises(IndexError):
        store.get_layer(h, 3)


@pytest.mark.parametrize("parallelism", [1, 3])
def test_get_layers_reads_every_layer_in_order_and_stops_at_a_miss(store, parallelism):
    store.read_parallelism = parallelism
    payload = bf16_payload(n_layers=4)
    h = put(store, clone_payload(payload))
    store.flush()
    got = store.get_layers([(h, i) for i in range(4)])
    assert len(got) == 4 and all(same_bits(g[0], k) and same_bits(g[1], v) for g, (k, v) in zip(got, payload))
    store.backend.delete(layer_keys(LOC, 1)[1])
    got = store.get_layers([(h, i) for i in range(4)])
    assert got[0] is not None and got[1] is None  # later layers: not read (serial) or read meanwhile
    if parallelism == 1:
        assert got[2:] == [None, None]


def test_get_layers_overlaps_up_to_read_parallelism_reads(store):
    h = put(store, clone_payload(bf16_payload(n_layers=3)))
    store.flush()
    store.read_parallelism = 3
    meet = threading.Barrier(3, timeout=WAIT_S)  # passes only while 3 reads are in flight at once

    class Meeting(_Wrapper):
        def read(self, key, *args):
            meet.wait()
            return self.inner.read(key, *args)

    store.backend = Meeting(store.backend)
    assert all(g is not None for g in store.get_layers([(h, i) for i in range(3)]))


def test_string_payloads(store):
    h = put(store, [("k0", "v0"), ("k1", "v1")])
    store.flush()
    assert h.ready
    assert store.get_layer(h, 0) == ("k0", "v0")
    assert store.get_layer(h, 1) == ("k1", "v1")


@pytest.mark.parametrize("layers", [
    ["kv@0:L0", "kv@0:L1"],  # a string per layer, as upstream CacheSeek's tests and quickstart store
    [b"\x00raw", "text", 42, [1, "two", {"three": 3.0}]],  # any value the backend can hold
], ids=["strings", "mixed"])
def test_any_object_per_layer_round_trips_as_one_value(store, layers):
    h = put(store, layers)
    store.flush()
    assert h.ready and not h.pairs and h.n_layers == len(layers)
    assert [store.get_layer(h, i) for i in range(len(layers))] == layers
    assert sorted(k for k in store.keys() if k.startswith(LOC)) == [f"{LOC}:L{i}" for i in range(len(layers))]
    assert store.contains([f"{LOC}:L0", layer_keys(LOC, 0)[0]]) == [True, False]
    store.free(h)
    assert [store.get_layer(h, i) for i in range(len(layers))] == [None] * len(layers)
    assert not any(key.startswith(LOC) for key in store.keys()) and store.usage().used_bytes == 0


def test_kv_pairs_keep_two_values_per_layer(store):
    h = put(store, clone_payload(bf16_payload(n_layers=2)))
    store.flush()
    assert h.pairs
    assert sorted(k for k in store.keys() if k.startswith(LOC)) == sorted(
        key for layer in range(2) for key in layer_keys(LOC, layer))


def test_a_none_layer_is_refused_before_anything_is_written(store):
    with pytest.raises(ValueError, match="layer 1 is None"):
        put(store, ["a", None])
    store.flush()
    assert store.keys() == [] and store.usage().used_bytes == 0


@pytest.mark.parametrize("half", [0, 1], ids=["k-missing", "v-missing"])
def test_partial_layer_is_a_miss(store, half):
    h = put(store, [("k0", "v0"), ("k1", "v1")])
    store.flush()
    store.backend.delete(layer_keys(LOC, 1)[half])
    assert store.get_layer(h, 1) is None
    assert store.get_layer(h, 0) == ("k0", "v0")


def test_free_removes_values_and_is_idempotent(store):
    h = put(store, clone_payload(bf16_payload()))
    store.flush()
    store.free(h)
    for layer in range(h.n_layers):
        assert store.get_layer(h, layer) is None
        for key in layer_keys(LOC, layer):
            assert store.backend.read(key) is None
    store.free(h)  # idempotent
    assert not any(key.startswith(LOC) for key in store.keys())


def test_free_of_in_flight_blob_raises(store):
    if not is_write_back(store):
        # A write-through put returns only once the write is over, so no caller can hold an
        # in-flight handle of it; the guard itself is checked on a pending handle.
        pending = BlobHandle(tier=Tier.CPU, locator=LOC, nbytes=0, n_layers=1)
        with pytest.raises(WriteNotCompleteError):
            store.free(pending)
        return
    blocking = store.backend = BlockingBackend(store.backend)
    h = put(store, [("k0", "v0")])
    assert blocking.entered.wait(WAIT_S)
    assert h.in_flight
    with pytest.raises(WriteNotCompleteError):
        store.free(h)
    blocking.gate.set()
    store.flush()
    assert h.ready
    assert store.get_layer(h, 0) == ("k0", "v0")  # the refused free removed nothing
    store.free(h)
    assert store.get_layer(h, 0) is None


def test_skeleton_round_trip(store):
    latent = torch.randn(1, 4, 3, 2, 2).to(torch.bfloat16)
    store.put_skeleton("cd" * 32 + ":lat", latent.clone())
    got = store.get_skeleton("cd" * 32 + ":lat")
    assert same_bits(got, latent)
    assert store.get_skeleton("ef" * 32 + ":lat") is None
    store.put_skeleton("x:lat", "a latent")
    assert store.get_skeleton("x:lat") == "a latent"


def test_failed_write_leaves_handle_unready_and_nothing_stored(store):
    store.backend = FailingBackend(store.backend, fail_on=3)  # after K0, V0 succeeded
    calls = []
    h = put(store, clone_payload(bf16_payload()), on_ready=calls.append)  # never raises
    store.flush()
    assert not h.ready and not h.in_flight
    assert isinstance(h.error, OSError) and h.error.errno == errno.ENOSPC
    assert calls == []
    assert store.stats.failed_writes == 1 and store.stats.puts == 0
    assert "No space left" in store.stats.last_error
    assert store.stats.pending_writes == 0
    assert store.keys() == []
    for layer in range(2):
        assert store.get_layer(h, layer) is None
    store.free(h)  # a failed blob is droppable
    h2 = put(store, [("k0", "v0")])  # the store keeps working
    store.flush()
    assert h2.ready and store.get_layer(h2, 0) == ("k0", "v0")


def test_flush_waits_for_pending_writes(store):
    if not is_write_back(store):
        h = put(store, [("k0", "v0")])
        assert h.ready and store.stats.pending_writes == 0  # write-through: done on return
        store.flush()
        return
    blocking = store.backend = BlockingBackend(store.backend)
    handles = [put(store, [("k0", "v0")], locator=f"{i:064x}:kv") for i in range(2)]
    assert blocking.entered.wait(WAIT_S)
    assert not any(h.ready for h in handles)
    timer = threading.Timer(0.05, blocking.gate.set)
    timer.start()
    store.flush()
    timer.join()
    assert all(h.ready for h in handles)
    assert store.stats.pending_writes == 0 and store.stats.puts == 2


def test_close_flushes_and_is_idempotent(store):
    if is_write_back(store):
        blocking = store.backend = BlockingBackend(store.backend)
        h = put(store, [("k0", "v0")])
        assert blocking.entered.wait(WAIT_S)
        timer = threading.Timer(0.05, blocking.gate.set)
        timer.start()
    else:
        h = put(store, [("k0", "v0")])
    store.close()
    assert h.ready
    store.close()  # idempotent


def test_use_after_close_raises(store):
    h = put(store, [("k0", "v0")])
    store.flush()
    store.close()
    with pytest.raises(StoreClosedError):
        put(store, [("k1", "v1")])
    with pytest.raises(StoreClosedError):
        store.get_layer(h, 0)
    with pytest.raises(StoreClosedError):
        store.put_skeleton("x:lat", "lat")
    with pytest.raises(StoreClosedError):
        store.get_skeleton("x:lat")
    with pytest.raises(StoreClosedError):
        store.free(h)
