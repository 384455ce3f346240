"""What a layout adapter is: the one place that knows where a runtime keeps what the binding uses.

The binding (`LingBotWorldKVBinding`), the ring check and the namespace fields never read a
runtime attribute themselves; they ask the runtime's layout adapter:

- the ring: per layer a mapping with ``k``/``v`` ``[1, kv_size, H, D]`` and two cursors,
  ``global_end_index`` and ``local_end_index`` (tokens), held as ints or as 0-d int64 tensors
  (`ring_layers`); from it `layers` (validated tensors), `cursors`, `set_cursors`, `tail_views`
  and `token_bytes` follow the same way for every layout;
- the geometry ``c, ft, L, S`` (`window`), the number of chunks of the session (`n_chunks`), the
  control tensor of each chunk (`controls`), the sampler's timesteps (`timesteps`), the RNG the
  denoiser draws from (`generator`) and the RNGs a restore must leave as a cold run would
  (`rng_states`);
- the latent of a chunk as stored and decoded (`latent_spec`) and where cached latents are
  published for decode-only chunks (`cached_latents`);
- the layout fields of the namespace fingerprint (`fingerprint_fields`).

A concrete layout subclasses `RingLayout` and locates those things (`bshd`: attributes of one
runtime object; `telefuser_main`: a session whose ring sits behind the denoise stage's cache
handle). Writes go through `set_cursors` and `publish_latents` only, which the binding calls at
its single publication point.
"""

from __future__ import annotations

import abc
from collections.abc import MutableMapping, Sequence
from typing import Any

import attrs

from cacheseek.errors import LayoutMismatchError
from cacheseek.kv.ring import append_tokens, shift_after_sink

__all__ = ["LatentSpec", "RingLayout"]


@attrs.frozen(slots=True)
class LatentSpec:
    """How one chunk's latent is stored and restored: ``shape`` of the runtime's noise chunk
    (``[1, C, chunk_size, h, w]``), ``dtype`` the runtime's denoiser returns and its decoder gets
    on a cold run (whatever dtype its noise was drawn in), ``device`` of the runtime."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: Any
    device: Any


class RingLayout(abc.ABC):
    """Shared logic over a per-layer ring; subclasses locate the runtime's parts (the abstract
    methods) and may override the defaulted ones."""

    storage_format = "cacheseek.kv.bshd.v1"
    telefuser_releases: tuple[str, ...] = ()  # the TeleFuser releases (`TeleFuserLayout` values) laid out so

    @classmethod
    def matches(cls, runtime: Any) -> bool:
        """Whether ``runtime`` (a runtime or session a binding is handed) is laid out so (``layout:
        auto`` picks the first registered layout that matches, else ``bshd``)."""
        return False

    # -- where things live (each layout) ------------------------------------------------------

    @abc.abstractmethod
    def ring_layers(self, runtime: Any) -> Sequence[MutableMapping[str, Any]]:
        """Per layer the mapping holding ``k``, ``v`` and both cursors."""

    @abc.abstractmethod
    def window(self, runtime: Any) -> Any:
        """The ring's `RingGeometry` (chunk size, frame tokens, L, S)."""

    @abc.abstractmethod
    def n_chunks(self, runtime: Any) -> int:
        ...

    @abc.abstractmethod
    def controls(self, runtime: Any) -> Sequence[Any] | None:
        """One control tensor per chunk, or None for a runtime without controls."""

    @abc.abstractmethod
    def timesteps(self, runtime: Any) -> Any:
        ...

    @abc.abstractmethod
    def generator(self, runtime: Any) -> Any:
        """The RNG the denoiser draws ``len(timesteps) - 1`` times from per computed chunk."""

    def rng_states(self, runtime: Any) -> dict[str, Any]:
        """The states of the RNGs a restore must leave as a cold run leaves them, by name."""
        return {"generator": self.generator(runtime).get_state()}

    @abc.abstractmethod
    def latent_spec(self, runtime: Any) -> LatentSpec:
        ...

    def cached_latents(self, runtime: Any) -> MutableMapping[int, Any]:
        """Where the runtime looks for the latent of a decode-only chunk."""
        return runtime.world_kv_cached_latents

    # -- the same for every layout ------------------------------------------------------------

    def layers(self, runtime: Any) -> list[tuple[Any, Any]]:
        """Per layer ``(k, v)`` of the runtime's ring, validated: B=1, contiguous, one dtype."""
        out = []
        for i, layer in enumerate(self.ring_layers(runtime)):
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
        k = self.ring_layers(runtime)[0]["k"]
        return int(k.shape[2] * k.shape[3] * k.element_size())

    def cursors(self, runtime: Any) -> list[tuple[int, int]]:
        """Per layer ``(global_end_index, local_end_index)`` as ints."""
        return [(int(layer["global_end_index"]), int(layer["local_end_index"]))
                for layer in self.ring_layers(runtime)]

    def set_cursors(self, runtime: Any, global_end: int, local_end: int) -> None:
        """Both cursors of every layer, kept in the runtime's own form: a 0-d tensor is filled in
        place (other holders of it see the update), an int is replaced by an int."""
        for layer in self.ring_layers(runtime):
            for name, value in (("global_end_index", global_end), ("local_end_index", local_end)):
                cursor = layer[name]
                if hasattr(cursor, "fill_"):
                    cursor.fill_(int(value))
                else:
                    layer[name] = int(value)

    def tail_views(self, runtime: Any, n_tokens: int) -> list[tuple[Any, Any]]:
        """Detached views of ``[local_end - n_tokens, local_end)`` of every layer (no copy)."""
        out = []
        for (_, end), (k, v) in zip(self.cursors(runtime), self.layers(runtime)):
            start = end - n_tokens
            if start < 0:
                raise LayoutMismatchError(f"ring tail [{start}, {end}) starts before slot 0")
            out.append((k[:, start:end].detach(), v[:, start:end].detach()))
        return out

    def append_chunk(self, runtime: Any, values: Sequence[tuple[Any, Any]]) -> None:
        """Leave the ring as the DiT's writes of one computed chunk leave it: per layer, when the
        ring would overflow, the tokens after the sink shift left by the overflow; the chunk's
        ``values`` (per layer ``(k, v)`` ``[1, n, H, D]``, the ring's dtype and device) land at
        the tail; both cursors advance by the chunk. Everything is checked before the first
        write: a mismatch raises `LayoutMismatchError` and changes nothing."""
        layers = self.layers(runtime)
        cursors = set(self.cursors(runtime))
        if len(values) != len(layers) or len(cursors) != 1:
            raise LayoutMismatchError(f"{len(values)} layers of values for a ring of {len(layers)} layers "
                                      f"with cursors {sorted(cursors)}")
        (global_end, local_end), = cursors
        ring = self.window(runtime)
        sink = ring.sink_size * ring.frame_tokens
        for i, ((k, _), (vk, vv)) in enumerate(zip(layers, values)):
            want = (1, vk.shape[1], k.shape[2], k.shape[3])
            for t in (vk, vv):
                if tuple(t.shape) != want or t.dtype != k.dtype or t.device != k.device:
                    raise LayoutMismatchError(f"layer {i}: a chunk value {tuple(t.shape)} {t.dtype} on {t.device}; "
                                              f"the ring takes {want} {k.dtype} on {k.device}")
        n = int(values[0][0].shape[1])
        overflow, end = append_tokens(local_end, n, int(layers[0][0].shape[1]), sink)
        for (k, v), (vk, vv) in zip(layers, values):
            for buf, value in ((k, vk), (v, vv)):
                if overflow:
                    shift_after_sink(buf, local_end, overflow, sink)
                buf[:, end - n:end].copy_(value)
        self.set_cursors(runtime, global_end + n, end)

    def publish_latents(self, runtime: Any, latents: Sequence[Any]) -> None:
        """Chunk i's latent becomes the runtime's cached latent i (decode only, no denoise)."""
        self.cached_latents(runtime).update(enumerate(latents))

    def fingerprint_fields(self, runtime: Any) -> dict[str, Any]:
        k, _ = self.layers(runtime)[0]
        ring = self.window(runtime)
        latent = self.latent_spec(runtime)
        return {"storage_format": self.storage_format, "n_layers": len(self.ring_layers(runtime)),
                "kv_shape": [1, ring.chunk_size * ring.frame_tokens, int(k.shape[2]), int(k.shape[3])],
                "kv_dtype": str(k.dtype), "latent_shape": list(latent.shape), "latent_dtype": str(latent.dtype),
                "chunk_size": ring.chunk_size, "frame_tokens": ring.frame_tokens}
