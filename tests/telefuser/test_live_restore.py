"""A live session on a cached path restores each chunk instead of computing it, on TeleFuser's
real pipeline, streamed as its services stream (one control per chunk, camera rotations and
translations), in four ring modes: it follows the cached path for k chunks, diverges and
computes; a third session follows the new branch and restores all of it. Every session's frames
at every chunk, and its ring, cursors and RNG before the last chunk, equal a cold run's.

On the release and the hooked commit the per-chunk seam restores in the thread that runs the
chunk; on TeleFuser main its denoise actor does, in place of ``denoise_and_update_cache``."""

from __future__ import annotations

import pytest

from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.runtime.snapshot import snapshot_diff
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

ROOM = {"frames_in_flight": 8, "decoder_states_in_flight": 8}  # written off the request path: never dropped here

RINGS = {"full": (-1, 0), "rolling_L7_S3": (7, 3), "rolling_L6_S0": (6, 0), "rolling_L5_S1": (5, 1)}
X = [[0.3, -0.2, 0.1, 0.5], [-0.5, 0.4, 0.0, -0.3], [0.1, 0.1, -0.3, 0.8], [0.7, -0.6, 0.2, 0.2]]
K = 2
FOLLOW_THEN_DIVERGE = X[:K] + [[-0.7, 0.6, 0.2, -0.6], [0.2, 0.2, 0.2, 0.4]]

_factories: dict = {}


@pytest.fixture(params=sorted(RINGS))
def factory(request):
    if request.param not in _factories:
        L, S = RINGS[request.param]
        _factories[request.param] = TeleFuserRuntimeFactory(local_attn_size=L, sink_size=S)
    return _factories[request.param]


def _manager(factory):
    L, S = factory.local_attn_size, factory.sink_size
    cfg = make_full_kv_config() if L == -1 else make_rolling_config(local_attn_size=L, sink_size=S)
    return WorldKVManager(NamespaceForest(), InMemoryTierStore(), cfg, **ROOM)


def _run(factory, actions, manager=None, *, handout=False):
    """``handout=False``: each cached chunk restored eagerly into the ring (`ChunkWindow`), as on
    TeleFuser main and after a session's divergence; True: served from its stored frames."""
    binding = None if manager is None else LingBotWorldKVBinding(manager, manager.forest, handout=handout,
                                                                 model_fingerprint=factory.weights_fingerprint)
    session = factory.make(actions, hooks=binding, streamed=True)
    session.generate(stop_after=len(actions) - 1)
    state = session.state_snapshot()  # before the last chunk: main releases the ring after it
    frames = session.generate()
    if manager is not None:
        manager.store.flush()
    return frames, state


def test_a_live_session_restores_the_cached_path_then_computes_and_a_third_follows_it(factory):
    cold_frames, cold_state = _run(factory, FOLLOW_THEN_DIVERGE)
    manager = _manager(factory)
    _run(factory, X, manager)
    m = manager.metrics
    assert m.live_hits == 0 and m.writes == len(X)

    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager)  # follows K chunks, then diverges
    assert m.live_hits_by_chunk == {i: 1 for i in range(K)} and m.live_restore_failures == 0
    assert frames == cold_frames  # every chunk, restored or computed, as a cold run's
    assert snapshot_diff(state, cold_state) == []  # ring[:local_end], cursors, RNG
    assert m.writes == len(X) + len(X) - K  # the new branch is written as it is computed

    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager)  # the new branch, all of it
    assert m.live_hits_by_chunk == {i: 2 if i < K else 1 for i in range(len(X))}
    assert frames == cold_frames and snapshot_diff(state, cold_state) == []
    assert m.writes == 2 * len(X) - K and m.hook_failures == 0 and m.chunks_unkeyed == 0


def test_a_missing_value_is_a_miss_the_chunk_is_computed_and_the_path_goes_on(factory):
    """The store lost chunk 1's KV behind the trie's back: chunk 1 is a miss (its node
    invalidated), computed and written again; chunks 2 and 3 still hang under it and are restored."""
    manager = _manager(factory)
    _run(factory, X, manager)
    cold_frames, cold_state = _run(factory, X)
    [ns] = manager.forest.namespaces()
    chunk1 = next(iter(next(iter(ns.root.children.values())).children.values()))
    manager.store.free(chunk1.blob)
    frames, state = _run(factory, X, manager)
    m = manager.metrics
    assert m.live_hits_by_chunk == {0: 1, 2: 1, 3: 1} and m.live_misses == 1 and m.invalidations == 1
    assert m.live_restore_failures == 0
    assert frames == cold_frames and snapshot_diff(state, cold_state) == []
    assert chunk1.has_kv and m.writes == len(X) + 1


@pytest.fixture()
def plan_store():
    """The Plan tier over an embedded shared-memory client, host transfer: the whole-path read
    into device staging buffers (`StagingPool`), then the ring append."""
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.host_transfer import HostTransferRuntime

    store = PlanTierStore(plan_client=EmbeddedPlanClient(segment_bytes=64 << 20, prefault_threads=1),
                          transfer=HostTransferRuntime(), overlap=False)
    yield store
    store.close()


def test_a_live_session_restores_each_chunk_from_the_plan_tier(factory, plan_store):
    L, S = factory.local_attn_size, factory.sink_size
    cfg = make_full_kv_config() if L == -1 else make_rolling_config(local_attn_size=L, sink_size=S)
    manager = WorldKVManager(NamespaceForest(), plan_store, cfg, **ROOM)
    cold_frames, cold_state = _run(factory, FOLLOW_THEN_DIVERGE)
    _run(factory, X, manager)
    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager)
    assert manager.metrics.live_hits == K and plan_store.stats.read_hits == K
    assert frames == cold_frames and snapshot_diff(state, cold_state) == []


def test_a_live_session_hands_out_frames_from_the_plan_tier_and_materializes_at_divergence(factory, plan_store):
    if factory.streaming:
        pytest.skip("TeleFuser main decodes in its actors: its live chunks are restored eagerly, not handed out")
    L, S = factory.local_attn_size, factory.sink_size
    cfg = make_full_kv_config() if L == -1 else make_rolling_config(local_attn_size=L, sink_size=S)
    manager = WorldKVManager(NamespaceForest(), plan_store, cfg, **ROOM)
    cold_frames, cold_state = _run(factory, FOLLOW_THEN_DIVERGE)
    _run(factory, X, manager, handout=True)
    assert manager.metrics.frames_written == len(X)
    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager, handout=True)
    m = manager.metrics
    assert m.live_hits == K and m.frames_handed_out == K and plan_store.stats.read_hits == 1  # one path read
    assert (m.materializations, m.chunks_materialized, m.decoder_replays) == (1, K, K)
    assert frames == cold_frames and snapshot_diff(state, cold_state) == []
    frames, _ = _run(factory, X, manager, handout=True)  # the first path again: served until `_run`'s
    assert frames == _run(factory, X)[0] and m.frames_handed_out == K + len(X) - 1  # snapshot materializes


def test_skipping_a_restored_chunks_rng_draws_is_caught(factory, monkeypatch):
    """Negative control: a live restore that leaves out the chunk's re-noise draws shows in the
    first computed chunk's frames and in the RNG state."""
    from cacheseek.reuse.exact_prefix import chunk_window

    cold_frames, cold_state = _run(factory, FOLLOW_THEN_DIVERGE)
    manager = _manager(factory)
    _run(factory, X, manager)
    monkeypatch.setattr(chunk_window, "advance_rng", lambda layout, runtime, latents: None)
    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager)
    assert manager.metrics.live_hits == K
    assert frames[:K] == cold_frames[:K] and frames[K] != cold_frames[K]
    assert "generator state differs" in snapshot_diff(state, cold_state)


def test_an_error_after_a_chunks_restore_was_published_does_not_undo_it(factory, monkeypatch):
    """Once a chunk's restore is published (ring, cursors, RNG, latent), a later error (here in
    releasing the restore's references) must not make the runtime compute the chunk on top of it."""
    from cacheseek.errors import HandleStateError
    from cacheseek.reuse.exact_prefix import restore

    cold_frames, cold_state = _run(factory, FOLLOW_THEN_DIVERGE)
    manager = _manager(factory)
    _run(factory, X, manager)
    real, raised = restore.Restorer.release, []

    def release_then_fail(self, path, missing):
        real(self, path, missing)
        if not raised:
            raised.append(True)
            raise HandleStateError("after publication")

    monkeypatch.setattr(restore.Restorer, "release", release_then_fail)
    frames, state = _run(factory, FOLLOW_THEN_DIVERGE, manager)
    assert raised and manager.metrics.live_hits == K
    assert frames == cold_frames and snapshot_diff(state, cold_state) == []
