"""What keeping each chunk's frames and the Wan decoder's cache beside its KV would save (issue 24 item 6).

A restored chunk today skips the DiT but not the VAE: its latent is decoded again, in order, so
the decoder's causal feature cache is the cold run's. Kept beside the KV, a chunk's frames (the
uint8 frames TeleFuser hands out) would let a restored chunk skip the VAE too, and the decoder's
cache at a resume point would let the first computed chunk after a restored prefix decode
without decoding the prefix. `measure` prices both on the latents of one cold session, in the
process of the bench's ``nocache`` store (TeleFuser's own Wan VAE, random weights):

- ``decode_s``, ``tensor2video_s`` per chunk: ``WanVideoVAE.cached_decode_withflag`` replayed in
  order on the session's latents, then
  TeleFuser's ``tensor2video`` (the PIL frames a user gets: equal to the session's, checked by hash);
- ``frames_bytes`` per chunk (uint8) and ``frames_handout_s``: a copy out of a host buffer and
  one ``Image.fromarray`` per frame, what a restored chunk would do instead;
- ``cache_bytes`` after each chunk; ``cache_to_host_s`` (a store's write: to pinned memory),
  ``cache_from_host_s`` (a restore over PCIe), ``cache_d2d_s`` (a restore from an HBM tier), all
  torch copies timed after a synchronize (not CacheSeek's store path), and ``resume_bit_exact``:
  chunk k decoded from the cache restored from host equals the in-order decode bit for bit;
- ``encode_prompt_s`` and ``encode_condition_s``: TeleFuser's umT5 prompt encode and Wan encode
  of the condition video, which every session pays at creation, hit or not.

`savings` turns these into what a full hit of n chunks and a hit of k of n would save, and the
store bytes added against the KV's, for the bench's table.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["measure", "savings"]


def measure(factory: Any, session: Any, sync: Callable[[], None]) -> dict:
    import numpy as np
    import torch
    from PIL import Image

    from cacheseek.runtime.telefuser import images_hash

    pipeline = factory.pipeline
    vae = pipeline.vae.vae  # TeleFuser's WanVideoVAE under the recorder
    device = next(vae.parameters()).device

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - start

    def decode(latent: Any, first: bool) -> Any:
        with torch.inference_mode():
            return vae.cached_decode_withflag(latent, device=device, is_first_clip=first, is_last_clip=False)

    def snapshot() -> list:
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in vae._feat_cache]

    out: dict[str, Any] = {"chunks": len(session.latents), "decode_s": [], "tensor2video_s": [], "frames_bytes": [],
                           "frames_handout_s": [], "cache_bytes": [], "cache_to_host_s": [], "cache_from_host_s": [],
                           "cache_d2d_s": [], "resume_bit_exact": [], "replay_equals_session": []}
    frames, caches = [], []
    for k, latent in enumerate(session.latents):
        decoded, wall = timed(lambda: decode(latent, k == 0))
        images, t2v = timed(lambda: pipeline.tensor2video(decoded))
        out["replay_equals_session"].append(images_hash(images) == session.frame_hashes[k])
        kept = np.stack([np.asarray(image) for image in images])  # what a restored chunk would hand out
        start = time.perf_counter()
        [Image.fromarray(frame) for frame in kept.copy()]
        out["frames_handout_s"].append(time.perf_counter() - start)
        out["decode_s"].append(wall)
        out["tensor2video_s"].append(t2v)
        out["frames_bytes"].append(int(kept.nbytes))
        frames.append(decoded.clone())
        caches.append(snapshot())

    for k, cache in enumerate(caches):
        tensors = [t for t in cache if isinstance(t, torch.Tensor)]
        out["cache_bytes"].append(sum(t.numel() * t.element_size() for t in tensors))
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for t in tensors]
        back = [torch.empty_like(t) for t in tensors]
        _, to_host = timed(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(host, tensors)])
        _, from_host = timed(lambda: [b.copy_(h, non_blocking=True) for b, h in zip(back, host)])
        _, d2d = timed(lambda: [torch.empty_like(t).copy_(t) for t in tensors])
        out["cache_to_host_s"].append(to_host)
        out["cache_from_host_s"].append(from_host)
        out["cache_d2d_s"].append(d2d)
        if k + 1 < len(caches):  # resume: decode chunk k+1 from the cache restored from host
            restored = iter(back)
            vae._feat_cache = [next(restored) if isinstance(t, torch.Tensor) else t for t in cache]
            vae._feat_idx = [0]
            resumed = decode(session.latents[k + 1], False)
            out["resume_bit_exact"].append(bool(torch.equal(resumed, frames[k + 1])))
    vae._feat_cache, vae._feat_idx = [], [0]
    out.update(_encodes(pipeline, session, timed))
    return out


def _encodes(pipeline: Any, session: Any, timed: Callable) -> dict:
    """TeleFuser's per-session encodes (the release's pipeline methods; absent elsewhere)."""
    config = session.session_config
    if not hasattr(pipeline, "_encode_condition_video"):
        return {}
    import torch

    image = pipeline._prepare_image_tensor(config.image, session.factory.height, session.factory.width)
    with torch.inference_mode():  # each twice, the second timed: the first may pick its kernels
        prompt = [timed(lambda: pipeline.encode_prompt(config.prompt))[1] for _ in range(2)][-1]
        condition = [timed(lambda: pipeline._encode_condition_video(image, config.frame_num))[1] for _ in range(2)][-1]
    return {"encode_prompt_s": prompt, "encode_condition_s": condition}


def savings(m: dict, *, kv_bytes_per_chunk: int, hit: int) -> dict:
    """What keeping frames (every chunk) and the decoder cache (at each resume point) would save
    on a full hit of all ``m["chunks"]`` chunks and on a hit of ``hit`` chunks then computing the
    rest, and the bytes it adds to the store per chunk against its KV."""
    n = m["chunks"]
    vae_per_chunk = [d + t for d, t in zip(m["decode_s"], m["tensor2video_s"])]
    full = sum(vae_per_chunk[:n]) - sum(m["frames_handout_s"][:n])
    partial = sum(vae_per_chunk[:hit]) - sum(m["frames_handout_s"][:hit]) - m["cache_from_host_s"][hit - 1]
    added = [f + c for f, c in zip(m["frames_bytes"], m["cache_bytes"])]
    return {"full_hit_saves_s": full, "partial_hit": hit, "partial_hit_saves_s": partial,
            "partial_hit_saves_hbm_s": partial + m["cache_from_host_s"][hit - 1] - m["cache_d2d_s"][hit - 1],
            "store_bytes_added_per_chunk": added, "kv_bytes_per_chunk": kv_bytes_per_chunk,
            "store_bytes_added_ratio": max(added) / kv_bytes_per_chunk if kv_bytes_per_chunk else None,
            "frames_only_bytes_ratio": max(m["frames_bytes"]) / kv_bytes_per_chunk if kv_bytes_per_chunk else None}
