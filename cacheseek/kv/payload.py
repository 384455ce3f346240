"""What a chunk's KV is in bytes, and where a whole-path restore lands.

A chunk's payload is one entry per layer: a ``(k, v)`` pair of ``[1, chunk_tokens, H, D]`` tensors
(`LayerPayload`), or, on a generic tier, any object (upstream CacheSeek's tests store strings).
Sizes are counted the same way by the manager, every tier and the eviction policy.
"""

from __future__ import annotations

from typing import Any

import attrs

from cacheseek.kv.ring import CopyRun

__all__ = ["LayerPayload", "RestoreTarget", "payload_nbytes", "layer_nbytes"]

LayerPayload = tuple[Any, Any]  # (k, v) of one layer for one chunk: [1, chunk_tokens, H, D]


def payload_nbytes(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if hasattr(value, "numel") and hasattr(value, "element_size"):
        return int(value.numel() * value.element_size())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    return 0


def layer_nbytes(layer: Any) -> int:
    """Bytes of one layer's payload: both halves of a ``(k, v)`` pair, else the value itself."""
    if isinstance(layer, tuple):
        return sum(payload_nbytes(part) for part in layer)
    return payload_nbytes(layer)


@attrs.frozen(slots=True)
class RestoreTarget:
    """Where a whole-path restore of depth K lands, built by the runtime binding.

    ``kv``: per layer ``(k, v)`` ring tensors ``[1, kv_size, H, D]``, contiguous, on the runtime
    device. ``runs``: the copy runs in tokens (`RingGeometry.restore_runs`). ``window_depths``:
    the chunk depths the runs read, oldest first. ``token_bytes``: bytes of one token row
    (``H * D * itemsize``). ``chunk_tokens``: tokens in one chunk's value. ``latents``: private
    targets, one per chunk 0..K-1, in the runtime's latent shape, dtype and device; filled first.
    """

    kv: tuple[tuple[Any, Any], ...]
    runs: tuple[CopyRun, ...]
    window_depths: tuple[int, ...]
    token_bytes: int
    chunk_tokens: int
    latents: tuple[Any, ...]

    @property
    def n_layers(self) -> int:
        return len(self.kv)

    @property
    def chunk_value_nbytes(self) -> int:
        return self.chunk_tokens * self.token_bytes
