"""The ``bshd`` layout: TeleFuser's per-layer ring ``k``/``v`` of shape ``[B, kv_size, H, D]``.

Stored values are raw bytes with no shape or dtype, so everything that decides how bytes are
interpreted is a *layout field* and enters the namespace fingerprint (`fingerprint_fields`): a
runtime with another layout, dtype or geometry lands in another namespace (a cold miss), never in
a reinterpretation of old bytes.

One chunk's value per layer and K/V is ``[1, chunk_tokens, H, D]`` contiguous, so a run of
``n`` tokens is ``n * H * D * itemsize`` contiguous bytes at token offset ``t * token_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs

from cacheseek.errors import LayoutMismatchError
from cacheseek.registry import LAYOUTS

__all__ = ["BshdLayout", "LatentSpec"]


@attrs.frozen(slots=True)
class LatentSpec:
    """How one chunk's latent is stored and restored: ``shape`` of the runtime's noise chunk
    (``[1, C, chunk_size, h, w]``), ``dtype`` of the ring (the runtime decodes a cached latent
    in its model dtype, whatever dtype its noise was drawn in), ``device`` of the runtime."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: Any
    device: Any


@dataclasses.dataclass
class BshdSchema:
    _target_: str = "cacheseek.layout.bshd.BshdLayout"


@LAYOUTS.register("bshd", BshdSchema)
class BshdLayout:
    storage_format = "cacheseek.kv.bshd.v1"

    def layers(self, runtime: Any) -> list[tuple[Any, Any]]:
        """Per layer ``(k, v)`` of the runtime's ring, validated: B=1, contiguous, one dtype."""
        cache = runtime.self_kv_cache
        out = []
        for i, layer in enumerate(cache):
            k, v = layer["k"], layer["v"]
            if k.dim() != 4 or k.shape != v.shape:
                raise LayoutMismatchError(f"layer {i}: k {tuple(k.shape)} / v {tuple(v.shape)} is not [B, S, H, D]")
            if k.shape[0] != 1:
                raise LayoutMismatchError(f"layer {i}: batch {k.shape[0]} != 1 (bshd restores B=1 rings)")
            if not (k.is_contiguous() and v.is_contiguous()):
                raise LayoutMismatchError(f"layer {i}: ring tensors must be contiguous")
            out.append((k, v))
        return out

    def token_bytes(self, runtime: Any) -> int:
        k = runtime.self_kv_cache[0]["k"]
        return int(k.shape[2] * k.shape[3] * k.element_size())

    def tail_views(self, runtime: Any, n_tokens: int) -> list[tuple[Any, Any]]:
        """Detached views of ``[local_end - n_tokens, local_end)`` of every layer (no copy)."""
        out = []
        for layer, (k, v) in zip(runtime.self_kv_cache, self.layers(runtime)):
            end = int(layer["local_end_index"])
            start = end - n_tokens
            if start < 0:
                raise LayoutMismatchError(f"ring tail [{start}, {end}) starts before slot 0")
            out.append((k[:, start:end].detach(), v[:, start:end].detach()))
        return out

    def latent_spec(self, runtime: Any) -> LatentSpec:
        """Shape, dtype and device of a stored latent (see `LatentSpec`)."""
        k = runtime.self_kv_cache[0]["k"]
        return LatentSpec(tuple(int(x) for x in runtime.noise_chunks[0].shape), k.dtype, k.device)

    def fingerprint_fields(self, runtime: Any) -> dict[str, Any]:
        k = runtime.self_kv_cache[0]["k"]
        chunk_tokens = int(runtime.chunk_size * runtime.frame_tokens)
        latent = self.latent_spec(runtime)
        return {
            "storage_format": self.storage_format,
            "n_layers": len(runtime.self_kv_cache),
            "kv_shape": [1, chunk_tokens, int(k.shape[2]), int(k.shape[3])],
            "kv_dtype": str(k.dtype),
            "latent_shape": list(latent.shape),
            "latent_dtype": str(latent.dtype),
            "chunk_size": int(runtime.chunk_size),
            "frame_tokens": int(runtime.frame_tokens),
        }
