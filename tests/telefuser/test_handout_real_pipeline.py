"""Frames handed out on TeleFuser's real pipeline (the release's seams, its Wan VAE, tiny): a full
hit never touches the ring, a partial hit restores its prefix at the divergence and rebuilds the
Wan decoder's causal cache by decoding the served latents (without it the computed chunk's
frames differ), and a damaged frame in the store is caught by its checksum, never handed out.
Every frame equals a cold run's, bit for bit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.telefuser

pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")

from cacheseek.kv.locators import frames_locator  # noqa: E402
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager  # noqa: E402
from cacheseek.reuse.exact_prefix.handout import NextChunk  # noqa: E402
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config  # noqa: E402
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory  # noqa: E402
from cacheseek.stores.memory import InMemoryTierStore  # noqa: E402

ROOM = {"frames_in_flight": 8, "decoder_states_in_flight": 8}  # written off the request path: never dropped here

X = [[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.1, 0.1, -0.3]]
Y = X[:2] + [[0.7, -0.6, 0.2]]


@pytest.fixture(scope="module")
def factory():
    return TeleFuserRuntimeFactory(n_layers=1, n_heads=1, head_dim=14, ffn_dim=32, height=32, width=32, vae="wan")


@pytest.fixture(scope="module")
def cold(factory):
    return {name: factory.make(actions, hooks=None).generate() for name, actions in (("X", X), ("Y", Y))}


def _manager():
    return WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config(), **ROOM)


def _session(factory, manager, actions):
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
    s = factory.make(actions, hooks=b)
    s.generate()
    manager.store.flush()  # its frames are written off the request path
    return b, s


def test_full_and_partial_hits_hand_out_frames_and_match_a_cold_run(factory, cold):
    manager = _manager()
    _session(factory, manager, X)
    b, s = _session(factory, manager, X)
    assert s.frame_hashes == cold["X"] and b.frames_served == 3 and b.chunks_materialized == 0
    assert all(layer["local_end_index"] == 0 for layer in s.runtime.self_kv_cache)  # the ring never touched
    c, s = _session(factory, manager, Y)
    assert s.frame_hashes == cold["Y"] and (c.frames_served, c.chunks_materialized, c.chunks_computed) == (2, 2, 1)
    assert manager.metrics.decoder_replays == 2


@pytest.mark.slow
def test_without_the_decoder_rebuild_the_computed_chunk_is_wrong(factory, cold, monkeypatch):
    """The negative control of the rebuild: the Wan decoder's causal cache is not a cold run's
    (here: empty, so TeleFuser's decode fails; with another session's cache its frames differ)."""
    manager = _manager()
    _session(factory, manager, X)
    real = LingBotWorldKVBinding.next_chunk
    monkeypatch.setattr(LingBotWorldKVBinding, "next_chunk",
                        lambda self, rt, idx, spec, *a: NextChunk(frames=real(self, rt, idx, spec, *a).frames))
    b = LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
    s = factory.make(Y, hooks=b)
    s.generate(stop_after=2)
    assert s.frame_hashes == cold["Y"][:2]
    try:
        s.generate()
    except IndexError:  # TeleFuser's decode without the causal cache it needs
        return
    assert s.frame_hashes[2] != cold["Y"][2]


@pytest.mark.slow
def test_a_damaged_frame_is_caught_never_handed_out(factory, cold):
    manager = _manager()
    a, _ = _session(factory, manager, X)
    node = manager.forest.resolve(a.root).root
    for key in list(a.actions)[:2]:
        node = node.children[key]  # chunk 1
    value = manager.store.backend.read(frames_locator(node.node_key))
    value[-1] ^= 0x01  # one pixel byte
    b, s = _session(factory, manager, X)
    assert s.frame_hashes == cold["X"] and b.frames_served == 1 and manager.metrics.frames_corrupt == 1
