"""A restored chunk hands out its stored frames; at divergence the decoder's state is rebuilt.

On the 0.1.0.post3 release and the hooked commit, ``generate_next_chunk`` (wrapped by
`chunk_controls.NextChunkSeam`) asks the session's binding, once the chunk's control is known,
what to do with the chunk (`HandOut.next_chunk`):

- ``frames``: the chunk's stored frames (uint8 ``[T, H, W, 3]``: ``T = 4c - 3`` for chunk 0, ``4c``
  after it, as the Wan VAE's streaming decode makes them, then TeleFuser's ``tensor2video``) are
  handed out as TeleFuser hands them out (one ``PIL.Image.fromarray`` per frame) and the runtime
  advances as ``generate_next_chunk`` advances it: no denoise, no KV update, no decode;
- ``replay``: the served chunks' latents are decoded again, in order, frames discarded
  (``decode_video_cached``, chunk 0 with ``is_first_clip``), so that the Wan decoder's causal
  feature cache is the one a cold run leaves before this chunk;
- ``recompute``: the served chunks are computed again (their KV was gone at divergence) with
  their controls, frames discarded, then the chunk runs.

After a computed chunk its frames go to the binding (`HandOut.on_chunk_frames`), stacked on the
binding's writer thread, off the request path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cacheseek.kv.frames import FramesSpec

__all__ = ["frames_spec", "hand_out", "prepare", "frames_of"]

VIDEO_PER_LATENT = 4


def frames_spec(runtime: Any, idx: int) -> FramesSpec:
    """What TeleFuser hands out for chunk ``idx`` of ``runtime``: uint8 ``[T, H, W, 3]``."""
    c = int(runtime.chunk_size)
    t = VIDEO_PER_LATENT * (c - 1) + 1 if idx == 0 else VIDEO_PER_LATENT * c
    return FramesSpec((t, int(runtime.height), int(runtime.width), 3), torch.uint8)


def hand_out(runtime: Any, frames: Any) -> list:
    """The PIL frames of a served chunk, the runtime advanced past it as ``generate_next_chunk``
    advances it."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    runtime.current_chunk_index += 1
    runtime.emitted_frames += len(images)
    if runtime.current_chunk_index >= len(runtime.noise_chunks):
        runtime.active = False
    return images


def prepare(pipeline: Any, runtime: Any, plan: Any, generate: Any) -> None:
    """Before a chunk is computed after served ones: rebuild the decoder's state (``replay``) or
    compute the served chunks again (``recompute``, with ``generate``: TeleFuser's own
    ``generate_next_chunk``)."""
    with torch.inference_mode():
        for j, latent in enumerate(plan.replay):
            pipeline.decode_video_cached(latent.to(device=pipeline.device, dtype=pipeline.torch_dtype),
                                         is_first_clip=j == 0, is_last_clip=False)
    if plan.recompute:
        idx, emitted = int(runtime.current_chunk_index), int(runtime.emitted_frames)
        for j, control in enumerate(plan.recompute):
            runtime.current_chunk_index = j
            generate(runtime, control_override=control)
        runtime.current_chunk_index, runtime.emitted_frames, runtime.active = idx, emitted, True


def frames_of(images: list) -> Any:
    """A computed chunk's frames as stored: its PIL frames stacked, uint8 ``[T, H, W, 3]``."""
    return lambda: np.stack([np.asarray(image) for image in images])
