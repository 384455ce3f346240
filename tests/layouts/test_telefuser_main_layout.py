"""The ``telefuser_main`` layout adapter and the streaming seams against a double of TeleFuser main
(`telefuser_main_double`): where the ring, cursors, RNGs, latents and controls live; the A/B/C/D
gate and the per-depth ring check on it; negative controls that the check catches a wrong KV
value, an extra RNG draw and TeleFuser's bf16 cast of a restored latent."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import telefuser_main_double as tm
from cacheseek.errors import LayoutMismatchError
from cacheseek.integrations.telefuser import (
    TeleFuserLayout,
    UnsupportedTeleFuserError,
    attach,
    detach,
    detect_layout,
    hooks_of,
    plan_controls,
)
from cacheseek.layout.bshd import BshdLayout
from cacheseek.layout.telefuser_main import TeleFuserMainLayout
from cacheseek.reuse.exact_prefix import InMemoryTierStore, NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.runtime.snapshot import ring_snapshot, same_bytes, snapshot_diff

# (local_attn_size, sink_size): full; rolls at chunk 3; rolls at chunk 3; sink not a whole chunk
RINGS = {"full": (-1, 0), "rolling_L7_S3": (7, 3), "rolling_L6_S0": (6, 0), "rolling_L5_S1": (5, 1)}
N, P = 4, 2
ACTIONS_X = [[0.1, 0.2], [0.3, -0.4], [0.5, 0.1], [-0.2, 0.7]]
ACTIONS_Y = ACTIONS_X[:P] + [[0.9, 0.9], [-0.8, 0.2]]
LAYOUT = TeleFuserMainLayout()


def pipeline_for(ring: str) -> tm.LingBotWorldFastPipeline:
    L, S = RINGS[ring]
    pipeline = tm.LingBotWorldFastPipeline(local_attn_size=L, sink_size=S)
    assert attach(pipeline) is TeleFuserLayout.MAIN
    return pipeline


def manager_for(ring: str, store=None, forest=None) -> WorldKVManager:
    L, S = RINGS[ring]
    cfg = make_full_kv_config() if L == -1 else make_rolling_config(local_attn_size=L, sink_size=S, chunk_size=3)
    return WorldKVManager(forest if forest is not None else NamespaceForest(), store or InMemoryTierStore(), cfg)


def run(pipeline, actions, binding=None):
    """generate_video on the attached double; the decoded frames and the session."""
    frames = pipeline.generate_video(tm.session_config(len(actions), binding=binding), tm.controls_for(actions))
    return frames, pipeline.last_session


def bind(manager, **kw) -> LingBotWorldKVBinding:
    return LingBotWorldKVBinding(manager, manager.forest, layout=LAYOUT, **kw)


def same_frames(a, b) -> bool:
    return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b))


# -- detection and where things live ------------------------------------------------------------


def test_main_is_detected_and_its_adapter_is_named():
    pipeline = tm.LingBotWorldFastPipeline()
    assert detect_layout(pipeline) is TeleFuserLayout.MAIN
    assert TeleFuserLayout.MAIN.layout_name == "telefuser_main"
    assert isinstance(TeleFuserLayout.MAIN.adapter(), TeleFuserMainLayout)
    assert isinstance(TeleFuserLayout.HOOKED.adapter(), BshdLayout)


def test_a_main_layout_without_a_cache_handle_is_refused_naming_it(monkeypatch):
    fields = [f for f in tm.LingBotWorldFastGenerationSession.__dataclass_fields__ if f != "cache_handle"]
    import dataclasses

    lacking = dataclasses.make_dataclass("LingBotWorldFastGenerationSession", fields)
    monkeypatch.setattr(sys.modules[f"{tm.PKG}.session"], "LingBotWorldFastGenerationSession", lacking)
    with pytest.raises(UnsupportedTeleFuserError, match="cache_handle"):
        detect_layout(tm.LingBotWorldFastPipeline())


def test_the_adapter_finds_the_ring_cursors_rng_and_latent_behind_the_cache_handle():
    pipeline = pipeline_for("rolling_L7_S3")
    config = tm.session_config(N)
    plan_controls(config, tm.controls_for(ACTIONS_X))
    session = pipeline._create_initialized_session(config)
    state = pipeline.denoise_stage._cache_registry[session.cache_handle]

    assert LAYOUT.ring_layers(session) is state.self_kv_cache
    assert LAYOUT.generator(session) is state.generator
    assert LAYOUT.timesteps(session) is state.timesteps
    assert LAYOUT.n_chunks(session) == N
    ring = LAYOUT.window(session)
    assert (ring.chunk_size, ring.frame_tokens, ring.local_attn_size, ring.sink_size) == (3, 4, 7, 3)
    spec = LAYOUT.latent_spec(session)
    assert spec.shape == (1, 16, 3, 4, 4) and spec.dtype == torch.float32
    assert len(LAYOUT.controls(session)) == N
    assert LAYOUT.cursors(session) == [(0, 0)] * tm.N_LAYERS

    cursors = [layer["local_end_index"] for layer in state.self_kv_cache]
    LAYOUT.set_cursors(session, 36, 28)
    assert LAYOUT.cursors(session) == [(36, 28)] * tm.N_LAYERS
    for layer, before in zip(state.self_kv_cache, cursors):  # filled in place, still 0-d int64 tensors
        assert layer["local_end_index"] is before
        assert layer["global_end_index"].dim() == 0 and layer["global_end_index"].dtype == torch.int64
    fp = LAYOUT.fingerprint_fields(session)
    assert fp["runtime_layout"] == "telefuser_main" and fp["latent_dtype"] == "torch.float32"
    assert fp["kv_shape"] == [1, 12, tm.N_HEADS, tm.HEAD_DIM] and fp["kv_dtype"] == "torch.bfloat16"


def test_what_the_adapter_cannot_find_is_named():
    pipeline = tm.LingBotWorldFastPipeline()  # not attached
    session = pipeline._create_initialized_session(tm.session_config(N))
    with pytest.raises(LayoutMismatchError, match="attach"):
        LAYOUT.ring_layers(session)

    attached = pipeline_for("full")
    session = attached._create_initialized_session(tm.session_config(N))
    assert LAYOUT.controls(session) is None  # a live session: its controls stream in per chunk
    attached.denoise_stage.release_cache(session.cache_handle)
    with pytest.raises(LayoutMismatchError, match="not registered"):
        LAYOUT.ring_layers(session)


def test_attach_refuses_a_pipeline_that_generated_or_whose_ring_is_in_worker_processes():
    pipeline = tm.LingBotWorldFastPipeline()
    pipeline._streaming_runtime = object()
    with pytest.raises(UnsupportedTeleFuserError, match="before warmup"):
        attach(pipeline)

    class ParallelWorker:  # TeleFuser's multi-GPU worker: the stage lives in other processes
        def __getattr__(self, name):
            return lambda *a, **k: None

    pipeline = tm.LingBotWorldFastPipeline()
    pipeline.denoise_stage = ParallelWorker()
    with pytest.raises(UnsupportedTeleFuserError, match="ParallelWorker"):
        attach(pipeline)


def test_detach_gives_the_pipeline_its_own_seams_back():
    pipeline = tm.LingBotWorldFastPipeline()
    worker = pipeline.vae_decode_worker
    attach(pipeline)
    assert pipeline.vae_decode_worker is not worker
    detach(pipeline)
    assert pipeline.vae_decode_worker is worker
    assert "generate_video" not in vars(pipeline) and "_create_initialized_session" not in vars(pipeline)


# -- the gate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ring", sorted(RINGS))
def test_gate_on_the_double(ring):
    pipeline = pipeline_for(ring)
    manager = manager_for(ring)
    a = bind(manager)
    frames_a, _ = run(pipeline, ACTIONS_X, a)
    b = bind(manager)
    frames_b, session_b = run(pipeline, ACTIONS_X, b)
    c = bind(manager)
    frames_c, _ = run(pipeline, ACTIONS_Y, c)
    d = bind(manager_for(ring), ingest_enabled=False)
    frames_d, _ = run(pipeline, ACTIONS_Y, d)

    assert [x.last_fast_forward for x in (a, b, c, d)] == [0, N, P, 0]
    assert same_frames(frames_b, frames_a)
    assert same_frames(frames_c, frames_d)
    assert not same_frames(frames_c[P:], frames_a[P:])  # Y really differs from X
    assert all(x.ingest_errors == 0 for x in (a, b, c, d))
    assert manager.metrics.hook_failures == 0 and d.manager.metrics.hook_failures == 0
    # TeleFuser main reports the restored chunks too, from its denoise actor: ignored, not failed
    assert pipeline.hook_threads and all(t.startswith("lingbot-denoise-actor") for t in pipeline.hook_threads)
    assert pipeline.denoise_stage.noise_draws[session_b.cache_handle] == N  # advance_noise per hit


@pytest.mark.parametrize("ring", sorted(RINGS))
def test_ring_check_on_the_double(ring):
    """Right after on_runtime_created at depth K: ring[:local_end], both cursors, the denoise RNG
    and the cached latents equal a cold run's before chunk K; after TeleFuser consumed the K
    decode-only chunks, its noise RNG does too."""
    pipeline = pipeline_for(ring)
    manager = manager_for(ring)
    _, cold = run(pipeline, ACTIONS_X, bind(manager))
    cold_states, cold_noise, cold_latents = cold_run_states(pipeline, ACTIONS_X)
    for k in range(1, N):
        actions = ACTIONS_X[:k] + [[0.0, -0.9]] * (N - k)
        binding = bind(manager, ingest_enabled=False)
        config = tm.session_config(N, binding=binding)
        plan_controls(config, tm.controls_for(actions))
        session = pipeline._create_initialized_session(config)
        assert binding.last_fast_forward == k
        assert snapshot_diff(ring_snapshot(session, LAYOUT), cold_states[k]) == []
        for i in range(k):
            assert same_bytes(session.world_kv_cached_latents[i], cold_latents[i])
        controls = tm.controls_for(actions)
        for i in range(k):
            pipeline.run_chunk(session, i, controls[i])
        state = pipeline.denoise_stage._cache_registry[session.cache_handle]
        assert same_bytes(state.noise_generator.get_state(), cold_noise[k])
        assert snapshot_diff(ring_snapshot(session, LAYOUT), cold_states[k]) == []


def cold_run_states(pipeline, actions):
    """A cold session's snapshot, noise RNG state and decoded latents before each chunk K."""
    config = tm.session_config(N)
    plan_controls(config, tm.controls_for(actions))
    session = pipeline._create_initialized_session(config)
    state = pipeline.denoise_stage._cache_registry[session.cache_handle]
    controls = tm.controls_for(actions)
    snaps, noise = [], []
    for i in range(N):
        snaps.append(ring_snapshot(session, LAYOUT))
        noise.append(state.noise_generator.get_state().clone())
        pipeline.run_chunk(session, i, controls[i])
    latents = [lat for lat, _ in pipeline.vae_decode_worker.decoded[session.cache_handle]]
    return snaps, noise, latents


# -- negative controls --------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["kv", "rng"])
def test_negative_controls_one_kv_value_or_one_draw_is_caught(fault):
    """The ring check sees one flipped bit of one restored K value or one extra draw, and chunk K,
    computed on that state, differs from the cold run's."""
    pipeline, manager, k = pipeline_for("rolling_L7_S3"), manager_for("rolling_L7_S3"), 2
    frames_cold, _ = run(pipeline, ACTIONS_X, bind(manager))
    cold_states, _, _ = cold_run_states(pipeline, ACTIONS_X)
    session, _ = _restored_at(pipeline, manager, k)
    assert snapshot_diff(ring_snapshot(session, LAYOUT), cold_states[k]) == []

    if fault == "kv":
        LAYOUT.ring_layers(session)[1]["k"].view(torch.int16)[0, 5, 0, 0] ^= 1
        expect = "layer 1 k[:, :local_end] differs"
    else:
        torch.randn((1,), generator=LAYOUT.generator(session))
        expect = "generator state differs"
    assert expect in snapshot_diff(ring_snapshot(session, LAYOUT), cold_states[k])
    controls = tm.controls_for(ACTIONS_X)
    frames = [pipeline.run_chunk(session, i, controls[i]) for i in range(N)]
    assert same_frames(frames[:k], frames_cold[:k])
    assert not same_bytes(frames[k], frames_cold[k])


def _restored_at(pipeline, manager, k):
    """A session whose first k actions are X's, restored to depth k from ``manager``."""
    binding = bind(manager, ingest_enabled=False)
    config = tm.session_config(N, binding=binding)
    plan_controls(config, tm.controls_for(ACTIONS_X[:k] + [[0.0, -0.9]] * (N - k)))
    session = pipeline._create_initialized_session(config)
    assert binding.last_fast_forward == k
    return session, binding


def test_restored_latents_are_decoded_as_stored_not_as_telefuser_casts_them():
    """TeleFuser main casts a cached latent to bf16 before decoding; an fp32 VAE refuses that, and
    a tolerant one would decode rounded values. The decode seam hands the stored latent over."""
    pipeline = pipeline_for("full")
    manager = manager_for("full")
    frames_a, _ = run(pipeline, ACTIONS_X, bind(manager))
    frames_b, _ = run(pipeline, ACTIONS_X, bind(manager))
    assert same_frames(frames_b, frames_a)

    pipeline.vae_decode_worker = hooks_of(pipeline).own_decode_worker  # without the seam: TeleFuser's own path
    with pytest.raises(RuntimeError, match="scheduler failed") as exc:
        run(pipeline, ACTIONS_X, bind(manager))
    assert "Input type (torch.bfloat16)" in str(exc.value.__cause__)


def test_generate_video_plans_the_controls_it_was_given_even_deferred():
    pipeline = pipeline_for("full")
    manager = manager_for("full")
    controls = tm.controls_for(ACTIONS_X)
    deferred = [(lambda c=c: c) for c in controls]
    first = bind(manager)
    pipeline.generate_video(tm.session_config(N, binding=first), deferred)
    second = bind(manager)
    pipeline.generate_video(tm.session_config(N, binding=second), controls)
    assert (first.last_fast_forward, second.last_fast_forward) == (0, N)
    assert threading.current_thread().name not in pipeline.hook_threads


# -- live sessions: controls submitted chunk by chunk, as main's service does --------------------


def stream(pipeline, actions, binding=None):
    """A live session on the double's streaming runtime: created with no controls, then one
    ``submit_chunk(session, i, control)`` per chunk. The frames, in chunk order."""
    session = pipeline._create_initialized_session(tm.session_config(len(actions), binding=binding))
    streaming = pipeline._get_streaming_runtime()
    handle = streaming.create_session(session)
    frames = []
    for i, control in enumerate(tm.controls_for(actions)):
        streaming.submit_chunk(handle, i, control)
        frames += [f for _, f in streaming.poll_frames(handle)]
    return frames, session


@pytest.mark.parametrize("ring", sorted(RINGS))
def test_live_sessions_are_keyed_by_each_submitted_control(ring):
    """Two live sessions with other actions never restore each other's chunks; each chunk's node
    is keyed by the control submitted for it, and no binding without ``layout=`` fails."""
    from cacheseek.reuse.exact_prefix.actions import action_keys
    from cacheseek.reuse.exact_prefix.keys import build_action_chain

    pipeline = pipeline_for(ring)
    manager = manager_for(ring)
    cold_y, _ = stream(pipeline, ACTIONS_Y)
    x = LingBotWorldKVBinding(manager, manager.forest)  # the layout is told from the session
    stream(pipeline, ACTIONS_X, x)
    y = LingBotWorldKVBinding(manager, manager.forest)
    frames_y, _ = stream(pipeline, ACTIONS_Y, y)
    assert manager.metrics.hook_failures == 0 and manager.metrics.chunks_unkeyed == 0
    assert x.last_fast_forward == y.last_fast_forward == 0
    assert same_frames(frames_y, cold_y)
    for binding, actions in ((x, ACTIONS_X), (y, ACTIONS_Y)):
        assert list(binding.actions) == action_keys(tm.controls_for(actions))
        chain = build_action_chain(binding.root, list(binding.actions))
        node = manager.forest.resolve(binding.root).root
        for key, expected in zip(binding.actions, chain):
            node = node.children[key]
            assert node.node_key == expected and node.has_kv
    ns = manager.forest.resolve(x.root)
    assert len(ns.root.children) == 1  # P shared: one branch point at chunk P


def test_a_refused_or_repeated_submission_never_keys_a_chunk_by_a_control_it_did_not_take():
    """The scheduler refuses a submission (ingress full: False) or a second one of an admitted
    chunk (an error): the binding keys each chunk by the control the scheduler took."""
    from cacheseek.reuse.exact_prefix.actions import action_keys

    class Refusing(tm.StreamingRuntime):
        def __init__(self, pipeline):
            super().__init__(pipeline)
            self.refused = False

        def try_submit_chunk(self, session, chunk_index, control):
            if not self.refused:
                self.refused = True
                return False
            if chunk_index in self.taken.setdefault(session.cache_handle, set()):
                raise ValueError(f"chunk {chunk_index} already admitted")
            self.taken[session.cache_handle].add(chunk_index)
            return super().try_submit_chunk(session, chunk_index, control)

    pipeline = pipeline_for("rolling_L7_S3")
    pipeline._streaming_runtime = Refusing(pipeline)
    pipeline._streaming_runtime.taken = {}
    manager = manager_for("rolling_L7_S3")
    binding = LingBotWorldKVBinding(manager, manager.forest)
    session = pipeline._create_initialized_session(tm.session_config(N, binding=binding))
    streaming = pipeline._get_streaming_runtime()
    handle = streaming.create_session(session)
    right, wrong = tm.controls_for(ACTIONS_X), tm.controls_for(ACTIONS_Y[::-1])
    assert streaming.try_submit_chunk(handle, 0, wrong[0]) is False  # refused: withdrawn
    for i in range(N):
        assert streaming.try_submit_chunk(handle, i, right[i])
        with pytest.raises(ValueError, match="already admitted"):
            streaming.try_submit_chunk(handle, i, wrong[i])  # the admitted chunk keeps its control
    assert list(binding.actions) == action_keys(right)
    assert manager.metrics.hook_failures == 0 and manager.metrics.chunks_unkeyed == 0
