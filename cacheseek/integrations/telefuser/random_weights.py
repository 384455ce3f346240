"""Random weights for TeleFuser's modules without a checkpoint: seeded, drawn on their device.

The tiny pipeline's DiT and TeleFuser's own Wan VAE and umT5 encoder (`tiny`, `wan_parts`) are
built without weights from disk; `redraw` gives every parameter a value from one seeded
generator, so two builds with one seed hold equal weights (one namespace) and another seed
other weights (another namespace).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cacheseek.progress import bar

__all__ = ["redraw"]


def redraw(module: Any, seed: int, what: str) -> None:
    """Every parameter from one seeded generator on the parameters' device, in name order, drawn
    in float32 and rounded into the parameter's dtype: matrices and kernels ~ N(0, 1/fan_in), norm
    scales (a ``gamma``, or a vector with ``norm`` in its name) ~ 1 + N(0, 0.05^2), other vectors ~ N(0, 0.05^2). (On the CPU the same weights as a float32
    module redrawn, then cast; a CUDA generator draws other values.)"""
    params = sorted(module.named_parameters())
    device = params[0][1].device if params else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(p.numel() for _, p in params)
    with torch.no_grad(), bar(total, f"{what}: random weights on {device}", unit="value") as progress:
        for name, p in params:
            progress.update(p.numel())
            draw = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device)
            if name.endswith("gamma"):  # the Wan VAE's RMS-norm scales, shaped [C, 1, 1(, 1)]
                draw = 1.0 + 0.05 * draw
            elif p.dim() >= 2 and "modulation" not in name:
                draw /= math.sqrt(max(1, p[0].numel()))
            elif "norm" in name:
                draw = 1.0 + 0.05 * draw
            else:
                draw *= 0.05
            p.copy_(draw)

