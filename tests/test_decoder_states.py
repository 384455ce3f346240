"""The decoder's state stored at resume points (``decoder_state_every``), on the synthetic runtime.

A session that computes stores its decoder's state after chunks N-1, 2N-1, ... beside their KV
(``{hex}:dec``); a later session that served chunks 0..k-1 from frames and computes chunk k loads
the nearest stored state at or below k-1 and decodes only the latents after it. Every frame equals
a cold run's, bit for bit; a damaged or misplaced state is a miss (removed) and the decoder is
rebuilt by replay, never loaded wrong; the state counts in capacity and leaves with its chunk.
"""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError, CorruptValueError
from cacheseek.kv import decoder_state as state_value
from cacheseek.kv.locators import decoder_state_locator
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.decoder_states import resume_points
from cacheseek.reuse.exact_prefix.handout import NextChunk
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

N = 6
FULL, ROLLING = (-1, 0), (7, 3)


def acts(seed: int, n: int = N) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, generator=g).mul(2).sub(1).tolist() for _ in range(n)]


X = acts(0)


def fork(k: int) -> list[list[float]]:
    return X[:k] + acts(k + 10)[k:]


def factory(mode) -> SyntheticRuntimeFactory:
    return SyntheticRuntimeFactory(geometry="tiny", local_attn_size=mode[0], sink_size=mode[1], handout=True)


def session(store, forest, mode, actions, every, *, streamed=False):
    cfg = make_full_kv_config() if mode[0] == -1 else make_rolling_config(local_attn_size=mode[0], sink_size=mode[1])
    # written off the request path: room for every chunk's values (this runtime outpaces the writer)
    manager = WorldKVManager(forest, store, cfg, frames_in_flight=N, decoder_states_in_flight=N)
    b = LingBotWorldKVBinding(manager, forest, decoder_state_every=every)
    rt = factory(mode).make(actions, hooks=b, streamed=streamed)
    hashes = rt.generate()
    store.flush()  # what the session wrote beside its chunks, in the store before the next looks
    return b, rt, hashes


def cold(mode, actions):
    return factory(mode).make(actions, hooks=None).generate()


def nodes(forest) -> dict:
    return {n.depth: n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv}


@pytest.fixture(params=["memory", "localdisk"])
def store(request, tmp_path):
    s = InMemoryTierStore() if request.param == "memory" else LocalDiskTierStore(root=str(tmp_path / "disk"))
    yield s
    s.close()


def test_resume_points_are_the_nearest_first():
    assert resume_points(0, 8) == [] and resume_points(4, 3) == []
    assert resume_points(4, 8) == [7, 3] and resume_points(2, 5) == [3, 1] and resume_points(1, 3) == [2, 1, 0]


@pytest.mark.parametrize("every,k,replayed", [(1, 2, 0), (2, 2, 0), (3, 2, 2), (3, 4, 1), (2, 5, 1), (0, 4, 4)])
@pytest.mark.parametrize("mode", [FULL, ROLLING], ids=["full", "L7S3"])
def test_divergence_loads_the_nearest_stored_state_and_replays_the_rest(store, mode, every, k, replayed):
    forest = NamespaceForest()
    a, _, hashes_a = session(store, forest, mode, X, every)
    assert hashes_a == cold(mode, X)
    written = a.manager.metrics.as_dict()["decoder_states_written"]
    assert written == (sum((j + 1) % every == 0 for j in range(N)) if every else 0)
    c, rt, hashes_c = session(store, forest, mode, fork(k), every)
    assert hashes_c == cold(mode, fork(k))
    m = c.manager.metrics.as_dict()
    assert c.frames_served == k and c.chunks_materialized == k
    assert m["decoder_replays"] == replayed and m["decoder_states_restored"] == (replayed < k)


def test_live_sessions_load_the_stored_state(store):
    forest = NamespaceForest()
    session(store, forest, FULL, X, 2, streamed=True)
    c, _, hashes = session(store, forest, FULL, fork(4), 2, streamed=True)
    assert hashes == cold(FULL, fork(4))
    m = c.manager.metrics.as_dict()
    assert (c.frames_served, m["decoder_states_restored"], m["decoder_replays"]) == (4, 1, 0)


def test_without_loading_the_stored_state_the_computed_frames_differ(store, monkeypatch):
    """The negative control: the state found but not loaded (only the chunks after it decoded)
    gives the computed chunk other frames, so the tests above see the state that was loaded."""
    forest = NamespaceForest()
    session(store, forest, FULL, X, 2)
    real = LingBotWorldKVBinding.next_chunk

    def unloaded(self, runtime, idx, spec, **kw):
        plan = real(self, runtime, idx, spec, **kw)
        if plan.late_state is not None:
            assert plan.late_state.result()[1] is not None  # found (and never loaded)
        return NextChunk(frames=plan.frames, replay=plan.replay, replay_from=plan.replay_from,
                         recompute=plan.recompute)

    monkeypatch.setattr(LingBotWorldKVBinding, "next_chunk", unloaded)
    c, _, hashes = session(store, forest, FULL, fork(4), 2)
    expect = cold(FULL, fork(4))
    assert c.manager.metrics.as_dict()["decoder_states_restored"] == 1
    assert hashes[:4] == expect[:4] and hashes[4] != expect[4]


def test_a_damaged_state_is_a_miss_and_the_decoder_is_rebuilt():
    store = InMemoryTierStore()
    forest = NamespaceForest()
    session(store, forest, FULL, X, 2)
    loc = decoder_state_locator(nodes(forest)[3].node_key)
    value = store.backend.read(loc)
    value[-9] ^= 0x01  # a byte of the state's body
    c, _, hashes = session(store, forest, FULL, fork(4), 2)
    assert hashes == cold(FULL, fork(4))
    m = c.manager.metrics.as_dict()
    assert m["decoder_states_corrupt"] == 1 and store.backend.read(loc) is None
    assert m["decoder_states_restored"] == 1 and m["decoder_replays"] == 2  # the next lower one: after chunk 1
    store.close()


def test_a_state_under_another_chunks_key_is_a_miss(store):
    forest = NamespaceForest()
    session(store, forest, FULL, X, 2)
    n = nodes(forest)
    store.put_skeleton(decoder_state_locator(n[3].node_key), store.get_skeleton(decoder_state_locator(n[1].node_key)))
    store.free_skeleton(decoder_state_locator(n[1].node_key))
    c, _, hashes = session(store, forest, FULL, fork(4), 2)
    assert hashes == cold(FULL, fork(4))
    m = c.manager.metrics.as_dict()
    assert (m["decoder_states_corrupt"], m["decoder_states_missing"], m["decoder_states_restored"]) == (1, 1, 0)
    assert m["decoder_replays"] == 4


def test_a_state_counts_in_capacity_and_leaves_with_its_chunk():
    store = InMemoryTierStore()
    forest = NamespaceForest()
    b, _, _ = session(store, forest, FULL, X, 1)
    m = b.manager.metrics.as_dict()
    assert m["decoder_states_written"] == N and m["decoder_state_write_bytes"] > 0
    assert store.usage().used_bytes >= b.bytes_written + m["frames_write_bytes"] + m["decoder_state_write_bytes"]
    leaf = nodes(forest)[N - 1]
    loc = decoder_state_locator(leaf.node_key)
    assert store.contains([loc])[0]
    assert b.manager.evict_blob(leaf)
    assert not store.contains([loc])[0]
    store.close()


@pytest.mark.parametrize("check", ["xxh3", "sums"])
def test_the_value_checks_its_key_table_and_body(check, monkeypatch):
    """On a CPU the body's check is its xxh3; a value packed on a GPU carries two position-weighted
    sums computed there (forced here on the CPU, in blocks of 16 words so that several blocks and
    their weights take part)."""
    if check == "sums":
        monkeypatch.setattr(state_value, "BLOCK_WORDS", 16)
    key, other = bytes(range(32)), bytes(32)
    entries = [None, "Rep", torch.randn(1, 4, 2, 3, 5).to(torch.bfloat16), torch.randn(3, 7)]
    spec = state_value.spec_of(entries)
    value = state_value.pack(key, entries, check=check)
    assert value.numel() == state_value.packed_nbytes(spec)
    back = state_value.unpack(key, bytes(value.numpy()), spec, "v", "cpu")
    assert back[:2] == [None, "Rep"] and torch.equal(back[2], entries[2]) and torch.equal(back[3], entries[3])
    assert value[60].item() == (1 if check == "sums" else 2)
    bad = [(other, value, spec), (key, value[:-64], spec),
           (key, value, state_value.spec_of([None, "Rep", entries[2], torch.randn(3, 8)]))]
    for pos in range(0, value.numel(), 37):
        flipped = value.clone()
        flipped[pos] ^= 0x10
        bad.append((key, flipped, spec))
    head = value.numel() - spec.body_nbytes
    swapped = value.clone()  # two body words swapped: each word still there, in the wrong place
    swapped[head:head + 8], swapped[head + 136:head + 144] = value[head + 136:head + 144].clone(), value[head:head + 8].clone()
    assert not torch.equal(swapped, value)
    bad.append((key, swapped, spec))
    signs = value.clone()  # the sign bit of two body words flipped: 2**63 twice, 0 to a plain sum
    signs[head + 7] ^= 0x80
    signs[head + 15] ^= 0x80
    bad.append((key, signs, spec))
    for k, v, s in bad:
        with pytest.raises(CorruptValueError):
            state_value.unpack(k, v, s, "v", "cpu")


def test_decoder_state_every_is_checked():
    forest = NamespaceForest()
    manager = WorldKVManager(forest, InMemoryTierStore(), make_full_kv_config())
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="manager.decoder_state_every"):
            LingBotWorldKVBinding(manager, forest, decoder_state_every=bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_state_packed_on_the_gpu_checks_there_and_on_the_host_alike():
    """A value packed on a GPU carries the sums, computed there; the same sums computed on the host
    agree (the value may be read where it was not written), its body restores bit-exactly on
    either device, and a byte flipped on the device is caught."""
    key = bytes(range(32))
    entries = [None, "Rep", torch.randn(2, 96, 2, 60, 104, device="cuda"), torch.randn(5, 7, device="cuda").bfloat16()]
    spec = state_value.spec_of(entries)
    value = state_value.pack(key, entries)
    head = value.numel() - spec.body_nbytes
    assert state_value.body_sums(value[head:]) == state_value.body_sums(value[head:].cpu())
    for device in ("cuda", "cpu"):
        back = state_value.unpack(key, value, spec, "v", device)
        assert all(torch.equal(b.cpu(), e.cpu()) for b, e in zip(back[2:], entries[2:]))
    flipped = value.clone()
    flipped[head + 12345] ^= 0x01
    with pytest.raises(CorruptValueError):
        state_value.unpack(key, flipped, spec, "v", "cuda")


def test_a_finished_session_frees_its_runtime_without_the_cycle_collector(store):
    """A runtime holds the binding and its decoder; a binding that kept the decoder (or a decoder
    that held its runtime strongly) would make a cycle only the collector frees. On a GPU that left
    each finished session's ring (14 GiB at 480p) allocated until a collection: out of memory."""
    import gc
    import weakref

    forest = NamespaceForest()
    session(store, forest, FULL, X, 2)
    gc.collect()
    gc.disable()
    try:
        b, rt, hashes = session(store, forest, FULL, fork(3), 2)  # served, then diverges: a replay
        assert b.frames_served == 3 and hashes == cold(FULL, fork(3))
        ref = weakref.ref(rt)
        del rt, b
        assert ref() is None
    finally:
        gc.enable()
