"""TeleFuser's own Wan VAE and umT5 text encoder (random weights) in the real pipeline: chosen by
``runtime.vae=wan`` and ``runtime.text_encoder=umt5``, seeded, and a live session streamed on a
cached path gets a cold run's frames bit for bit through the Wan VAE's causal decode (restored
chunks' latents are decoded in order, so the decoder's feature cache is the cold run's)."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError
from cacheseek.integrations.telefuser.wan_parts import RecordingVAE
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

X = [[0.3, -0.2, 0.1, 0.5], [-0.5, 0.4, 0.0, -0.3], [0.1, 0.1, -0.3, 0.8]]
DIVERGE = X[:2] + [[-0.7, 0.6, 0.2, -0.6]]
REAL = dict(vae="wan", text_encoder="umt5", text_layers=1, height=32, width=32)


_factories: dict = {}
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs CUDA")])


def _factory(device: str) -> TeleFuserRuntimeFactory:
    if device not in _factories:
        _factories[device] = TeleFuserRuntimeFactory(**REAL, device=device)
    return _factories[device]


@pytest.fixture(scope="module")
def factory():
    return _factory("cpu")


def test_the_real_parts_are_telefusers_own_and_seeded(factory):
    from telefuser.models.wan_video_text_encoder import WanTextEncoder
    from telefuser.models.wan_video_vae import WanVideoVAE

    pipeline = factory.pipeline
    assert isinstance(pipeline.vae, RecordingVAE) and isinstance(pipeline.vae.vae, WanVideoVAE)
    encoder = pipeline.text_encoder
    assert isinstance(encoder, WanTextEncoder) and len(encoder.blocks) == 1 and encoder.dim == 32
    assert "Wan VAE, umT5 x1" in factory.describe()["model"] and factory.parts["vae"] == "wan"
    assert set(factory.build_timings["parts_parameters"]) == {"vae", "text_encoder"}
    reserve = factory.device_reserve(3)  # the decoder cache, estimated once, beside the ring
    assert reserve[-1][0] == "Wan VAE decode" and reserve[-1][1] > 0 and factory.device_reserve(3) == reserve

    same = TeleFuserRuntimeFactory(**REAL).pipeline
    other = TeleFuserRuntimeFactory(**REAL, weight_seed=1).pipeline
    for a, b, c in zip(pipeline.vae.parameters(), same.vae.parameters(), other.vae.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(pipeline.vae.parameters(), other.vae.parameters()))
    gammas = [p for n, p in pipeline.vae.named_parameters() if n.endswith("gamma")]
    assert gammas and all(abs(float(p.float().mean()) - 1.0) < 0.1 for p in gammas)  # scales near 1


@pytest.mark.parametrize("field, value", [("vae", "sdxl"), ("text_encoder", "clip")])
def test_an_unknown_part_is_refused_naming_the_field_and_the_choices(field, value):
    with pytest.raises(ConfigError, match=rf"runtime\.{field}.*{value}") as info:
        TeleFuserRuntimeFactory(**{**REAL, field: value})
    assert "stand_in" in str(info.value)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_a_streamed_session_on_a_cached_path_gets_the_cold_frames_through_the_wan_decoder(device):
    factory = _factory(device)

    def run(actions, manager=None):
        binding = None if manager is None else LingBotWorldKVBinding(
            manager, manager.forest, model_fingerprint=factory.weights_fingerprint)
        session = factory.make(actions, hooks=binding, streamed=True)
        frames = session.generate()
        if manager is not None:
            manager.store.flush()
        return frames

    cold = {"X": run(X), "DIVERGE": run(DIVERGE)}
    assert cold["X"][:2] == cold["DIVERGE"][:2] and cold["X"][2] != cold["DIVERGE"][2]
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())
    assert run(X, manager) == cold["X"]
    writes = manager.metrics.writes
    assert run(DIVERGE, manager) == cold["DIVERGE"]  # 2 chunks restored, then the Wan decoder continues
    assert manager.metrics.live_hits == 2 and manager.metrics.writes == writes + 1
