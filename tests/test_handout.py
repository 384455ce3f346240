"""A restored chunk hands out its stored frames; KV moves only where the session computes.

On the synthetic runtime (``handout=True``; its decoder is causal, as the Wan VAE's streaming
decode is): a full hit hands out every chunk's frames and never touches the ring; a partial hit
hands out its prefix, restores it at the divergence and re-decodes the served latents to rebuild
the decoder's state; frames that are missing, damaged or stored under another chunk's key are a
miss (decoded or computed), never handed out; KV gone at the divergence computes the served
chunks again. Every session's frames equal a cold run's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from cacheseek.kv.locators import frames_locator
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.handout import NextChunk
from cacheseek.reuse.exact_prefix.keys import blob_keys
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

N, P = 5, 2
FULL, ROLLING = (-1, 0), (7, 3)
MODES = {"full": FULL, "L7S3": ROLLING}


def acts(seed: int = 0, n: int = N) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, generator=g).mul(2).sub(1).tolist() for _ in range(n)]


X = acts(0)
Y = X[:P] + acts(1)[P:]


def factory(mode) -> SyntheticRuntimeFactory:
    return SyntheticRuntimeFactory(geometry="tiny", local_attn_size=mode[0], sink_size=mode[1], handout=True)


def binding(store, forest, mode, *, ingest=True) -> LingBotWorldKVBinding:
    cfg = make_full_kv_config() if mode[0] == -1 else make_rolling_config(local_attn_size=mode[0], sink_size=mode[1])
    # frames are written off the request path: room for every chunk's (this runtime outpaces the writer)
    manager = WorldKVManager(forest, store, cfg, frames_in_flight=N, decoder_states_in_flight=N)
    return LingBotWorldKVBinding(manager, forest, ingest_enabled=ingest)


def session(store, forest, mode, actions, *, streamed=False, ingest=True):
    b = binding(store, forest, mode, ingest=ingest)
    rt = factory(mode).make(actions, hooks=b, streamed=streamed)
    hashes = rt.generate()
    store.flush()  # what the session wrote beside its chunks, in the store before the next looks
    return b, rt, hashes


def cold(mode, actions):
    return factory(mode).make(actions, hooks=None).generate()


@pytest.fixture(params=["memory", "localdisk"])
def store(request, tmp_path):
    s = InMemoryTierStore() if request.param == "memory" else LocalDiskTierStore(root=str(tmp_path / "disk"))
    yield s
    s.close()


def ring_untouched(rt) -> bool:
    return all(layer["local_end_index"] == 0 and layer["global_end_index"] == 0 and not layer["k"].any()
               for layer in rt.self_kv_cache)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES)
def test_full_hit_hands_out_frames_and_never_touches_the_ring(store, mode):
    forest = NamespaceForest()
    a, _, hashes_a = session(store, forest, mode, X)
    assert hashes_a == cold(mode, X) and a.frames_served == 0 and a.chunks_computed == N
    m = a.manager.metrics.as_dict()
    assert m["frames_written"] == N and m["frames_write_bytes"] > 0
    b, rt, hashes_b = session(store, forest, mode, X)
    assert hashes_b == hashes_a
    assert b.last_fast_forward == N and b.frames_served == N and b.chunks_materialized == 0 and b.chunks_computed == 0
    assert rt.handed_out == list(range(N)) and ring_untouched(rt) and b.bytes_restored == 0
    m = b.manager.metrics.as_dict()
    assert m["frames_handed_out"] == N and m["restores"] == 0 and m["materializations"] == 0


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES)
def test_partial_hit_materializes_at_the_divergence_and_rebuilds_the_decoder(store, mode):
    forest = NamespaceForest()
    session(store, forest, mode, X)
    c, rt, hashes_c = session(store, forest, mode, Y)
    assert hashes_c == cold(mode, Y)
    assert c.last_fast_forward == P and c.frames_served == P and c.chunks_materialized == P
    assert c.chunks_computed == N - P and c.bytes_restored > 0
    m = c.manager.metrics.as_dict()
    assert (m["materializations"], m["chunks_materialized"], m["decoder_replays"]) == (1, P, P)


def test_without_the_decoder_rebuild_the_computed_frames_differ(store, monkeypatch):
    """The negative control of the rebuild: the same partial hit with the replay dropped hands
    out different frames for the chunk computed after the served prefix."""
    forest = NamespaceForest()
    session(store, forest, FULL, X)
    real = LingBotWorldKVBinding.next_chunk

    def no_replay(self, runtime, idx, spec, **kw):
        plan = real(self, runtime, idx, spec, **kw)
        return NextChunk(frames=plan.frames, recompute=plan.recompute)

    monkeypatch.setattr(LingBotWorldKVBinding, "next_chunk", no_replay)
    _, _, hashes = session(store, forest, FULL, Y)
    expect = cold(FULL, Y)
    assert hashes[:P] == expect[:P] and hashes[P] != expect[P]


def _frames_values(store, forest):
    return {n.depth: frames_locator(n.node_key) for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv}


def test_a_damaged_frame_is_caught_by_its_checksum_never_handed_out(tmp_path):
    """The negative control of the frames: one changed pixel byte in the store is a miss (the
    value removed), the chunk decoded instead; no frame differs from a cold run's."""
    store = InMemoryTierStore()
    forest = NamespaceForest()
    session(store, forest, FULL, X)
    loc = _frames_values(store, forest)[1]
    value = store.backend.read(loc)
    value[-7] ^= 0x01  # a pixel byte, past the header
    b, rt, hashes = session(store, forest, FULL, X)
    assert hashes == cold(FULL, X)
    assert rt.handed_out == [0] and b.frames_served == 1 and b.chunks_materialized == N
    m = b.manager.metrics.as_dict()
    assert m["frames_corrupt"] == 1 and store.backend.read(loc) is None
    store.close()


def test_frames_under_another_chunks_key_are_a_miss(store):
    forest = NamespaceForest()
    session(store, forest, FULL, X)
    locs = _frames_values(store, forest)
    store.put_skeleton(locs[0], store.get_skeleton(locs[1]))  # chunk 1's frames under chunk 0's name
    b, rt, hashes = session(store, forest, FULL, X)
    assert hashes == cold(FULL, X) and rt.handed_out == [] and b.manager.metrics.as_dict()["frames_corrupt"] == 1


def test_missing_frames_decode_the_chunk_from_its_restored_latent(store):
    forest = NamespaceForest()
    session(store, forest, FULL, X)
    store.free_skeleton(_frames_values(store, forest)[P])
    b, rt, hashes = session(store, forest, FULL, X)
    assert hashes == cold(FULL, X)
    assert rt.handed_out == list(range(P)) and b.chunks_materialized == N and b.chunks_computed == 0
    assert b.manager.metrics.as_dict()["frames_missing"] == 1


def test_kv_gone_at_the_divergence_computes_the_served_chunks_again(store):
    forest = NamespaceForest()
    session(store, forest, FULL, X)
    nodes = {n.depth: n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv}
    for key in blob_keys(nodes[0].blob.locator, nodes[0].blob.n_layers):
        store.backend.delete(key)  # behind the trie's back: the lookup still finds chunk 0
    c, rt, hashes = session(store, forest, FULL, Y)
    assert hashes == cold(FULL, Y)
    assert c.frames_served == P and c.last_fast_forward == 0
    assert c.manager.metrics.as_dict()["recomputed_chunks"] == P


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES)
def test_live_sessions_streamed_one_action_per_chunk(store, mode):
    forest = NamespaceForest()
    a, _, hashes_a = session(store, forest, mode, X, streamed=True)
    assert hashes_a == cold(mode, X) and a.frames_served == 0
    b, rt, hashes_b = session(store, forest, mode, X, streamed=True)
    assert hashes_b == hashes_a and b.frames_served == N and ring_untouched(rt) and b.restored_chunks == list(range(N))
    c, _, hashes_c = session(store, forest, mode, Y, streamed=True)
    assert hashes_c == cold(mode, Y)
    assert c.frames_served == P and c.chunks_materialized == P and c.chunks_computed == N - P


def test_frames_count_in_capacity_and_leave_with_their_chunk():
    store = InMemoryTierStore()
    forest = NamespaceForest()
    b, _, _ = session(store, forest, FULL, X)
    locs = _frames_values(store, forest)
    assert all(store.contains([loc])[0] for loc in locs.values())
    frames_bytes = b.manager.metrics.as_dict()["frames_write_bytes"]
    kv_bytes = b.bytes_written
    assert store.usage().used_bytes >= kv_bytes + frames_bytes
    leaf = max((n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv), key=lambda n: n.depth)
    assert b.manager.evict_blob(leaf)
    assert not store.contains([locs[leaf.depth]])[0]
    store.close()


def test_served_images_equal_what_tensor2video_hands_out():
    """TeleFuser hands out ``Image.fromarray`` of each uint8 frame; a served chunk's images
    (`pil_images`: ``frombuffer`` on threads) equal them in type, mode, size and pixels."""
    np = pytest.importorskip("numpy")
    Image = pytest.importorskip("PIL.Image")
    from cacheseek.integrations.telefuser.handout import pil_images

    frames = np.random.default_rng(0).integers(0, 256, (5, 48, 80, 3), dtype=np.uint8)
    cold, served = [Image.fromarray(f) for f in frames], pil_images(frames)
    assert len(served) == len(cold)
    for a, b in zip(cold, served):
        assert (type(a), a.mode, a.size, a.info, a.readonly) == (type(b), b.mode, b.size, b.info, b.readonly)
        assert a.tobytes() == b.tobytes()
    frames[0, 0, 0, 0] ^= 1  # the images own their pixels: the frames' buffer may be reused
    assert served[0].tobytes() == cold[0].tobytes()
