"""The synthetic runtime: ring semantics (docs/design.md section 1), determinism, sensitivity to every
byte of the attended window, RNG accounting, and a reference restore through its attributes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cacheseek.errors import ConfigError, GeometryError, LayoutMismatchError
from cacheseek.registry import RUNTIMES
from cacheseek.runtime import GEOMETRIES, Geometry, get_geometry, validate_window
from cacheseek.runtime.synthetic import (
    RingCursorError,
    SyntheticImage,
    SyntheticRuntimeFactory,
    SyntheticWorldRuntime,
    ring_write,
    snapshot_diff,
)

REPO = Path(__file__).resolve().parents[1]
TINY = get_geometry("tiny")
FT = TINY.frame_tokens
C = TINY.chunk_size
N_CHUNKS = 6
# (local_attn_size, sink_size): full length, and rolling with S > 0 and S = 0; all have L - S > c.
MODES = [(-1, 0), (7, 3), (6, 0), (5, 1)]
MODE_IDS = ["full", "L7S3", "L6S0", "L5S1"]


def actions(n: int = N_CHUNKS, *, change: int | None = None) -> list[list[float]]:
    acts = [[0.1 * i, -0.05 * i, 0.02, 0.3 * (i % 2)] for i in range(n)]
    if change is not None:
        acts[change] = [9.0, 0.0, -1.0, 0.5]
    return acts


def make(mode=(-1, 0), **kw) -> SyntheticWorldRuntime:
    kw.setdefault("actions", actions())
    return SyntheticWorldRuntime(TINY, local_attn_size=mode[0], sink_size=mode[1], **kw)


def flip_lsb(t: torch.Tensor, index: tuple) -> None:
    """Flip the lowest mantissa bit of one element (one byte changes; no NaN or Inf)."""
    b, s, h, d = index
    t.view(torch.uint8)[b, s, h, d * t.element_size()] ^= 1


# --- geometry ----------------------------------------------------------------------------------


def test_presets_have_the_reference_sizes():
    assert TINY.frame_tokens == 2 and TINY.chunk_tokens == 6
    assert TINY.kv_shape_per_chunk == (1, 6, 2, 4)
    lb = GEOMETRIES["lingbot_480p"]
    assert lb.frame_tokens == 1560 and lb.chunk_tokens == 4680 and lb.hidden == 5120
    assert lb.kv_shape_per_chunk == (1, 4680, 40, 128)
    assert lb.kv_nbytes_per_chunk(2) == 47_923_200 and lb.chunk_kv_nbytes(2) == 3_833_856_000  # 3.57 GiB
    assert lb.latent_shape == (1, 16, 3, 60, 104)
    assert lb.latent_nbytes(2) == 599_040
    assert get_geometry("small").frame_tokens == 16


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_layers": 0}, "geometry.n_layers"),
        ({"n_heads": -1}, "geometry.n_heads"),
        ({"head_dim": 3}, "geometry.head_dim"),
        ({"latent_w": 5}, "geometry.latent_w"),
        ({"chunk_size": True}, "geometry.chunk_size"),
        ({"name": ""}, "geometry.name"),
    ],
)
def test_geometry_validation_names_the_field(kwargs, field):
    base = dict(name="g", n_layers=1, n_heads=1, head_dim=2, latent_channels=1, latent_h=2,
                latent_w=2, chunk_size=1)
    with pytest.raises(ConfigError) as err:
        Geometry(**{**base, **kwargs})
    assert err.value.field == field


def test_unknown_geometry_lists_presets():
    with pytest.raises(ConfigError) as err:
        get_geometry("huge")
    assert err.value.field == "runtime.geometry"
    assert "tiny, small, lingbot_480p" in str(err.value)


@pytest.mark.parametrize(
    "window, field",
    [((5, 3), "runtime.local_attn_size"), ((0, 0), "runtime.local_attn_size"),
     ((-2, 0), "runtime.local_attn_size"), ((7, -1), "runtime.sink_size")],
)
def test_window_validation(window, field):
    with pytest.raises(GeometryError) as err:
        validate_window(TINY, *window)
    assert err.value.field == field and err.value.fix
    validate_window(TINY, -1, 0)
    validate_window(TINY, 6, 3)


def test_registry_names_a_runtime_without_importing_it():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import cacheseek.runtime.geometry as g\n"
        "assert g.get_geometry('tiny').frame_tokens == 2\n"
        "from cacheseek.registry import RUNTIMES\n"
        "assert 'synthetic' in RUNTIMES and 'cacheseek.runtime.synthetic' not in sys.modules\n"
        "print('ok')\n"
    )
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- ring semantics ----------------------------------------------------------------------------


def _frame_tagged(first_frame: int, n_frames: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    frames = torch.arange(first_frame, first_frame + n_frames).repeat_interleave(FT)
    k = frames.float()[None, :, None, None].expand(1, -1, 1, 1).clone()
    return k, k + 1000 * call


def test_ring_worked_example_L7_S3():
    """docs/design.md section 1: L=7, S=3, c=3; each chunk written 5 times, only the first call advances."""
    L, S = 7, 3
    cache = {"k": torch.full((1, L * FT, 1, 1), -1.0), "v": torch.full((1, L * FT, 1, 1), -1.0),
             "global_end_index": 0, "local_end_index": 0}
    table = {1: ([0, 1, 2], 3, 3), 2: ([0, 1, 2, 3, 4, 5], 6, 6),
             3: ([0, 1, 2, 5, 6, 7, 8], 7, 9), 4: ([0, 1, 2, 8, 9, 10, 11], 7, 12)}
    for chunk in range(4):
        for call in range(5):
            k, v = _frame_tagged(chunk * C, C, call)
            first = ring_write(cache, k, v, start_token=chunk * C * FT, sink_tokens=S * FT)
            assert first == (call == 0)
        frames, local_end, global_end = table[chunk + 1]
        assert cache["local_end_index"] == local_end * FT
        assert cache["global_end_index"] == global_end * FT
        held = cache["k"][0, : cache["local_end_index"], 0, 0][::FT].long().tolist()
        assert held == frames
        tail = cache["v"][0, cache["local_end_index"] - C * FT : cache["local_end_index"], 0, 0]
        assert (tail >= 4000).all()
        assert ((cache["v"][0, :, 0, 0] % 1000) == cache["k"][0, :, 0, 0] % 1000).all()


def test_ring_rejects_out_of_order_writes():
    cache = {"k": torch.zeros(1, 6, 1, 1), "v": torch.zeros(1, 6, 1, 1),
             "global_end_index": 0, "local_end_index": 0}
    k = torch.zeros(1, 3, 1, 1)
    with pytest.raises(RingCursorError):
        ring_write(cache, k, k, start_token=3, sink_tokens=0)
    ring_write(cache, k, k, start_token=0, sink_tokens=0)
    with pytest.raises(RingCursorError):
        ring_write(cache, k, k, start_token=6, sink_tokens=0)
    assert cache["global_end_index"] == 3 and cache["local_end_index"] == 3


def test_runtime_ring_follows_the_worked_example():
    rt = make((7, 3))
    assert rt.kv_size == 7 * FT
    snaps = {}
    for k_done, (local_end, global_end) in {1: (3, 3), 2: (6, 6), 3: (7, 9), 4: (7, 12)}.items():
        rt.generate(stop_after=k_done)
        snaps[k_done] = rt.state_snapshot()
        for layer in snaps[k_done]["layers"]:
            cursors = (layer["local_end_index"], layer["global_end_index"])
            assert cursors == (local_end * FT, global_end * FT)
    for name in ("k", "v"):
        s2, s3, s4 = (snaps[i]["layers"][1][name][0] for i in (2, 3, 4))
        frame = lambda t, f: t[f * FT : (f + 1) * FT]  # noqa: E731
        assert torch.equal(s3[: 3 * FT], s2[: 3 * FT])  # sink pinned
        assert torch.equal(frame(s3, 3), frame(s2, 5))  # frame 5 shifted to slot 3
        assert torch.equal(frame(s4, 3), frame(s3, 6))  # frame 8 shifted to slot 3
        assert torch.equal(s4[: 3 * FT], s2[: 3 * FT])


def test_full_length_cursors_and_size():
    rt = make()
    assert rt.kv_size == FT * N_CHUNKS * C == rt.session_config.max_attention_size
    for k_done in range(1, N_CHUNKS + 1):
        rt.generate(stop_after=k_done)
        for layer in rt.self_kv_cache:
            assert layer["global_end_index"] == layer["local_end_index"] == k_done * C * FT
            assert type(layer["local_end_index"]) is int


# --- determinism and sensitivity -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cold_runs_are_deterministic(mode):
    a, b = make(mode), make(mode)
    ha, hb = a.generate(), b.generate()
    assert ha == hb and len(ha) == N_CHUNKS and all(len(h) == 32 for h in ha)
    assert len(set(ha)) == N_CHUNKS
    assert snapshot_diff(a.state_snapshot(), b.state_snapshot()) == []


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_action_change_changes_that_chunk_and_all_later(mode):
    base = make(mode).generate()
    changed = make(mode, actions=actions(change=1)).generate()
    assert changed[0] == base[0]
    assert all(x != y for x, y in zip(changed[1:], base[1:]))


def test_seed_prompt_and_image_change_outputs():
    base = make().generate()
    assert make(seed=99).generate()[0] != base[0]
    assert make(prompt="a blue boat").generate()[0] != base[0]
    img = SyntheticImage("RGB", (2, 2), bytes(range(12)))
    assert make(image=img).generate()[0] != base[0]


def _corrupted_run(mode, after: int, where: list[tuple[int, str, int]], **kw) -> list[bytes]:
    rt = make(mode, **kw)
    rt.generate(stop_after=after)
    for layer, name, slot in where:
        flip_lsb(rt.self_kv_cache[layer][name], (0, slot, 0, 0))
    return rt.generate()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("which", ["first", "last"])
def test_one_flipped_ring_byte_changes_every_later_chunk(mode, which):
    base = make(mode).generate()
    after = 2
    rt = make(mode)
    rt.generate(stop_after=after)
    local_end = rt.self_kv_cache[0]["local_end_index"]
    if which == "first":
        where = [(0, "k", 0)] if mode[1] > 0 or mode[0] == -1 else [(0, "k", local_end - 1)]
    else:
        where = [(TINY.n_layers - 1, "v", local_end - 1)]
    out = _corrupted_run(mode, after, where)
    assert out[:after] == base[:after]
    assert all(x != y for x, y in zip(out[after:], base[after:]))


def test_evicted_slot_does_not_matter():
    """After 3 chunks (L=7, S=3) slot 3 holds frame 5, which chunk 3's shift evicts."""
    base = make((7, 3)).generate()
    out = _corrupted_run((7, 3), 3, [(layer, name, 3 * FT + t) for layer in range(TINY.n_layers)
                                     for name in ("k", "v") for t in range(FT)])
    assert out == base


# --- RNG accounting ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [1, 3])
def test_rng_draws_per_chunk(num_steps):
    """As TeleFuser: one float32 draw for the whole video split per chunk, then len(timesteps)-1
    draws of x0's shape in the model dtype (bf16) per denoised chunk."""
    rt = make(num_steps=num_steps)
    ref = torch.Generator(device="cpu").manual_seed(1234)
    c = TINY.chunk_size
    whole = torch.randn((1, TINY.latent_channels, len(rt.noise_chunks) * c, TINY.latent_h, TINY.latent_w),
                        generator=ref, dtype=torch.float32)
    for i, noise in enumerate(rt.noise_chunks):
        assert noise.dtype == torch.float32 and noise.shape == TINY.latent_shape
        assert torch.equal(noise, whole[:, :, i * c : (i + 1) * c])
    assert len(rt.timesteps) == num_steps
    for k_done in range(1, 4):
        rt.generate(stop_after=k_done)
        for _ in range(num_steps - 1):
            torch.randn(TINY.latent_shape, generator=ref, dtype=torch.bfloat16)
        assert torch.equal(rt.generator.get_state(), ref.get_state())
        assert rt.latents[-1].dtype == torch.bfloat16


# --- a reference restore through the binding's attributes --------------------------------------


class Recorder:
    """Records what a binding ingests: each chunk's ring tail (per layer) and latent, and the
    runtime's state right after each chunk is finalized (the cold state before the next chunk)."""

    def __init__(self):
        self.tails, self.latents, self.states = {}, {}, {}
        self.created = []

    def on_runtime_created(self, runtime, session_config):
        self.created.append(session_config)

    def on_chunk_finalized(self, runtime, idx, denoised):
        n = runtime.chunk_size * runtime.frame_tokens
        self.tails[idx] = [
            (c["k"][:, c["local_end_index"] - n : c["local_end_index"]].clone(),
             c["v"][:, c["local_end_index"] - n : c["local_end_index"]].clone())
            for c in runtime.self_kv_cache
        ]
        self.latents[idx] = denoised.clone()
        self.states[idx + 1] = runtime.state_snapshot()


def window_frames(depth: int, chunk: int, local_attn: int, sink: int) -> list[int]:
    total = depth * chunk
    if local_attn == -1 or total <= local_attn:
        return list(range(total))
    return list(range(sink)) + list(range(total - (local_attn - sink), total))


class RestoreFrom:
    """Restores depth K from a Recorder the way LingBotWorldKVBinding must (docs/api.md)."""

    def __init__(self, rec: Recorder, depth: int):
        self.rec, self.depth = rec, depth

    def on_runtime_created(self, rt, session_config):
        ft, c = rt.frame_tokens, rt.chunk_size
        frames = window_frames(self.depth, c, rt.kv_local_attn_size, rt.kv_sink_size)
        for layer, cache in enumerate(rt.self_kv_cache):
            for slot, frame in enumerate(frames):
                k, v = self.rec.tails[frame // c][layer]
                off = (frame % c) * ft
                cache["k"][:, slot * ft : (slot + 1) * ft] = k[:, off : off + ft]
                cache["v"][:, slot * ft : (slot + 1) * ft] = v[:, off : off + ft]
            cache["global_end_index"] = self.depth * c * ft
            cache["local_end_index"] = len(frames) * ft
        for i in range(self.depth):
            rt.world_kv_cached_latents[i] = self.rec.latents[i].clone()
            for _ in range(len(rt.timesteps) - 1):
                n = rt.noise_chunks[i]
                torch.randn(n.shape, generator=rt.generator, device=n.device, dtype=torch.bfloat16)

    def on_chunk_finalized(self, rt, idx, denoised):
        assert idx >= self.depth


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_restore_at_every_depth_reproduces_the_cold_run(mode):
    rec = Recorder()
    cold = make(mode, hooks=rec)
    hashes = cold.generate()
    assert len(rec.created) == 1 and set(rec.tails) == set(range(N_CHUNKS))
    for depth in range(1, N_CHUNKS):
        rt = make(mode, hooks=RestoreFrom(rec, depth))
        assert rt.generate(stop_after=depth) == hashes[:depth]
        assert rt.restored_chunks == list(range(depth)) and not rt.world_kv_cached_latents
        assert snapshot_diff(rt.state_snapshot(), rec.states[depth]) == []
        assert rt.generate() == hashes


def test_restore_that_misplaces_frames_is_caught():
    """Right bytes in the wrong slots (sink frames 1 and 2 swapped) diverge from the cold run."""
    mode, depth = (7, 3), 3
    rec = Recorder()
    hashes = make(mode, hooks=rec).generate()

    class Swapped(RestoreFrom):
        def on_runtime_created(self, rt, session_config):
            super().on_runtime_created(rt, session_config)
            for cache in rt.self_kv_cache:
                a, b = slice(1 * FT, 2 * FT), slice(2 * FT, 3 * FT)
                k = cache["k"]
                k[:, a], k[:, b] = k[:, b].clone(), k[:, a].clone()

    out = make(mode, hooks=Swapped(rec, depth)).generate()
    assert out[:depth] == hashes[:depth]
    assert all(x != y for x, y in zip(out[depth:], hashes[depth:]))


def test_cached_latent_of_wrong_shape_is_rejected():
    rt = make()
    rt.world_kv_cached_latents[0] = torch.zeros(1, 2, 3, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError):
        rt.generate()


# --- attributes, dtypes, compute, registration -------------------------------------------------


def test_binding_attributes():
    rt = make((7, 3), total_chunks=4)
    sc = rt.session_config
    assert (sc.frame_num, sc.chunk_size, sc.max_attention_size, sc.seed) == (12, 3, 14, 1234)
    assert sc.sample_shift == 5.0 and sc.control_mode == "cam" and sc.max_sequence_length == 512
    assert sc.image.mode == "RGB" and isinstance(sc.image.tobytes(), bytes)
    assert len(rt.control_chunks) == 4 and rt.control_chunks[1].dtype == torch.float32
    assert rt.control_chunks[1].shape == (1, 384, 3, TINY.latent_h, TINY.latent_w)
    assert (rt.chunk_size, rt.frame_tokens, rt.kv_local_attn_size, rt.kv_sink_size) == (3, 2, 7, 3)
    assert rt.device == torch.device("cpu") and rt.dtype == torch.bfloat16
    assert len(rt.self_kv_cache) == 2 and rt.self_kv_cache[0]["k"].shape == (1, 14, 2, 4)
    assert len(rt.noise_chunks) == 4 and rt.generator.device.type == "cpu"
    assert len(rt.generate()) == 4 and len(rt.frame_hashes) == 4


def test_weights_fingerprint_is_of_the_model_not_the_session():
    a, b = make(), make((6, 0), seed=7, actions=actions(2))
    assert a.weights_fingerprint == b.weights_fingerprint and len(a.weights_fingerprint) == 32
    small = SyntheticWorldRuntime(get_geometry("small"), actions=actions(1))
    assert small.weights_fingerprint != a.weights_fingerprint
    assert make(compute={"gemm_dim": 8}).weights_fingerprint != a.weights_fingerprint


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes(dtype):
    a, b = make((5, 1), dtype=dtype), make((5, 1), dtype=dtype)
    assert a.generate() == b.generate()
    assert a.self_kv_cache[0]["k"].dtype == getattr(torch, dtype)
    assert a.noise_chunks[0].dtype == torch.float32
    assert a.latents[0].dtype == getattr(torch, dtype)
    base = a.frame_hashes
    out = _corrupted_run((5, 1), 2, [(0, "k", 0)], dtype=dtype)
    assert out[:2] == base[:2] and all(x != y for x, y in zip(out[2:], base[2:]))


def test_compute_model_runs_and_is_folded_in():
    plain = make().generate()
    a = make(compute={"gemm_dim": 8, "gemms_per_layer_step": 2}).generate()
    assert a == make(compute={"gemm_dim": 8, "gemms_per_layer_step": 2}).generate()
    assert a != plain
    with pytest.raises(ConfigError) as err:
        make(compute={"gemm_dim": 0})
    assert err.value.field == "runtime.compute.gemm_dim"
    with pytest.raises(ConfigError):
        make(compute={"flops": 1})


@pytest.mark.parametrize(
    "kwargs, field",
    [({"actions": []}, "runtime.actions"), ({"total_chunks": 9}, "runtime.total_chunks"),
     ({"dtype": "int8"}, "runtime.dtype"), ({"num_steps": 0}, "runtime.num_steps"),
     ({"device": "tpu"}, "runtime.device"), ({"hooks": object()}, "runtime.hooks"),
     ({"local_attn_size": 4, "sink_size": 2}, "runtime.local_attn_size")],
)
def test_runtime_argument_errors_name_the_field(kwargs, field):
    kw = {"actions": actions(), **kwargs}
    with pytest.raises(ConfigError) as err:
        SyntheticWorldRuntime(TINY, **kw)
    assert err.value.field == field


def test_registered_factory_composes_and_makes_runtimes():
    from hydra.core.config_store import ConfigStore
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    assert RUNTIMES.get("synthetic") is SyntheticRuntimeFactory
    assert "synthetic.yaml" in ConfigStore.instance().repo["schema"]["runtime"]
    cfg = OmegaConf.structured(RUNTIMES.schema("synthetic")(local_attn_size=7, sink_size=3))
    factory = instantiate(cfg)
    assert isinstance(factory, SyntheticRuntimeFactory)
    assert (factory.geometry, factory.local_attn_size, factory.sink_size) == (TINY, 7, 3)
    assert (factory.device, factory.dtype) == ("cpu", "bfloat16")
    rt = factory.make(actions(3), total_chunks=2)
    assert rt.total_chunks == 2 and rt.session_config.prompt == factory.prompt
    assert rt.generate() == factory.make(actions(3), total_chunks=2).generate()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"geometry": "huge"}, "runtime.geometry"), ({"dtype": "fp8"}, "runtime.dtype"),
     ({"sink_size": -1}, "runtime.sink_size"), ({"num_steps": 0}, "runtime.num_steps"),
     ({"compute_gemm_dim": -4}, "runtime.compute_gemm_dim")],
)
def test_factory_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SyntheticRuntimeFactory(**kwargs)
    assert err.value.field == field


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        SyntheticRuntimeFactory(device="cuda")
    assert err.value.field == "runtime.device"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_restore_reproduces_the_cold_run():
    mode = (7, 3)
    rec = Recorder()
    hashes = make(mode, hooks=rec, device="cuda").generate()
    rt = make(mode, hooks=RestoreFrom(rec, 3), device="cuda")
    assert rt.generate(stop_after=3) == hashes[:3]
    assert snapshot_diff(rt.state_snapshot(), rec.states[3]) == []
    assert rt.generate() == hashes
    assert not math.isnan(float(rt.latents[-1].float().abs().max()))
