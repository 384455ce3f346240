"""What a synthetic session is given and what the binding hashes: the image and the session config.

The constants are the reference (LingBot-World-fast) sampler and pipeline settings that enter the
session config unchanged.
"""

from __future__ import annotations

from typing import Any

import attrs

from cacheseek.errors import ConfigError

__all__ = ["CONTROL_MODE", "MAX_SEQUENCE_LENGTH", "SAMPLE_SHIFT", "VAE_STRIDE", "SessionConfig", "SyntheticImage",
           "default_image"]

SAMPLE_SHIFT = 5.0
CONTROL_MODE = "cam"
MAX_SEQUENCE_LENGTH = 512
VAE_STRIDE = 8
_IMAGE_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}


@attrs.frozen(slots=True)
class SyntheticImage:
    """A PIL-like image: `mode`, `size = (width, height)` and `tobytes()` (row-major pixels)."""

    mode: str
    size: tuple[int, int] = attrs.field(converter=tuple)
    data: bytes = attrs.field(converter=bytes, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.mode not in _IMAGE_CHANNELS:
            raise ConfigError("runtime.image", f"unsupported mode {self.mode!r}", "use L, RGB or RGBA")
        if len(self.size) != 2 or not all(isinstance(x, int) and x > 0 for x in self.size):
            raise ConfigError("runtime.image", f"size must be (width, height) > 0, got {self.size!r}")
        w, h = self.size
        want = w * h * _IMAGE_CHANNELS[self.mode]
        if len(self.data) != want:
            raise ConfigError("runtime.image", f"{self.mode} {w}x{h} needs {want} bytes, got {len(self.data)}")

    def tobytes(self) -> bytes:
        return self.data


def default_image() -> SyntheticImage:
    """A deterministic 8x8 RGB gradient."""
    return SyntheticImage("RGB", (8, 8), bytes((i * 37 + 11) % 256 for i in range(8 * 8 * 3)))


@attrs.frozen(slots=True)
class SessionConfig:
    """What the binding hashes into the namespace root (docs/api.md, `on_runtime_created`).

    `frame_num` is the total latent frame count, `max_attention_size` the ring length in tokens.
    The last five fields also change the bits and are not in the reference session config.
    """

    prompt: str
    image: Any
    seed: int
    frame_num: int
    chunk_size: int
    sample_shift: float
    control_mode: str
    max_attention_size: int
    max_sequence_length: int
    sampling_steps: int
    local_attn_size: int
    sink_size: int
    dtype: str
    size: tuple[int, int]
