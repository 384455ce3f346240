"""Frames and decoder states are written off the request path (`TierStore.write_beside`).

A store whose put of a value beside a chunk blocks until the test releases it shows the
contract: the session returns while the write waits; the value is not findable until it is
whole; one more value of a kind than its bound (``frames_in_flight``,
``decoder_states_in_flight``) is dropped and counted, never waited for; a chunk freed during the
write leaves nothing; ``flush`` waits for the writer (bounded) and a closed store takes no write.
The decoder state is copied when it is captured: what the decoder does afterwards never reaches
the stored value.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cacheseek.errors import StoreTimeoutError
from cacheseek.kv import decoder_state as state_value
from cacheseek.kv.locators import decoder_state_locator, frames_locator
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.beside_writes import BesideWrites
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

N = 4


def acts(seed: int, n: int = N) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, generator=g).mul(2).sub(1).tolist() for _ in range(n)]


X = acts(0)


class GatedStore(InMemoryTierStore):
    """The memory tier whose puts of frames and decoder states wait for ``gate`` (KV and
    latents go through at once); ``started`` is set when such a put begins."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()

    def put_skeleton(self, locator: str, latent) -> None:
        if locator.endswith((":frm", ":dec")):
            self.started.set()
            assert self.gate.wait(10), "the test never opened the gate"
        super().put_skeleton(locator, latent)


def run(store, actions=X, *, every=0, in_flight=N):
    forest = NamespaceForest()
    manager = WorldKVManager(forest, store, make_full_kv_config(), frames_in_flight=in_flight,
                             decoder_states_in_flight=in_flight)
    b = LingBotWorldKVBinding(manager, forest, decoder_state_every=every)
    rt = SyntheticRuntimeFactory(geometry="tiny", local_attn_size=-1, sink_size=0, handout=True).make(actions, hooks=b)
    hashes = rt.generate()
    return b, forest, hashes


def leaves(forest):
    """The session's chunks, depth 0 first."""
    found = {n.depth: n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv}
    return [found[d] for d in sorted(found)]


def test_the_session_returns_while_its_frames_are_written_and_flush_waits_for_them():
    store = GatedStore()
    b, forest, _ = run(store)  # returns although every frames put is held at the gate
    nodes = leaves(forest)
    assert store.started.wait(5)
    assert not any(store.contains([frames_locator(n.node_key)])[0] for n in nodes)  # nothing half-written
    assert b.manager.metrics.frames_written == 0
    with pytest.raises(StoreTimeoutError):
        store.flush_beside(0.2)  # bounded: a stuck writer is named, never waited for forever
    store.gate.set()
    store.flush()
    assert all(store.contains([frames_locator(n.node_key)])[0] for n in nodes)
    assert b.manager.metrics.frames_written == N and b.manager.metrics.frames_dropped == 0
    store.close()


def test_one_more_value_than_the_writer_may_hold_is_dropped_and_counted():
    store = GatedStore()
    b, forest, _ = run(store, every=1, in_flight=1)
    m = b.manager.metrics
    assert m.frames_dropped == N - 1 and m.decoder_states_dropped == N - 1  # the first of each waits at the gate
    store.gate.set()
    store.flush()
    assert (m.frames_written, m.decoder_states_written) == (1, 1)
    nodes = leaves(forest)
    assert store.contains([frames_locator(nodes[0].node_key), decoder_state_locator(nodes[0].node_key)]) == [True, True]
    assert not any(store.contains([frames_locator(n.node_key)])[0] for n in nodes[1:])
    store.close()


def test_a_chunk_freed_while_its_values_are_written_leaves_nothing():
    store = GatedStore()
    b, forest, _ = run(store, every=1)
    leaf = leaves(forest)[-1]
    assert b.manager.evict_blob(leaf)  # its KV leaves while its frames and state wait at the gate
    store.gate.set()
    store.flush()
    assert store.contains([frames_locator(leaf.node_key), decoder_state_locator(leaf.node_key)]) == [False, False]
    assert b.manager.metrics.frames_written == N - 1  # the other chunks' are stored
    store.close()


def test_a_closed_store_takes_no_write():
    store = GatedStore()
    store.gate.set()
    b, forest, _ = run(store)
    store.close()  # flushes what the session wrote, then refuses
    leaf = leaves(forest)[-1]
    store.started.clear()
    dropped = b.manager.metrics.frames_dropped
    assert not b.manager.frames.write(leaf, torch.zeros(2, 3, 4, 4), "cpu")
    assert b.manager.metrics.frames_dropped == dropped + 1 and not store.started.is_set()


def test_in_flight_zero_writes_on_the_request_path(tmp_path):
    store = LocalDiskTierStore(root=str(tmp_path / "disk"))
    b, forest, _ = run(store, every=2, in_flight=0)
    m = b.manager.metrics  # no flush: already stored when the session returned
    assert (m.frames_written, m.decoder_states_written) == (N, N // 2)
    store.close()


def test_flush_returns_what_a_second_session_finds(tmp_path):
    store = LocalDiskTierStore(root=str(tmp_path / "disk"))
    forest = NamespaceForest()
    manager = WorldKVManager(forest, store, make_full_kv_config(), frames_in_flight=1)  # one in flight
    factory = SyntheticRuntimeFactory(geometry="tiny", local_attn_size=-1, sink_size=0, handout=True)
    cold = factory.make(X, hooks=None).generate()
    written = []
    for _ in range(3):  # a value dropped while busy is written by a later session of the same path
        b = LingBotWorldKVBinding(manager, forest)
        hashes = factory.make(X, hooks=b).generate()
        store.flush()
        assert hashes == cold
        written.append(manager.metrics.frames_written)
    assert written[-1] >= 1
    store.close()


def test_the_stored_state_is_the_one_captured_whatever_the_decoder_does_next():
    key = bytes(range(32))
    live = [torch.arange(40, dtype=torch.float32).reshape(2, 20), None, "Rep"]
    snap = state_value.snapshot(key, live)
    expect = live[0].clone()
    live[0].add_(1.0)  # the decoder's next chunk overwrites its state in place
    value = snap.seal()
    assert torch.equal(value, state_value.pack(key, [expect, None, "Rep"]))  # every byte, the digest too
    out = state_value.unpack(key, value, state_value.spec_of([expect, None, "Rep"]), "x:dec", "cpu")
    assert torch.equal(out[0], expect) and out[1:] == [None, "Rep"]


def test_the_writer_bounds_each_kind_and_gives_back_a_place_when_a_capture_fails():
    writes = BesideWrites("t")
    gate, ran = threading.Event(), []
    assert writes.submit(lambda: (lambda: (gate.wait(5), ran.append("a"))), kind="a", limit=1)
    captured = []
    assert not writes.submit(lambda: captured.append(1) or (lambda: None), kind="a", limit=1)
    assert captured == []  # refused before anything was captured
    assert writes.submit(lambda: (lambda: ran.append("b")), kind="b", limit=1)  # another kind has its own place

    def broken():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        writes.submit(broken, kind="c", limit=1)
    assert writes.in_flight("c") == 0
    gate.set()
    writes.flush(5)
    assert sorted(ran) == ["a", "b"] and writes.in_flight() == 0
    writes.close(5)
    assert not writes.submit(lambda: (lambda: None), kind="a", limit=1)


def test_flush_waits_for_a_slow_write():
    writes = BesideWrites("t")
    done = []
    writes.submit(lambda: (lambda: (time.sleep(0.2), done.append(1))), kind="a", limit=1)
    writes.flush(5)
    assert done == [1]
    writes.close(5)


@pytest.mark.cuda
def test_on_a_gpu_the_state_is_sealed_on_its_own_stream_while_the_model_runs():
    """The snapshot is queued on the decoder's stream and marked by an event; the seal (another
    thread) waits for that event only, never for the model's work queued after it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    key = bytes(range(32))
    live = [torch.randn(64, 1024, 1024, device=dev), None, "Rep"]  # 256 MiB
    snap = state_value.snapshot(key, live)
    expect = live[0].clone()
    live[0].add_(1.0)  # the next decode overwrites the state in place, after the snapshot's copy
    a = torch.randn(8192, 8192, device=dev)
    for _ in range(120):  # the model's queued work: a second or more
        a = a @ a / 8192 ** 0.5
    model_done = torch.cuda.Event()
    model_done.record()
    out: list = []
    t = threading.Thread(target=lambda: out.append(snap.seal()))
    t.start()
    t.join(60)
    assert out and not model_done.query()  # sealed while the model's work still runs
    torch.cuda.synchronize()
    assert torch.equal(out[0], state_value.pack(key, [expect, None, "Rep"]))
