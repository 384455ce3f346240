"""The binding on TeleFuser's real pipeline: negative controls of the ring check, stored latent
dtype, hook failures counted and logged once, layouts detected or refused."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch

from cacheseek.integrations.telefuser import (
    TeleFuserLayout,
    UnsupportedTeleFuserError,
    attach,
    detach,
    detect_layout,
)
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (
    LingBotWorldKVBinding,
    make_full_kv_config,
    make_rolling_config,
)
from cacheseek.runtime.snapshot import snapshot_diff
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

ACTIONS = [[0.3, -0.2, 0.1, 0.0], [-0.5, 0.4, 0.0, 0.2], [0.1, 0.1, -0.3, 0.0], [0.7, -0.6, 0.2, 0.1]]


@pytest.fixture(scope="module")
def factory():
    return TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3)


def _binding(manager, factory, **kw):
    return LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint, **kw)


def _filled(factory):
    """A manager whose store holds every chunk of ACTIONS, and the cold session that wrote it."""
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_rolling_config(local_attn_size=7, sink_size=3))
    cold = factory.make(ACTIONS, hooks=_binding(manager, factory))
    cold.generate()
    return manager, cold


def test_stored_latents_are_the_decoded_bf16_x0_not_the_fp32_noise(factory):
    manager, cold = _filled(factory)
    assert cold.runtime.noise_chunks[0].dtype == torch.float32  # TeleFuser draws its noise in fp32
    node = manager.forest.lookup(cold.runtime.world_kv_binding.root, cold.runtime.world_kv_binding.actions).node
    latent = manager.store.get_skeleton(node.skeleton.latent_locator)
    assert latent.dtype == torch.bfloat16 and tuple(latent.shape) == tuple(cold.runtime.noise_chunks[0].shape)
    assert torch.equal(latent.view(torch.int16), cold.latents[-1].view(torch.int16))


@pytest.mark.parametrize("fault", ["kv", "rng"])
def test_negative_controls_one_kv_value_or_one_draw_is_caught(factory, fault):
    """The ring check and the frames see one perturbed KV element or one extra RNG draw."""
    manager, cold = _filled(factory)
    k = 2
    reference = factory.make(ACTIONS, hooks=None)
    reference.generate(stop_after=k)
    before_k = reference.state_snapshot()
    reference.generate()

    # a session sharing the first K actions restores depth K
    warm = factory.make(ACTIONS[:k] + [[0.9, 0.9, 0.9, 0.9]] * (len(ACTIONS) - k),
                        hooks=_binding(manager, factory, ingest_enabled=False))
    warm.generate(stop_after=0)
    assert warm.runtime.world_kv_binding.last_fast_forward == k
    assert warm.materialize_restored() == k  # the served prefix restored, as the session's divergence does
    assert snapshot_diff(warm.state_snapshot(), before_k) == []

    if fault == "kv":
        ring = warm.runtime.self_kv_cache[1]["k"]
        ring.view(torch.int16)[0, 5, 0, 0] ^= 1  # one bit of one restored K value
        expect = "layer 1 k[:, :local_end] differs"
    else:
        torch.randn((1,), generator=warm.runtime.generator)
        expect = "generator state differs"
    assert expect in snapshot_diff(warm.state_snapshot(), before_k)
    # and the output shows it: chunk K, computed on the perturbed state, differs from the cold run
    same_actions = factory.make(ACTIONS, hooks=None)
    same_actions.runtime = warm.runtime
    same_actions.next_chunk = warm.next_chunk
    hashes = same_actions.generate()
    assert hashes[k] != reference.frame_hashes[k]


def test_hook_failures_are_counted_logged_once_and_run_cold(factory, caplog):
    """A binding whose manager disagrees with the ring fails in on_runtime_created: TeleFuser (or
    the installed hooks) runs cold; CacheSeek counts every failure and logs the first with its cause."""
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    cold = factory.make(ACTIONS, hooks=None)
    cold.generate()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            session = factory.make(ACTIONS, hooks=_binding(manager, factory))
            assert session.generate() == cold.frame_hashes  # cold, correct
    assert manager.metrics.hook_failures == 2
    assert manager.metrics.as_dict()["hook_failures_by_hook"] == {"on_runtime_created": 2}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "on_runtime_created failed" in r.getMessage()]
    assert len(errors) == 1 and "GeometryError" in errors[0].getMessage()


def test_attach_is_idempotent_and_detach_restores_the_pipeline(factory):
    pipeline = factory.pipeline
    assert attach(pipeline) is TeleFuserLayout.RELEASED  # PyPI 0.1.0.post3 has no hooks
    dit, stage = pipeline.dit, pipeline.denoise_stage
    assert attach(pipeline) is TeleFuserLayout.RELEASED and pipeline.dit is dit
    detach(pipeline)
    assert type(pipeline.dit).__name__ == "LingBotWorldFastDiT" and "create_runtime" not in vars(pipeline)
    assert pipeline.denoise_stage is stage.wrapped
    assert attach(pipeline) is TeleFuserLayout.RELEASED
    assert type(pipeline.denoise_stage).__name__ == "_DenoiseStage" and "create_runtime" in vars(pipeline)


def _fake_telefuser(runtime_fields, config_fields):
    """A TeleFuser-like package whose session types have only the given fields."""
    pkg = types.ModuleType("faketf.pipelines.lingbot")
    session = types.ModuleType("faketf.pipelines.lingbot.session")
    session.LingBotWorldFastRuntimeState = dataclasses.make_dataclass("LingBotWorldFastRuntimeState", runtime_fields)
    session.LingBotWorldFastSessionConfig = dataclasses.make_dataclass("LingBotWorldFastSessionConfig", config_fields)
    pipeline_mod = types.ModuleType("faketf.pipelines.lingbot.pipeline")
    cls = type("LingBotWorldFastPipeline", (), {"__module__": pipeline_mod.__name__})
    for name in ("create_runtime", "generate_next_chunk", "denoise_stage", "dit", "config"):
        setattr(cls, name, None)
    sys.modules[session.__name__] = session
    return cls()


def test_a_layout_without_the_ring_is_refused_with_what_is_missing():
    """TeleFuser main after 2026-07-13 keeps the KV behind cache handles: refused, not half-driven."""
    pipeline = _fake_telefuser(["noise_chunks", "generator", "timesteps", "chunk_size", "frame_tokens",
                                "current_chunk_index", "denoise_cache_handles"], ["prompt", "world_kv_binding"])
    with pytest.raises(UnsupportedTeleFuserError, match="self_kv_cache.*control_chunks|no self_kv_cache"):
        detect_layout(pipeline)


def test_layouts_are_told_apart_by_their_fields():
    ring = ["self_kv_cache", "noise_chunks", "control_chunks", "generator", "timesteps", "chunk_size",
            "frame_tokens", "current_chunk_index"]
    hooks = ["kv_local_attn_size", "kv_sink_size", "world_kv_binding", "world_kv_cached_latents"]
    assert detect_layout(_fake_telefuser(ring + hooks, ["prompt", "world_kv_binding"])) is TeleFuserLayout.HOOKED
    assert detect_layout(_fake_telefuser(ring, ["prompt"])) is TeleFuserLayout.RELEASED
    with pytest.raises(UnsupportedTeleFuserError, match="only part of the world_kv hooks"):
        detect_layout(_fake_telefuser(ring + hooks[:2], ["prompt"]))


def test_a_warming_store_is_bypassed_then_keys_are_lazy_on_the_real_pipeline(factory, gated):
    """On TeleFuser's loop: a session that starts while the Plan tier warms in the background runs
    as with no cache (no keys, nothing read or written, the same frames); once warm, a session
    writes every chunk with keys computed off the request path, equal to `action_keys`, and the
    next one restores its whole prefix."""
    from cacheseek.reuse.exact_prefix.actions import action_keys

    store, client = gated(64 << 20)
    cfg = make_rolling_config(local_attn_size=7, sink_size=3)
    manager = WorldKVManager(NamespaceForest(), store, cfg)
    baseline = factory.make(ACTIONS)
    baseline.generate()
    warming = _binding(manager, factory)
    run = factory.make(ACTIONS, hooks=warming)
    run.generate()
    assert warming.bypassed_warming and warming.root is None and list(warming.actions) == []
    assert run.frame_hashes == baseline.frame_hashes and len(manager.forest) == 0
    assert store.starts.starting == 0  # the session's start-up released the warm-up
    client.gate.set()
    assert store.wait_ready(30)
    writer = _binding(manager, factory)
    cold = factory.make(ACTIONS, hooks=writer)
    cold.generate()
    store.flush()
    assert not writer.bypassed_warming and writer.last_fast_forward == 0
    controls = writer.layout.controls(cold.runtime)
    assert list(writer.actions) == action_keys(list(controls)[: len(ACTIONS)])
    hit = _binding(manager, factory)
    again = factory.make(ACTIONS, hooks=hit)
    again.generate()
    assert hit.last_fast_forward == len(ACTIONS) and again.frame_hashes == baseline.frame_hashes
    assert hit.frames_served == len(ACTIONS) and hit.chunks_materialized == 0  # each chunk's frames, no KV
