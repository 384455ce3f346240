"""TeleFuser's own Wan VAE and umT5 text encoder at their real architecture, random weights.

``build_tiny_pipeline(vae="wan", text_encoder="umt5")`` puts these where `tiny`'s stand-ins
would be, so a session's wall holds TeleFuser's real condition-video encode, prompt encode and
streaming decode (``WanVideoVAE.cached_decode_withflag`` with its causal feature cache, about
1.8 GiB at 480p in bf16 between chunks). Only the weights are not the checkpoint's: every
parameter is redrawn from a seeded generator on the device (`random_weights.redraw`). The tokenizer stays
`tiny.TinyTokenizer` (umT5's needs its files); its ids are within umT5's vocabulary.

- `wan_vae`: ``WanVideoVAE()`` (z=16, 8x spatial and 4x temporal compression; its sizes are
  fixed), built on the device in float32 as TeleFuser builds it, then cast to ``dtype`` (the
  release's pipeline casts it to bf16; main's VAE stages run it in float32).
- `umt5_encoder`: ``WanTextEncoder`` of width ``text_dim`` (umT5-XXL: 4096, 64 heads of 64, ffn
  10240, 24 layers), built on the device in ``dtype``.
- `RecordingVAE`: the VAE the pipeline calls; it keeps the latent and the frames of its last
  decode, which the session hashes and the gate compares bit for bit.
- `feature_cache_bytes`: what the decoder's causal cache holds between chunks at a frame size.
"""

from __future__ import annotations

from typing import Any

import torch

from cacheseek.integrations.telefuser.random_weights import redraw

__all__ = ["RecordingVAE", "feature_cache_bytes", "umt5_encoder", "wan_vae"]

UMT5_HEAD_DIM = 64
UMT5_FFN_RATIO = 2.5


def wan_vae(*, device: Any, dtype: Any, seed: int) -> Any:
    """TeleFuser's ``WanVideoVAE`` on ``device`` in ``dtype``, weights redrawn from ``seed``."""
    from telefuser.models.wan_video_vae import WanVideoVAE

    with torch.device(device):
        vae = WanVideoVAE(z_dim=16)
    vae = vae.to(dtype=dtype).eval().requires_grad_(False)
    redraw(vae, seed + 2, "Wan VAE")
    return vae


def umt5_encoder(*, text_dim: int, layers: int, device: Any, dtype: Any, seed: int) -> Any:
    """TeleFuser's ``WanTextEncoder`` (umT5's encoder) of width ``text_dim``: heads of 64 where
    ``text_dim`` divides by 64 (one head otherwise), ffn 2.5 x ``text_dim``, ``layers`` blocks."""
    from telefuser.models.wan_video_text_encoder import WanTextEncoder

    heads = text_dim // UMT5_HEAD_DIM if text_dim % UMT5_HEAD_DIM == 0 else 1
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = WanTextEncoder(dim=text_dim, dim_attn=text_dim, dim_ffn=int(text_dim * UMT5_FFN_RATIO),
                                     num_heads=heads, num_layers=layers)
    finally:
        torch.set_default_dtype(default)
    encoder = encoder.eval().requires_grad_(False)
    redraw(encoder, seed + 1, "umT5 encoder")
    return encoder


def feature_cache_bytes(vae: Any, *, height: int, width: int) -> int:
    """Bytes of ``vae``'s decoder feature cache between two chunks of ``height x width`` frames:
    the cache after two decodes of a 2-frame latent of 2 x 2 (16 x 16 pixels), scaled by the area
    (each cached tensor is ``[1, C, 2, h, w]`` with ``h, w`` in proportion to the frame's)."""
    params = next(vae.parameters())
    z = torch.zeros((1, vae.z_dim, 2, 2, 2), device=params.device, dtype=params.dtype)
    with torch.inference_mode():
        for first in (True, False):
            vae.cached_decode_withflag(z, device=params.device, is_first_clip=first, is_last_clip=False)
    held = sum(t.numel() * t.element_size() for t in vae._feat_cache if isinstance(t, torch.Tensor))
    vae._feat_cache, vae._feat_idx = [], [0]
    return held * (height // 16) * (width // 16)


class RecordingVAE:
    """A VAE whose streaming decode keeps ``last_latent`` (a copy of its input ``[1, 16, T, h,
    w]``) and ``last_frames`` (its output ``[3, T', H, W]``, which TeleFuser converts without
    writing to it); every other attribute is the VAE's."""

    def __init__(self, vae: Any) -> None:
        self.__dict__.update(vae=vae, last_latent=None, last_frames=None)

    def cached_decode_withflag(self, hidden_state: Any, *args: Any, **kwargs: Any) -> Any:
        latent = hidden_state.detach().clone()
        frames = self.__dict__["vae"].cached_decode_withflag(hidden_state, *args, **kwargs)
        self.__dict__.update(last_latent=latent, last_frames=frames)
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["vae"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["vae"], name, value)
