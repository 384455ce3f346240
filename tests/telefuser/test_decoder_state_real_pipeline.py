"""The Wan decoder's causal cache stored at resume points, on TeleFuser's real pipeline (the
release's seams, its Wan VAE, tiny): a session that served chunks 0..k-1 from frames loads the
cache stored after chunk k-1 (``decoder_state_every``) instead of decoding the served latents, and
its computed chunk's frames equal a cold run's bit for bit; the layout predicted by a dry decode
is the cache's after every chunk; a damaged stored cache is a miss (removed) and the decoder is
rebuilt by replay, never loaded wrong."""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.telefuser

pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")

from cacheseek.integrations.telefuser.handout import WanDecoder  # noqa: E402
from cacheseek.kv.decoder_state import spec_of  # noqa: E402
from cacheseek.kv.locators import decoder_state_locator  # noqa: E402
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager  # noqa: E402
from cacheseek.reuse.exact_prefix.decoder_states import ChunkDecoderStates  # noqa: E402
from cacheseek.reuse.exact_prefix.handout import NextChunk  # noqa: E402
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config  # noqa: E402
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory  # noqa: E402
from cacheseek.stores.memory import InMemoryTierStore  # noqa: E402

ROOM = {"frames_in_flight": 8, "decoder_states_in_flight": 8}  # written off the request path: never dropped here

X = [[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.1, 0.1, -0.3], [0.2, 0.5, 0.1]]
FORKS = {1: X[:1] + [[0.7, -0.6, 0.2], [0.0, 0.3, 0.3], [0.4, 0.4, -0.1]],
         2: X[:2] + [[0.7, -0.6, 0.2], [0.0, 0.3, 0.3]]}


@pytest.fixture(scope="module")
def factory():
    return TeleFuserRuntimeFactory(n_layers=1, n_heads=1, head_dim=14, ffn_dim=32, height=32, width=48, vae="wan")


@pytest.fixture(scope="module")
def cold(factory):
    return {k: factory.make(actions, hooks=None).generate() for k, actions in FORKS.items()}


def _session(factory, manager, actions, every, stop_after=None):
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint,
                              decoder_state_every=every)
    s = factory.make(actions, hooks=b)
    s.generate(stop_after)
    manager.store.flush()  # its frames and states are written off the request path
    return b, s


def _written(factory, every=1):
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config(), **ROOM)
    _session(factory, manager, X, every)
    assert manager.metrics.decoder_states_written == 3  # after chunks 0, 1, 2 (the last clears the cache)
    return manager


def test_the_stored_cache_replaces_the_replay_bit_exactly(factory, cold):
    manager = _written(factory)
    for k, actions in FORKS.items():
        before = manager.metrics.as_dict()
        b, s = _session(factory, manager, actions, 1)
        after = manager.metrics.as_dict()
        assert s.frame_hashes == cold[k] and (b.frames_served, b.chunks_materialized) == (k, k)
        assert after["decoder_states_restored"] - before["decoder_states_restored"] == 1
        assert after["decoder_replays"] == before["decoder_replays"]  # nothing decoded again


def test_the_stored_cache_is_read_while_the_chunk_denoises_and_the_vae_is_left_as_it_was(factory, cold, monkeypatch):
    """The read of the stored cache runs on the reader thread (started as the session
    materializes), and the VAE's first decode of the chunk catches the decoder up: the
    one-shot wrapper is gone afterwards, the frames equal a cold run's."""
    manager = _written(factory)
    threads = []
    real = ChunkDecoderStates.read

    def read(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkDecoderStates, "read", read)
    b, s = _session(factory, manager, FORKS[2], 1)
    assert s.frame_hashes == cold[2] and manager.metrics.decoder_states_restored == 1
    assert threads and all(name.startswith("cacheseek-decoder-state-read") for name in threads)
    vae = WanDecoder(factory.pipeline, s.runtime, {}).vae
    assert "cached_decode_withflag" not in vars(vae)


def test_the_dry_decode_predicts_the_cache_after_every_chunk(factory):
    s = factory.make(X, hooks=None)
    decoder = WanDecoder(factory.pipeline, None, {})
    s.start()
    decoder.runtime = s.runtime
    for j in range(3):
        s.generate(stop_after=j + 1)
        assert decoder.spec(j) == spec_of(decoder.capture()), j


@pytest.mark.slow
def test_without_loading_the_stored_cache_the_computed_chunk_is_wrong(factory, cold, monkeypatch):
    manager = _written(factory)
    real = LingBotWorldKVBinding.next_chunk

    def unloaded(self, rt, idx, spec, *a):
        plan = real(self, rt, idx, spec, *a)
        if plan.late_state is not None:
            assert plan.late_state.result()[1] is not None  # found (and never loaded)
        return NextChunk(frames=plan.frames, replay=plan.replay, replay_from=plan.replay_from)

    monkeypatch.setattr(LingBotWorldKVBinding, "next_chunk", unloaded)
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint,
                              decoder_state_every=1)
    s = factory.make(FORKS[2], hooks=b)
    s.generate(stop_after=2)
    assert s.frame_hashes == cold[2][:2]
    try:
        s.generate()
    except (IndexError, TypeError):  # TeleFuser's decode without the causal cache it needs
        return
    assert s.frame_hashes[2] != cold[2][2]


def test_a_damaged_stored_cache_is_a_miss_and_the_decoder_is_rebuilt(factory, cold):
    manager = _written(factory)
    store = manager.store
    node = next(n for ns in manager.forest.namespaces() for n in ns.iter_nodes() if n.depth == 1)
    loc = decoder_state_locator(node.node_key)
    store.backend.read(loc)[-100] ^= 0x01  # a byte of the cache's last tensor
    b, s = _session(factory, manager, FORKS[2], 1)
    m = manager.metrics.as_dict()
    assert s.frame_hashes == cold[2]
    assert m["decoder_states_corrupt"] == 1 and store.backend.read(loc) is None
    assert m["decoder_states_restored"] == 1 and m["decoder_replays"] == 1  # the one after chunk 0, then chunk 1


def test_a_live_session_loads_the_stored_cache_at_its_divergence(factory):
    """Live sessions streamed one action per chunk (each control built as TeleFuser's service
    builds it): one computes X, one follows it for 2 chunks and diverges; the follower's computed
    chunks equal a cold live run's, with the cache after chunk 1 loaded and nothing replayed."""
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config(), **ROOM)
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint,
                              decoder_state_every=2)
    factory.make(X, hooks=b, streamed=True).generate()
    manager.store.flush()
    cold = factory.make(FORKS[2], hooks=None, streamed=True).generate()
    c = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint,
                              decoder_state_every=2)
    s = factory.make(FORKS[2], hooks=c, streamed=True)
    s.generate()
    m = manager.metrics.as_dict()
    assert s.frame_hashes == cold and (c.frames_served, c.chunks_materialized) == (2, 2)
    assert (m["decoder_states_written"], m["decoder_states_restored"], m["decoder_replays"]) == (1, 1, 0)


def test_a_finished_session_frees_its_runtime_without_the_cycle_collector(factory, cold):
    """The seam hands the binding a `WanDecoder` holding the runtime, which holds the binding: kept
    by the binding, it made a cycle that left each finished session's ring allocated until a
    collection (out of memory on the H200 at 480p after a few sessions)."""
    import gc
    import weakref

    manager = _written(factory)
    gc.collect()
    gc.disable()
    try:
        b, s = _session(factory, manager, FORKS[2], 1)  # 2 served, then the state loaded at divergence
        assert s.frame_hashes == cold[2] and b.frames_served == 2
        ref = weakref.ref(s.runtime)
        del s, b
        assert ref() is None
    finally:
        gc.enable()
