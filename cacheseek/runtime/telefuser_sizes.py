"""What a ``telefuser`` runtime's session stores beside its chunks' KV, in bytes, for
`sizing.need_for` (through the factory's ``beside_chunk_bytes`` and ``session_encode_bytes``).

Kept apart from `cacheseek.runtime.telefuser` (the runtime and its sessions): arithmetic on the
latent geometry and the video size.
"""

from __future__ import annotations

from typing import Optional

from cacheseek.integrations.telefuser.handout import VIDEO_PER_LATENT
from cacheseek.kv import encode as encode_value
from cacheseek.kv import frames as frames_value
from cacheseek.runtime.geometry import Geometry

__all__ = ["DECODER_STATE_HEADROOM", "beside_chunk_bytes", "session_encode_bytes"]

DECODER_STATE_HEADROOM = 1 << 20  # a stored state's header, entry table and padding (a few KiB at 480p)


def beside_chunk_bytes(geometry: Geometry, *, height: int, width: int,
                       decoder_cache_bytes: Optional[int]) -> dict[str, int]:
    """The frames ``generate_next_chunk`` hands out (a later chunk's ``4c`` frames, the most) and,
    given the Wan decoder's feature cache (``decoder_cache_bytes``, None: no decoder state stored),
    the decoder's state stored at a resume point: that cache plus the value's header and padding."""
    out = {"frames": frames_value.packed_nbytes(frames_value.FramesSpec(
        (VIDEO_PER_LATENT * geometry.chunk_size, height, width, 3), frames_value.DTYPES[1]))}
    if decoder_cache_bytes is not None:
        out["decoder state"] = decoder_cache_bytes + DECODER_STATE_HEADROOM
    return out


def session_encode_bytes(geometry: Geometry, *, text_dim: int, session_chunks: int) -> int:
    """At most the bytes of one session's stored encodes: the prompt embedding ``[512, text_dim]``
    and the condition video's mask and latents ``[4 + C, c * session_chunks, h, w]``, each counted
    as float32 (the bound of their dtypes) with its value head."""
    g = geometry
    prompt = 512 * text_dim * 4
    condition = (4 + g.latent_channels) * g.chunk_size * int(session_chunks) * g.latent_h * g.latent_w * 4
    return prompt + condition + 2 * encode_value.HEAD_NBYTES
