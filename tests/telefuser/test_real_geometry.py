"""Issue 24, items 1 and 3 on TeleFuser's real pipeline: the telefuser runtime takes LingBot-World's
geometry (head_dim accepted exactly when TeleFuser's DiT runs it), the lingbot_world_14b preset
composes to the real sizes, the DiT is built on its device in bf16, and the HBM tier's ``auto``
size is fitted to the device's room after the runtime's own needs, said at start."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ConfigError
from cacheseek.integrations.telefuser import tiny
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory, camera_path
from cacheseek.runtime.telefuser_frames import pil_image

SMALL = dict(n_layers=1, n_heads=1, height=32, width=32)


def _telefuser_runs(head_dim: int) -> bool:
    """One chunk of TeleFuser's pipeline at ``head_dim``, built without our check."""
    from telefuser.pipelines.lingbot_world_fast.session import LingBotWorldFastSessionConfig

    spec = tiny.TinyDiTSpec.__new__(tiny.TinyDiTSpec)
    spec.n_layers, spec.n_heads, spec.head_dim, spec.text_dim, spec.weight_seed = 1, 1, head_dim, 32, 0
    spec.ffn_dim = 2 * head_dim
    pipeline = tiny.build_tiny_pipeline(spec=spec, height=32, width=32)
    if tiny.is_streaming_telefuser():
        pytest.skip("the release's create_runtime path")
    poses, intrinsics = camera_path([[0.1]], chunk_size=3, width=32, height=32)
    cfg = LingBotWorldFastSessionConfig(prompt="p", image=pil_image(None, 32, 32), control_mode="cam", chunk_size=3,
                                        frame_num=len(poses), seed=1, poses=poses, intrinsics=intrinsics)
    try:
        pipeline.generate_next_chunk(pipeline.create_runtime(cfg))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("head_dim", [8, 10, 14, 16])
def test_head_dim_is_accepted_exactly_when_telefusers_dit_runs_it(head_dim):
    runs = _telefuser_runs(head_dim)
    if runs:
        TeleFuserRuntimeFactory(head_dim=head_dim, **SMALL)
    else:
        with pytest.raises(ConfigError) as info:
            TeleFuserRuntimeFactory(head_dim=head_dim, **SMALL)
        assert info.value.field == "runtime.head_dim" and "128" in info.value.fix
    assert runs == (head_dim % 6 in (0, 2))


def test_lingbot_world_geometry_is_accepted_without_building_anything():
    f = TeleFuserRuntimeFactory(n_layers=40, n_heads=40, head_dim=128, ffn_dim=13824, text_dim=4096,
                                height=480, width=832)
    g = f.geometry
    assert (g.n_layers, g.hidden, g.chunk_tokens) == (40, 5120, 3 * 30 * 52) and not f.built


def test_the_runtime_reserves_its_ring_and_activations_after_building_its_weights():
    f = TeleFuserRuntimeFactory(head_dim=14, n_layers=2, n_heads=1, height=32, width=48)
    (ring_name, ring), (act_name, activations) = f.device_reserve(3)
    g = f.geometry
    assert f.built and (ring_name, act_name) == ("ring", "activations")
    assert ring == 2 * 2 * 9 * g.frame_tokens * 14 * 2  # K and V of 3 chunks of 3 frames, every layer, bf16
    assert activations > f.ACTIVATION_HEADROOM
    rolling = TeleFuserRuntimeFactory(head_dim=14, n_layers=2, n_heads=1, height=32, width=48, local_attn_size=6,
                                      sink_size=3)
    assert rolling.device_reserve(5)[0][1] == 2 * 2 * 6 * g.frame_tokens * 14 * 2  # the window, not the session


def test_the_preset_composes_to_the_real_sizes(compose_cfg):
    cfg = compose_cfg("+experiment=lingbot_world_14b")
    r = cfg.runtime
    assert r._target_.endswith("TeleFuserRuntimeFactory") and r.device == "cuda"
    assert (r.n_layers, r.n_heads, r.head_dim, r.ffn_dim, r.text_dim, r.height, r.width) == \
        (40, 40, 128, 13824, 4096, 480, 832)
    assert (r.vae, r.text_encoder, r.text_layers) == ("wan", "umt5", 24)  # TeleFuser's own parts, umT5-XXL's depth
    assert (cfg.workload.total_chunks, cfg.workload.prefix_chunks) == (3, 2)
    live = compose_cfg("runtime=telefuser", "+model=lingbot_world_14b", "workload=interactive")  # the model alone
    assert live.runtime == r and live.workload._target_.endswith("InteractiveWorkload")


def test_ffn_and_text_dims_reach_the_dit_and_the_weights_stay_seeded():
    f = TeleFuserRuntimeFactory(head_dim=14, ffn_dim=40, text_dim=24, weight_seed=3, **SMALL)
    dit = f.pipeline.dit
    assert dit.ffn_dim == 40 and dit.text_dim == 24
    assert {p.dtype for p in dit.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    assert f.build_timings["parameters"] == sum(p.numel() for p in dit.parameters())
    again = TeleFuserRuntimeFactory(head_dim=14, ffn_dim=40, text_dim=24, weight_seed=3, **SMALL)
    assert again.weights_fingerprint == f.weights_fingerprint
    other = TeleFuserRuntimeFactory(head_dim=14, ffn_dim=40, text_dim=24, weight_seed=4, **SMALL)
    assert other.weights_fingerprint != f.weights_fingerprint


def test_hbm_auto_is_fitted_to_the_room_after_the_runtime_and_said(compose_cfg, tmp_path, monkeypatch):
    from cacheseek import sizes
    from cacheseek.orchestrator import build_stack

    args = ("runtime=telefuser", "runtime.head_dim=14", "runtime.n_layers=1", "runtime.n_heads=1",
            "runtime.height=32", "runtime.width=32", "+store=tiered", "store.tiers=[hbm,memory]")
    lines: list[str] = []
    stack = build_stack(compose_cfg(*args), run_dir=tmp_path, note=lines.append)
    try:
        line = next(x for x in lines if x.startswith("store.hbm.capacity_bytes=auto"))
        assert "room: 80% of" in line and "less the runtime's ring" in line and "activations" in line
    finally:
        stack.close()
    room = TeleFuserRuntimeFactory.ACTIVATION_HEADROOM  # less than the runtime's own needs: no room left
    monkeypatch.setattr(sizes, "device_free_bytes", lambda dev: room)
    with pytest.raises(ConfigError) as info:
        build_stack(compose_cfg(*args), run_dir=tmp_path)
    assert info.value.field == "store.hbm.capacity_bytes" and "free memory on cpu" in str(info.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_dit_is_built_on_the_gpu_in_bf16():
    f = TeleFuserRuntimeFactory(device="cuda", head_dim=128, n_heads=2, n_layers=2, ffn_dim=512, text_dim=64,
                                height=64, width=64)
    params = list(f.pipeline.dit.parameters())
    assert {p.device.type for p in params} == {"cuda"} and {p.dtype for p in params} == {torch.bfloat16}
    assert len(f.weights_fingerprint) == 16 and f.build_timings["fingerprint_s"] >= 0
    cpu = TeleFuserRuntimeFactory(head_dim=128, n_heads=2, n_layers=2, ffn_dim=512, text_dim=64, height=64, width=64)
    assert f.pipeline.dit.freqs_cos.device.type == "cpu"  # TeleFuser's RoPE tables, as a checkpoint's DiT has them
    assert torch.equal(f.pipeline.dit.freqs_cos, cpu.pipeline.dit.freqs_cos)
    assert torch.equal(f.pipeline.dit.freqs_sin, cpu.pipeline.dit.freqs_sin)
    assert len(f.make([[0.1], [0.2]]).generate()) == 2
