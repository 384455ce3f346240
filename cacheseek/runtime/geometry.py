"""Model geometry: the sizes that fix every KV and latent tensor a runtime produces.

A `Geometry` is a frozen value. Everything the cache stores is derived from it:

- tokens: a latent frame of `latent_h x latent_w` is cut into `patch x patch` patches, so a frame
  is `frame_tokens = (latent_h // patch) * (latent_w // patch)` tokens and a chunk of
  `chunk_size` latent frames is `chunk_tokens` tokens;
- one layer's K (or V) for one chunk is `kv_shape_per_chunk = (1, chunk_tokens, n_heads, head_dim)`;
- the denoised latent of one chunk (the skeleton) is
  `latent_shape = (1, latent_channels, chunk_size, latent_h, latent_w)`.

This module must import without torch.
"""

from __future__ import annotations

import os

from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError, GeometryError
from cacheseek.sizes import format_size

__all__ = ["GEOMETRIES", "Geometry", "get_geometry", "validate_window", "no_cuda_error", "check_cpu_memory",
           "check_int", "GPU_CHUNK_BYTES"]

GPU_CHUNK_BYTES = 256 << 20  # a chunk's KV above this is a model for a GPU (lingbot_480p: 3.57 GiB)


def check_int(field: str, value: Any, minimum: int) -> None:
    """A runtime setting ``field`` must be an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"geometry.{attribute.name}", f"must be a positive integer, got {value!r}",
                          f"set geometry.{attribute.name} to an integer >= 1")


def _name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError("geometry.name", f"must be a non-empty string, got {value!r}")


@attrs.frozen(slots=True)
class Geometry:
    """Sizes of one model; tensors are `[B=1, tokens, heads, head_dim]` (BSHD) for KV."""

    name: str = attrs.field(validator=_name)
    n_layers: int = attrs.field(validator=_positive_int)
    n_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    latent_channels: int = attrs.field(validator=_positive_int)
    latent_h: int = attrs.field(validator=_positive_int)
    latent_w: int = attrs.field(validator=_positive_int)
    chunk_size: int = attrs.field(validator=_positive_int)
    patch: int = attrs.field(default=2, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.head_dim % 2:
            raise ConfigError("geometry.head_dim", f"must be even (rotary phase rotates pairs), got {self.head_dim}",
                              "use an even head_dim")
        for field in ("latent_h", "latent_w"):
            value = getattr(self, field)
            if value % self.patch:
                raise ConfigError(f"geometry.{field}", f"{value} is not a multiple of patch {self.patch}",
                                  f"make geometry.{field} a multiple of geometry.patch")

    @property
    def frame_tokens(self) -> int:
        """Tokens per latent frame."""
        return (self.latent_h // self.patch) * (self.latent_w // self.patch)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk (`chunk_size` latent frames)."""
        return self.chunk_size * self.frame_tokens

    @property
    def hidden(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_shape_per_chunk(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) for one chunk: `(1, chunk_tokens, n_heads, head_dim)`."""
        return (1, self.chunk_tokens, self.n_heads, self.head_dim)

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one chunk's latent: `(1, latent_channels, chunk_size, latent_h, latent_w)`."""
        return (1, self.latent_channels, self.chunk_size, self.latent_h, self.latent_w)

    def kv_nbytes_per_chunk(self, itemsize: int = 2) -> int:
        """Bytes of one layer's K (or V) for one chunk; `itemsize` 2 for bf16/fp16."""
        return self.chunk_tokens * self.hidden * itemsize

    def chunk_kv_nbytes(self, itemsize: int = 2) -> int:
        """Bytes of one chunk's KV: K and V of every layer (3.57 GiB at lingbot_480p)."""
        return 2 * self.n_layers * self.kv_nbytes_per_chunk(itemsize)

    def latent_nbytes(self, itemsize: int = 2) -> int:
        """Bytes of one chunk's latent."""
        return self.latent_channels * self.chunk_size * self.latent_h * self.latent_w * itemsize


GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (
    Geometry("tiny", n_layers=2, n_heads=2, head_dim=4, latent_channels=4, latent_h=2, latent_w=4, chunk_size=3),
    Geometry("small", n_layers=4, n_heads=4, head_dim=16, latent_channels=8, latent_h=8, latent_w=8, chunk_size=3),
    Geometry("lingbot_480p", n_layers=40, n_heads=40, head_dim=128, latent_channels=16, latent_h=60, latent_w=104,
             chunk_size=3))}


def get_geometry(name: str) -> Geometry:
    """The preset called `name`; ConfigError naming `runtime.geometry` on an unknown name."""
    try:
        return GEOMETRIES[name]
    except (KeyError, TypeError):
        raise ConfigError("runtime.geometry", f"unknown geometry {name!r}",
                          "use one of: " + ", ".join(GEOMETRIES)) from None


def validate_window(geometry: Geometry, local_attn_size: int, sink_size: int) -> None:
    """Check the attention window (in latent frames) against the geometry.

    `local_attn_size` is -1 (full length: nothing is evicted) or L >= sink_size + chunk_size, so
    that a new chunk always fits after the pinned sink. `sink_size` S >= 0.
    """
    if isinstance(sink_size, bool) or not isinstance(sink_size, int) or sink_size < 0:
        raise GeometryError("runtime.sink_size", f"must be an integer >= 0, got {sink_size!r}",
                            "set runtime.sink_size >= 0")
    if isinstance(local_attn_size, bool) or not isinstance(local_attn_size, int):
        raise GeometryError("runtime.local_attn_size", f"must be an integer, got {local_attn_size!r}",
                            "use -1 (full length) or a frame count")
    if local_attn_size == -1:
        return
    need = sink_size + geometry.chunk_size
    if local_attn_size < need:
        raise GeometryError("runtime.local_attn_size", f"{local_attn_size} frames cannot hold sink_size {sink_size} "
                            f"plus one chunk of {geometry.chunk_size} frames",
                            f"use -1 (full length) or set runtime.local_attn_size >= {need}, or lower runtime.sink_size")


def no_cuda_error(geometry: Geometry, cpu_run: str) -> ConfigError:
    """The error for ``runtime.device=cuda`` where CUDA is not available. A small geometry runs on
    the CPU as it is; a model whose chunk's KV is above `GPU_CHUNK_BYTES` does not (the CPU
    computes it for hours and a session's chunks outgrow its memory), so the fix is a GPU, or
    ``cpu_run``: the overrides of a run of the same kind that fits a CPU."""
    kv = geometry.chunk_kv_nbytes()
    if kv <= GPU_CHUNK_BYTES:
        return ConfigError("runtime.device", "CUDA is not available", "use runtime.device=cpu")
    return ConfigError("runtime.device", f"CUDA is not available, and this run needs a GPU: one chunk's KV is "
                       f"{format_size(kv)} ({geometry.n_layers} layers x {geometry.hidden} wide), which a CPU "
                       "computes for hours and a session's chunks outgrow its memory",
                       f"run it on a machine with a GPU; on this CPU run the same kind of run at a small size: {cpu_run}")


CPU_RING_CHUNKS = 4  # a GPU-sized session holds at least this many chunks' KV at once (ring, staging)


def check_cpu_memory(geometry: Geometry, cpu_run: str, available: Optional[int] = None) -> None:
    """``runtime.device=cpu`` with a GPU-sized geometry (chunk KV above `GPU_CHUNK_BYTES`): a
    `ConfigError` before anything is allocated when this machine's available memory cannot hold
    `CPU_RING_CHUNKS` chunks' KV (the run would die out of memory after hours of compute);
    ``available``: bytes (default: the machine's available physical memory)."""
    kv = geometry.chunk_kv_nbytes()
    if kv <= GPU_CHUNK_BYTES:
        return
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
    need = CPU_RING_CHUNKS * kv
    if available < need:
        raise ConfigError("runtime.device", f"cpu: this run needs at least {format_size(need)} of memory "
                          f"({CPU_RING_CHUNKS} chunks' KV of {format_size(kv)}, {geometry.n_layers} layers x "
                          f"{geometry.hidden} wide) and this machine has {format_size(available)} available; "
                          "a CPU would also compute each chunk for hours",
                          f"run it on a machine with a GPU; on this CPU run the same kind of run at a small size: "
                          f"{cpu_run}")
