"""The synthetic runtime's roles alone: byte helpers, weights and their fingerprint, the model's
token layout and ring writes, the sampler's schedule, the argument checks and the registration.
The whole runtime is tested (digests, ring semantics, restores) in tests/test_synthetic_runtime.py."""

from __future__ import annotations

import math

import pytest
import torch

from cacheseek.errors import ConfigError
from cacheseek.registry import RUNTIMES
from cacheseek.runtime import get_geometry
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory, control_tensor
from cacheseek.runtime.synthetic.checks import check_actions, check_compute, check_device, check_int
from cacheseek.runtime.synthetic.hashing import lp, splitmix64, tensor_bytes, unit_floats
from cacheseek.runtime.synthetic.model import SyntheticModel, rope
from cacheseek.runtime.synthetic.runtime import sigma_schedule
from cacheseek.runtime.synthetic.session import default_image
from cacheseek.runtime.synthetic.weights import make_weights, weights_fingerprint

TINY = get_geometry("tiny")


# --- hashing -------------------------------------------------------------------------------------


def test_length_prefixed_framing_is_unambiguous():
    assert lp(b"ab", b"c") != lp(b"a", b"bc")
    assert lp(b"") == (0).to_bytes(8, "little")


def test_splitmix64_is_the_reference_finalizer():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the first output of splitmix64 seeded with 0
    assert splitmix64(1 << 70) == splitmix64(0)  # taken modulo 2**64


def test_unit_floats_are_deterministic_and_in_range():
    a = unit_floats(b"x", 64)
    assert a == unit_floats(b"x", 64) and a != unit_floats(b"y", 64)
    assert len(a) == 64 and all(-1.0 <= v <= 1.0 for v in a)


def test_tensor_bytes_are_the_raw_bytes():
    t = torch.tensor([1.0], dtype=torch.bfloat16)
    assert tensor_bytes(t) == t.view(torch.int16).numpy().tobytes() and len(tensor_bytes(t)) == 2


# --- weights -------------------------------------------------------------------------------------


def test_weights_are_seeded_and_shaped_as_documented():
    w = make_weights(TINY, None)
    feats = TINY.latent_channels * TINY.patch**2
    assert w["embed.in"].shape == (feats, feats) and w["L1.kh"].shape == (feats, TINY.n_heads)
    assert w["L0.od"].shape == (TINY.head_dim, feats) and "compute.w" not in w
    assert all(torch.equal(w[k], v) for k, v in make_weights(TINY, None).items())
    assert make_weights(TINY, {"gemm_dim": 8, "gemms_per_layer_step": 1})["compute.w"].shape == (8, 8)


def test_fingerprint_changes_with_any_weight_and_the_gemm_chain():
    w = make_weights(TINY, None)
    fp = weights_fingerprint(w, None)
    assert fp == weights_fingerprint(make_weights(TINY, None), None) and len(fp) == 32
    w["L1.mix"].view(torch.int32)[0, 0] ^= 1
    assert weights_fingerprint(w, None) != fp
    g1, g2 = {"gemm_dim": 8, "gemms_per_layer_step": 1}, {"gemm_dim": 8, "gemms_per_layer_step": 2}
    wg = make_weights(TINY, g1)
    assert weights_fingerprint(wg, g1) != weights_fingerprint(wg, g2)


# --- model ---------------------------------------------------------------------------------------


def model(**kw) -> SyntheticModel:
    kv_size = TINY.frame_tokens * 2 * TINY.chunk_size
    args = dict(actions=[[0.1], [0.2]], prompt="p", image=default_image(), kv_size=kv_size,
                device=torch.device("cpu"), dtype=torch.bfloat16, gemm=None)
    return SyntheticModel(TINY, **{**args, **kw})


def ring(m: SyntheticModel, kv_size: int) -> list[dict]:
    shape = (1, kv_size, TINY.n_heads, TINY.head_dim)
    return [{"k": torch.zeros(shape, dtype=m.dtype), "v": torch.zeros(shape, dtype=m.dtype),
             "global_end_index": 0, "local_end_index": 0} for _ in range(TINY.n_layers)]


def test_patchify_round_trips_in_frame_major_order():
    m = model()
    x = torch.arange(math.prod(TINY.latent_shape), dtype=torch.float32).reshape(TINY.latent_shape)
    tokens = m.patchify(x)
    assert tokens.shape == (TINY.chunk_tokens, TINY.latent_channels * TINY.patch**2)
    assert torch.equal(m.unpatchify(tokens), x)
    # the first frame's tokens come first
    assert set(tokens[: TINY.frame_tokens].flatten().tolist()) == set(x[0, :, 0].flatten().tolist())


def test_rotary_uses_absolute_frames_and_rope_keeps_pair_norms():
    m = model()
    cos, sin = m.rotary(0)
    assert cos.shape == (TINY.chunk_tokens, 1, TINY.head_dim // 2)
    assert torch.all(cos[: TINY.frame_tokens] == 1) and torch.all(sin[: TINY.frame_tokens] == 0)
    cos1, _ = m.rotary(1)
    assert torch.equal(cos1[0, 0], torch.cos(TINY.chunk_size * m.inv_freq))  # chunk 1 starts at frame c
    x = torch.randn(TINY.chunk_tokens, TINY.n_heads, TINY.head_dim, generator=torch.Generator().manual_seed(0))
    y = rope(x, cos1, m.rotary(1)[1])
    pairs = lambda t: t[..., 0::2] ** 2 + t[..., 1::2] ** 2  # noqa: E731
    assert torch.allclose(pairs(x), pairs(y), atol=1e-5)


def test_forward_writes_every_layer_once_per_chunk_and_caches_the_window_term():
    m = model()
    kv_size = TINY.frame_tokens * 2 * TINY.chunk_size
    caches, window = ring(m, kv_size), {}
    x = torch.zeros(TINY.latent_shape, dtype=m.dtype)
    out = m.forward(x, 0, 1.0, window, caches, sink_tokens=0)
    assert out.shape == TINY.latent_shape and out.dtype == torch.float32
    assert sorted(window) == list(range(TINY.n_layers))
    assert [(c["global_end_index"], c["local_end_index"]) for c in caches] == [(TINY.chunk_tokens,) * 2] * 2
    m.forward(out.to(m.dtype), 0, 0.0, window, caches, sink_tokens=0)  # a rewrite does not advance
    assert caches[0]["global_end_index"] == TINY.chunk_tokens
    assert m.decode(out.to(m.dtype)).shape == (TINY.chunk_size, 3, TINY.latent_h, TINY.latent_w)


def test_the_model_depends_on_prompt_and_action():
    a, b, c = model(), model(prompt="q"), model(actions=[[0.1], [0.3]])
    assert not torch.equal(a.cond, b.cond) and torch.equal(a.action_emb[0], c.action_emb[0])
    assert not torch.equal(a.action_emb[1], c.action_emb[1]) and a.fingerprint == b.fingerprint


# --- sampler, checks, controls, registration -------------------------------------------------------


def test_sigma_schedule_is_shifted_and_ends_at_zero():
    s = sigma_schedule(4)
    assert len(s) == 5 and s[0] == 1.0 and s[-1] == 0.0 and s == sorted(s, reverse=True)
    assert s[2] == pytest.approx(5.0 * 0.5 / (1.0 + 4.0 * 0.5))


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: check_int("runtime.x", True, 0), "runtime.x"),
        (lambda: check_actions([[0.0] * 17]), "runtime.actions"),
        (lambda: check_actions([[math.nan]]), "runtime.actions"),
        (lambda: check_actions("abc"), "runtime.actions"),
        (lambda: check_compute({"gemm_dim": 8, "chain": 2}), "runtime.compute"),
        (lambda: check_compute({"gemm_dim": 0}), "runtime.compute.gemm_dim"),
        (lambda: check_device("tpu"), "runtime.device"),
    ],
)
def test_checks_name_the_field(call, field):
    with pytest.raises(ConfigError) as ei:
        call()
    assert ei.value.field == field


def test_checks_pass_good_values_through():
    assert check_actions([(1, 2)]) == [[1.0, 2.0]]
    assert check_compute({"gemm_dim": 8}) == {"gemm_dim": 8, "gemms_per_layer_step": 1}
    assert check_compute(None) is None and check_device("cpu") == torch.device("cpu")


def test_control_tensor_has_the_pipeline_shape_and_separates_actions():
    t = control_tensor(TINY, [0.5, -1.0])
    assert t.shape == (1, 384, TINY.chunk_size, TINY.latent_h, TINY.latent_w) and t.dtype == torch.float32
    assert not torch.equal(t, control_tensor(TINY, [0.5, -1.0, 1e-3]))


def test_the_factory_is_registered_under_its_package_path():
    assert RUNTIMES.get("synthetic") is SyntheticRuntimeFactory
    target = f"{SyntheticRuntimeFactory.__module__}.{SyntheticRuntimeFactory.__qualname__}"
    assert target == RUNTIMES.schema("synthetic")._target_ == "cacheseek.runtime.synthetic.SyntheticRuntimeFactory"
