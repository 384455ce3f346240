"""A restored chunk hands out its stored frames; at divergence the decoder's state is rebuilt.

On the 0.1.0.post3 release and the hooked commit, ``generate_next_chunk`` (wrapped by
`chunk_controls.NextChunkSeam`) asks the session's binding, once the chunk's control is known,
what to do with the chunk (`HandOut.next_chunk`):

- ``frames``: the chunk's stored frames (uint8 ``[T, H, W, 3]``: ``T = 4c - 3`` for chunk 0, ``4c``
  after it, as the Wan VAE's streaming decode makes them, then TeleFuser's ``tensor2video``) are
  handed out as TeleFuser hands them out (one RGB ``PIL.Image`` per frame, `pil_images`) and the runtime
  advances as ``generate_next_chunk`` advances it: no denoise, no KV update, no decode;
- ``replay``: the served chunks' latents are decoded again, in order, frames discarded
  (``decode_video_cached``, chunk 0 with ``is_first_clip``), so that the Wan decoder's causal
  feature cache is the one a cold run leaves before this chunk; with a stored state (the
  binding's ``decoder_state_every``) it is loaded first (`WanDecoder`) and only the chunks after
  it are decoded. Both happen late (``late_state``, `late_decoder`): the state is read while the
  DiT denoises the chunk, and the decoder caught up right before the chunk's decode;
- ``recompute``: the served chunks are computed again (their KV was gone at divergence) with
  their controls, frames discarded, then the chunk runs.

After a computed chunk its frames go to the binding (`HandOut.on_chunk_frames`), stacked on the
binding's writer thread, off the request path.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cacheseek.kv.decoder_state import DecoderStateSpec, spec_of
from cacheseek.kv.frames import FramesSpec
from cacheseek.kv.runtime_decoder import RuntimeDecoder

__all__ = ["frames_spec", "hand_out", "pil_images", "prepare", "frames_of", "WanDecoder", "late_decoder"]

VIDEO_PER_LATENT = 4  # Wan VAE: 4 video frames per latent frame (the first latent holds one)


def frames_spec(runtime: Any, idx: int) -> FramesSpec:
    """What TeleFuser hands out for chunk ``idx`` of ``runtime``: uint8 ``[T, H, W, 3]``."""
    c = int(runtime.chunk_size)
    t = VIDEO_PER_LATENT * (c - 1) + 1 if idx == 0 else VIDEO_PER_LATENT * c
    return FramesSpec((t, int(runtime.height), int(runtime.width), 3), torch.uint8)


def hand_out(runtime: Any, frames: Any) -> list:
    """The PIL frames of a served chunk, the runtime advanced past it as ``generate_next_chunk``
    advances it."""
    images = pil_images(frames)
    runtime.current_chunk_index += 1
    runtime.emitted_frames += len(images)
    if runtime.current_chunk_index >= len(runtime.noise_chunks):
        runtime.active = False
    return images


def pil_images(frames: Any) -> list:
    """``frames`` (uint8 ``[T, H, W, 3]``, C order) as TeleFuser's ``tensor2video`` hands them out:
    one RGB ``PIL.Image`` per frame, equal in type, mode, size and pixels to ``Image.fromarray``'s.
    ``Image.frombuffer`` reads each frame where it lies (``fromarray`` copies it first: 15 against
    9 ms for a 480x832 chunk of 12 frames on one core), and the frames are converted on
    `_IMAGE_THREADS` threads (PIL converts without holding the GIL)."""
    from PIL import Image

    height, width = int(frames.shape[1]), int(frames.shape[2])

    def image(frame: Any) -> Any:
        return Image.frombuffer("RGB", (width, height), frame, "raw", "RGB", 0, 1)

    if len(frames) < 2 or _IMAGE_THREADS < 2:
        return [image(frame) for frame in frames]
    return list(_image_pool().map(image, frames))


_IMAGE_THREADS = min(4, os.cpu_count() or 1)
_pool: list = []
_pool_lock = threading.Lock()


def _image_pool() -> Any:
    """The process's image threads, started on first use (daemon threads, `_IMAGE_THREADS`)."""
    with _pool_lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(max_workers=_IMAGE_THREADS, thread_name_prefix="cacheseek-images"))
        return _pool[0]


def prepare(pipeline: Any, runtime: Any, plan: Any, generate: Any, decoder: RuntimeDecoder) -> None:
    """Before a chunk is computed after served ones: set the decoder's state (a stored one, then
    ``replay``) or compute the served chunks again (``recompute``, with ``generate``:
    TeleFuser's own ``generate_next_chunk``)."""
    with torch.inference_mode():
        if plan.decoder_state is not None:
            decoder.load(plan.decoder_state)
        for j, latent in enumerate(plan.replay):
            pipeline.decode_video_cached(latent.to(device=pipeline.device, dtype=pipeline.torch_dtype),
                                         is_first_clip=plan.replay_from + j == 0, is_last_clip=False)
    if plan.recompute:
        idx, emitted = int(runtime.current_chunk_index), int(runtime.emitted_frames)
        for j, control in enumerate(plan.recompute):
            runtime.current_chunk_index = j
            generate(runtime, control_override=control)
        runtime.current_chunk_index, runtime.emitted_frames, runtime.active = idx, emitted, True


def frames_of(images: list) -> Any:
    """A computed chunk's frames as stored: its PIL frames stacked, uint8 ``[T, H, W, 3]``."""
    return lambda: np.stack([np.asarray(image) for image in images])


class WanDecoder(RuntimeDecoder):
    """The Wan VAE's streaming decoder of ``pipeline`` as the binding sees it (`RuntimeDecoder`):
    its state is ``_feat_cache`` (one entry per causal conv: a tensor ``[1, C, t, h, w]``, None,
    or the marker ``"Rep"``). A VAE without it (the stand-in) keeps no state: nothing stored.

    ``spec(j)`` comes from a dry decode of zero latents at 2 x 2 (16 x 16 pixels; chunk 0 alone,
    or chunks 0 and 1 for any later chunk: the cache's layout is the same after every chunk past
    the first), each tensor's last two sizes scaled to the session's frame, as
    `wan_parts.feature_cache_bytes` sizes it; memoized in ``memo`` (one per pipeline). A stored
    state of another layout fails its checks (a miss), never loads.

    It loads late (`NextChunk.late_state`): at a divergence the stored state is read while the
    DiT denoises the chunk, and loaded (with the served latents after it decoded) right before
    the VAE's first decode of the chunk (`late_decoder`)."""

    loads_late = True

    def __init__(self, pipeline: Any, runtime: Any, memo: dict) -> None:
        vae = pipeline.vae
        self.vae = vars(vae).get("vae", vae)  # `RecordingVAE`'s VAE: a dry decode leaves its record alone
        self.runtime = runtime
        self.device = pipeline.vae_device
        self.memo = memo

    def _cache(self) -> Any:
        return getattr(self.vae, "_feat_cache", None)  # a VAE without a causal cache has none

    def spec(self, after_chunk: int) -> Any:
        key = (min(after_chunk, 1), int(self.runtime.chunk_size), int(self.runtime.height), int(self.runtime.width))
        if key not in self.memo:
            self.memo[key] = self._dry_spec(*key)
        return self.memo[key]

    def _dry_spec(self, after: int, chunk: int, height: int, width: int) -> Any:
        vae = self.vae
        if self._cache() is None:
            return None
        saved = vae._feat_cache, vae._feat_idx
        params = next(vae.parameters())
        z = torch.zeros((1, vae.z_dim, chunk, 2, 2), device=params.device, dtype=params.dtype)
        try:
            with torch.inference_mode():
                for j in range(after + 1):
                    vae.cached_decode_withflag(z, device=params.device, is_first_clip=j == 0, is_last_clip=False)
            dry = spec_of(vae._feat_cache)
        finally:
            vae._feat_cache, vae._feat_idx = saved
        sh, sw = height // 16, width // 16
        return DecoderStateSpec([e if not isinstance(e, tuple) else ((*e[0][:-2], e[0][-2] * sh, e[0][-1] * sw), e[1])
                                 for e in dry.entries])

    def capture(self) -> Any:
        cache = self._cache()
        if not cache or not any(isinstance(t, torch.Tensor) for t in cache):
            return None
        return list(cache)

    def load(self, entries: list) -> None:
        self.vae._feat_cache, self.vae._feat_idx = list(entries), [0]


@contextlib.contextmanager
def late_decoder(pipeline: Any, plan: Any, decoder: WanDecoder) -> Iterator[None]:
    """While ``generate_next_chunk`` runs a chunk whose decoder loads late (``plan.late_state``):
    the first call of the VAE's ``cached_decode_withflag`` (the one whose feature cache is the
    state) first catches the decoder up (`LateState.catch_up`: waits for the state's read,
    loads it, decodes the served latents after it as `prepare` does), then decodes. Whatever
    path TeleFuser takes to its decode goes through that call; the VAE is left as it was."""
    late = plan.late_state if plan is not None else None
    if late is None:
        yield
        return
    vae = decoder.vae
    had, before = "cached_decode_withflag" in vars(vae), vars(vae).get("cached_decode_withflag")

    def restore() -> None:
        if had:
            vae.cached_decode_withflag = before
        else:
            vars(vae).pop("cached_decode_withflag", None)

    def first_decode(*args: Any, **kwargs: Any) -> Any:
        restore()
        with torch.inference_mode():
            late.catch_up(decoder, lambda latent, first: pipeline.decode_video_cached(
                latent.to(device=pipeline.device, dtype=pipeline.torch_dtype), is_first_clip=first, is_last_clip=False))
        return vae.cached_decode_withflag(*args, **kwargs)

    vae.cached_decode_withflag = first_decode
    try:
        yield
    finally:
        restore()
