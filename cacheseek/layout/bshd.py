"""The ``bshd`` layout: TeleFuser's per-layer ring ``k``/``v`` of shape ``[B, kv_size, H, D]`` as
attributes of one runtime object (TeleFuser 0.1.0.post3 and the hooked commit; the synthetic
runtime).

Stored values are raw bytes with no shape or dtype, so everything that decides how bytes are
interpreted is a *layout field* and enters the namespace fingerprint (`fingerprint_fields`): a
runtime with another layout, dtype or geometry lands in another namespace (a cold miss), never in
a reinterpretation of old bytes.

One chunk's value per layer and K/V is ``[1, chunk_tokens, H, D]`` contiguous, so a run of
``n`` tokens is ``n * H * D * itemsize`` contiguous bytes at token offset ``t * token_bytes``.

Where things live: ``runtime.self_kv_cache`` (per layer ``k``, ``v`` and int cursors),
``chunk_size``, ``frame_tokens``, ``kv_local_attn_size``, ``kv_sink_size``, ``noise_chunks``
(one per chunk; their shape is the latent's), ``control_chunks`` (or none), ``timesteps``,
``generator`` and ``world_kv_cached_latents``. The latent's dtype is the ring's (the hooked
TeleFuser denoises and decodes in its model dtype, whatever dtype its noise was drawn in).
"""

from __future__ import annotations

from typing import Any

from cacheseek.kv.ring import RingGeometry
from cacheseek.layout.ring_layout import LatentSpec, RingLayout
from cacheseek.registry import LAYOUTS

__all__ = ["BshdLayout", "LatentSpec"]


@LAYOUTS.register("bshd")
class BshdLayout(RingLayout):
    telefuser_releases = ("hooked", "released")

    @classmethod
    def matches(cls, runtime: Any) -> bool:
        return hasattr(runtime, "self_kv_cache")  # a runtime that holds its ring

    def ring_layers(self, runtime: Any) -> Any:
        return runtime.self_kv_cache

    def window(self, runtime: Any) -> Any:
        return RingGeometry(chunk_size=int(runtime.chunk_size), frame_tokens=int(runtime.frame_tokens),
                            local_attn_size=int(runtime.kv_local_attn_size), sink_size=int(runtime.kv_sink_size))

    def n_chunks(self, runtime: Any) -> int:
        return len(runtime.noise_chunks)

    def controls(self, runtime: Any) -> Any:
        return getattr(runtime, "control_chunks", None)

    def timesteps(self, runtime: Any) -> Any:
        return getattr(runtime, "timesteps", None)

    def generator(self, runtime: Any) -> Any:
        return runtime.generator

    def latent_spec(self, runtime: Any) -> LatentSpec:
        """Shape of a noise chunk, dtype and device of the ring (see `LatentSpec`)."""
        k = runtime.self_kv_cache[0]["k"]
        return LatentSpec(tuple(int(x) for x in runtime.noise_chunks[0].shape), k.dtype, k.device)
