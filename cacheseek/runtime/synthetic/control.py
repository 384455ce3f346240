"""The camera-control tensor of one chunk, as LingBot-World-fast's pipeline hands it over.

The binding hashes it into the chunk's action key, so its shape and dtype are the real ones. Two
runtimes given one action must draw bit-identical controls, so the per-channel values come from
Python's scalar ``math`` in float64, not from torch's ``mv``, ``cos`` and ``tanh`` (BLAS and
vectorized kernels): built that way, the first chunk of a process's first session keyed
differently from the same control built later, in 2 of about 300 gate runs on a loaded 2-core
machine (a miss where the gate wanted a full hit). The rest is element-wise IEEE arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from cacheseek.runtime.geometry import Geometry

__all__ = ["CONTROL_CHANNELS", "MAX_ACTION_DIM", "control_tensor"]

MAX_ACTION_DIM = 16
CONTROL_CHANNELS = 384  # 6 Plucker coordinates x an 8x8 pixel patch per latent pixel


def control_tensor(g: Geometry, action: Sequence[float], *, device: Any = "cpu") -> torch.Tensor:
    """The camera-control tensor of one chunk as LingBot-World-fast's pipeline hands it over:
    ``[1, CONTROL_CHANNELS, chunk_size, latent_h, latent_w]`` float32 (6 Plucker coordinates per
    pixel of an 8x8 patch; 7.19 M values a chunk at 480x832). Here a fixed smooth function of
    the action vector (at most `MAX_ACTION_DIM` values): every value depends on every action
    component, so the action key (a hash of this tensor) separates actions exactly as the model
    does."""
    a = [float(x) for x in action]
    per_channel = torch.tensor([math.tanh(sum(math.cos(ch * (j + 1.0) * 0.37) * x for j, x in enumerate(a)))
                                for ch in range(CONTROL_CHANNELS)], dtype=torch.float32)  # [CONTROL_CHANNELS]
    f = torch.arange(g.chunk_size, dtype=torch.float32)[:, None, None]
    y = torch.arange(g.latent_h, dtype=torch.float32)[None, :, None] / g.latent_h
    x = torch.arange(g.latent_w, dtype=torch.float32)[None, None, :] / g.latent_w
    ramp = (y - 0.5) * (1.0 + 0.1 * f) + (x - 0.5)  # [c, h, w]
    out = per_channel[:, None, None, None] * (1.0 + ramp[None])
    return out[None].to(device).contiguous()
