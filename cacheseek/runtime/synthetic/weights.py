"""The synthetic model's weights and their fingerprint.

The weights are drawn in a fixed order from a fixed seed (not the session seed: the weights are
the model, the seed is the session), fp32 on CPU; names and shapes (``F = C * patch**2``
features, ``H`` heads, ``D`` head dim):

- ``embed.in`` ``[F, F]``, ``embed.time_freq`` / ``embed.time_phase`` ``[F]``,
  ``embed.action`` ``[MAX_ACTION_DIM, F]``;
- per layer ``L{l}.``: ``kh``/``vh``/``qh`` ``[F, H]``, ``kd``/``vd``/``qd`` ``[F, D]``,
  ``kb``/``vb`` ``[H, D]``, ``oh`` ``[H, F]``, ``od`` ``[D, F]``, ``mix`` ``[H, F]``;
- ``head.out`` ``[F, F]``, ``decode.proj`` ``[C, 3]``;
- with the optional compute term: ``compute.expand`` ``[F, G]`` and ``compute.w`` ``[G, G]``.

`weights_fingerprint` is the sha256 the binding puts in the namespace: any weight, and the GEMM
chain length, changes it.
"""

from __future__ import annotations

import hashlib
import math

import torch

from cacheseek.runtime.geometry import Geometry
from cacheseek.runtime.synthetic.control import MAX_ACTION_DIM
from cacheseek.runtime.synthetic.hashing import lp, tensor_bytes

__all__ = ["WEIGHT_SEED", "make_weights", "weights_fingerprint"]

WEIGHT_SEED = 0x5EED_CAC4E


def make_weights(g: Geometry, gemm: dict | None) -> dict[str, torch.Tensor]:
    """The model's fp32 weights on CPU (see the module docstring); ``gemm``: the checked compute
    settings (`check_compute`) or None."""
    gen = torch.Generator(device="cpu").manual_seed(WEIGHT_SEED)
    feats = g.latent_channels * g.patch * g.patch
    hd, d = g.n_heads, g.head_dim

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * scale

    w: dict[str, torch.Tensor] = {
        "embed.in": rnd(feats, feats, scale=1.0 / math.sqrt(feats)),
        "embed.time_freq": rnd(feats, scale=3.0),
        "embed.time_phase": rnd(feats, scale=1.0),
        "embed.action": rnd(MAX_ACTION_DIM, feats, scale=0.5),
    }
    for layer in range(g.n_layers):
        p = f"L{layer}."
        for proj in ("k", "v", "q"):
            w[p + proj + "h"] = rnd(feats, hd, scale=1.5 / math.sqrt(feats))
            w[p + proj + "d"] = rnd(feats, d, scale=1.5 / math.sqrt(feats))
        w[p + "kb"] = rnd(hd, d, scale=0.3)
        w[p + "vb"] = rnd(hd, d, scale=0.3)
        w[p + "oh"] = rnd(hd, feats, scale=1.0 / math.sqrt(hd))
        w[p + "od"] = rnd(d, feats, scale=1.0 / math.sqrt(d))
        w[p + "mix"] = rnd(hd, feats, scale=1.0)
    w["head.out"] = rnd(feats, feats, scale=1.0 / math.sqrt(feats))
    w["decode.proj"] = rnd(g.latent_channels, 3, scale=1.0)
    if gemm is not None:
        dim = gemm["gemm_dim"]
        w["compute.expand"] = rnd(feats, dim, scale=1.0 / math.sqrt(feats))
        w["compute.w"] = rnd(dim, dim, scale=1.0 / math.sqrt(dim))
    return w


def weights_fingerprint(weights: dict[str, torch.Tensor], gemm: dict | None) -> bytes:
    """sha256 over every weight's name, shape, dtype and bytes, in order; a GEMM chain longer
    than one is mixed in too (it changes the bits: it is part of the model)."""
    h = hashlib.sha256(lp(b"synthetic-weights"))
    for name, t in weights.items():
        meta = (name.encode(), repr(tuple(t.shape)).encode(), str(t.dtype).encode())
        h.update(lp(*meta, tensor_bytes(t)))
    fingerprint = h.digest()
    if gemm is not None and gemm["gemms_per_layer_step"] != 1:
        chain = str(gemm["gemms_per_layer_step"]).encode()
        fingerprint = hashlib.sha256(lp(fingerprint, b"gemms", chain)).digest()
    return fingerprint
