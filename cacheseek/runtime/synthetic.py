"""A synthetic autoregressive world-model runtime: the correctness test bed for KV restore.

`SyntheticWorldRuntime` has the cache semantics of the TeleFuser LingBot-World runtime
(docs/design.md section 1) and the attributes `LingBotWorldKVBinding` reads and writes (docs/api.md), with a
small seeded "model" in place of the DiT. Its outputs depend on the KV ring bit for bit, so a
restore that is wrong by one byte, or lands in the wrong slot, changes every later frame hash.

Ring (per layer): `k`, `v` of shape `[1, kv_size, H, D]` plus integer cursors `global_end_index`
and `local_end_index` (tokens). It is a shift-left buffer with a pinned sink (`ring_write`). Each
chunk is written once per denoising step and once more from the clean latent; only the first write
of a chunk advances the cursors (and shifts), so the final contents are the clean rewrite.

The model, per forward pass over one chunk (`T = chunk_tokens` tokens of `F = C * patch**2`
features, patchified from the latent):

    h = tanh(tokens @ W_in + time(t) + action(chunk) + cond(prompt, image))
    for each layer l:
        k, v, q = per-token outer products of two projections of h, shaped [T, H, D];
                  k and q are rotated by the absolute frame index of each token (rotary phase)
        ring_write(layer l, k, v)                      # first call of the chunk advances
        o   = attention of the mean query over the ring [:local_end]     # [H, D]
        w   = phase of an exact, position-weighted checksum of the ring's previous frames
              [:local_end - T] (computed once per chunk and layer)
        h   = tanh(h + proj(o) + proj(sin(w)) [+ folded GEMM term, see `compute`])
    x0_pred = tanh(h @ W_out + tokens / 2)

The attention makes KV and latents depend numerically on the attended window; the checksum (int64,
exact, order-independent) makes any single changed or misplaced byte of the window change the next
chunk's KV and latent by O(1), which bf16 rounding cannot hide. Each layer's K/V depend on the
earlier layers' windows through h, the last layer's window feeds x0, and the latent of every step
feeds the next, so a wrong byte anywhere in the window propagates to every later chunk.

Sampling, as TeleFuser's LingBot-World-fast loop does it: at construction one float32 draw
``[1, C, frame_num, h, w]`` from `generator` for the whole video, split along dim 2 into
`noise_chunks` (float32 views, one per chunk). Per denoised chunk: ``x = noise_chunks[i]`` cast to
the model dtype; for each of `num_steps` steps predict x0 (in the model dtype, bf16 by default),
then, except after the last step, re-noise to the next sigma with a fresh draw
``torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)``. So a denoised
chunk draws `len(timesteps) - 1` tensors of x0's shape and dtype; a restored chunk draws none (the
binding advances the generator with the same calls instead). The stored and decoded latent is x0
in the model dtype, never the noise's float32.

`compute` (optional, for GPU benchmarks) adds real matmuls: in every forward pass and every layer,
`gemms_per_layer_step` chained `[chunk_tokens, gemm_dim] @ [gemm_dim, gemm_dim]` GEMMs in the
runtime dtype, folded into h. FLOPs per denoised chunk of this term:
`2 * chunk_tokens * gemm_dim**2 * gemms_per_layer_step * n_layers * (num_steps + 1)` (the `+ 1` is
the clean rewrite pass). E.g. lingbot_480p, gemm_dim 4096, 1 GEMM, 4 steps: 31.4 TFLOP per chunk.
The GEMM weights are part of `weights_fingerprint`.

This module imports torch only inside functions: `import cacheseek.runtime` works without torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from cacheseek.errors import CacheSeekError, ConfigError, LayoutMismatchError
from cacheseek.registry import RUNTIMES
from cacheseek.runtime.geometry import Geometry, get_geometry, validate_window
from cacheseek.runtime.snapshot import ring_snapshot, snapshot_diff

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "RingCursorError",
    "SessionConfig",
    "SyntheticImage",
    "SyntheticRuntimeFactory",
    "SyntheticRuntimeSchema",
    "SyntheticWorldRuntime",
    "control_tensor",
    "default_image",
    "ring_write",
    "snapshot_diff",
]

DTYPES = ("bfloat16", "float16", "float32")
SAMPLE_SHIFT = 5.0
CONTROL_MODE = "cam"
MAX_SEQUENCE_LENGTH = 512
MAX_ACTION_DIM = 16
CONTROL_CHANNELS = 384  # 6 Plucker coordinates x an 8x8 pixel patch per latent pixel
VAE_STRIDE = 8
_WEIGHT_SEED = 0x5EED_CAC4E
_CHECKSUM_BLOCK_TOKENS = 2048
_M64 = (1 << 64) - 1
_IMAGE_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}


class RingCursorError(CacheSeekError):
    """A KV write at a token position the ring's cursors do not allow (neither the next chunk nor
    a rewrite of the last one), or one that cannot fit after the sink: the cursors are corrupt."""


# ---------------------------------------------------------------------------------------------
# Session inputs


@attrs.frozen(slots=True)
class SyntheticImage:
    """A PIL-like image: `mode`, `size = (width, height)` and `tobytes()` (row-major pixels)."""

    mode: str
    size: tuple[int, int] = attrs.field(converter=tuple)
    data: bytes = attrs.field(converter=bytes, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.mode not in _IMAGE_CHANNELS:
            raise ConfigError(
                "runtime.image", f"unsupported mode {self.mode!r}", "use L, RGB or RGBA"
            )
        if len(self.size) != 2 or not all(isinstance(x, int) and x > 0 for x in self.size):
            raise ConfigError(
                "runtime.image", f"size must be (width, height) > 0, got {self.size!r}"
            )
        w, h = self.size
        want = w * h * _IMAGE_CHANNELS[self.mode]
        if len(self.data) != want:
            raise ConfigError(
                "runtime.image", f"{self.mode} {w}x{h} needs {want} bytes, got {len(self.data)}"
            )

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


# ---------------------------------------------------------------------------------------------
# The ring


def ring_write(
    cache: dict, k: torch.Tensor, v: torch.Tensor, *, start_token: int, sink_tokens: int
) -> bool:
    """Write n tokens of K/V (`[1, n, H, D]`) for the chunk that starts at absolute token
    `start_token`, into one layer's ring `cache` (`k`, `v`: `[1, kv_size, H, D]`; int cursors).

    First call of a chunk (`start_token == global_end_index`): the cursors advance by n; if the
    ring would overflow, the tokens after the pinned sink (`sink_tokens`) shift left by the overflow
    and `local_end_index = kv_size`. Later calls for the same chunk
    (`start_token + n == global_end_index`) neither shift nor advance. Either way the tokens land at
    `[local_end - n, local_end)`. Returns True on a first call.
    """
    n = k.shape[1]
    g, le = cache["global_end_index"], cache["local_end_index"]
    size = cache["k"].shape[1]
    if start_token + n == g and n <= le:
        first = False
    elif start_token == g:
        first = True
        overflow = le + n - size
        if overflow > 0:
            rolled = le - overflow - sink_tokens
            if rolled < 0:
                raise RingCursorError(
                    f"{n} tokens do not fit after a sink of {sink_tokens} in a ring of {size}"
                )
            for name in ("k", "v"):
                buf = cache[name]
                src = sink_tokens + overflow
                buf[:, sink_tokens : sink_tokens + rolled] = buf[:, src : src + rolled].clone()
            le = size
        else:
            le += n
        cache["global_end_index"] = start_token + n
        cache["local_end_index"] = le
    else:
        raise RingCursorError(
            f"write of {n} tokens at {start_token}: global_end_index is {g}, local_end_index {le}"
        )
    cache["k"][:, le - n : le] = k
    cache["v"][:, le - n : le] = v
    return first


# ---------------------------------------------------------------------------------------------
# Helpers


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _lp(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unit_floats(data: bytes, n: int) -> list[float]:
    """n floats in [-1, 1] derived from `data` by SHAKE-256."""
    raw = hashlib.shake_256(data).digest(2 * n)
    return [v / 32767.5 - 1.0 for v in struct.unpack(f"<{n}H", raw)]


# ---------------------------------------------------------------------------------------------
# The runtime


class SyntheticWorldRuntime:
    """One session: generates `total_chunks` chunks of video, one per action.

    Attributes the binding reads or writes (names are a contract, see docs/api.md):
    `self_kv_cache` (n_layers dicts: `k`, `v` `[1, kv_size, H, D]` in `dtype`, int cursors),
    `world_kv_cached_latents` (`{chunk_idx: latent}` the binding fills; each is popped when its
    chunk comes up and decoded instead of denoised), `generator`, `timesteps`, `noise_chunks`
    (float32 views `latent_shape` of one whole-video draw, see the module docstring),
    `control_chunks` (float32 `[1, 384, c, h, w]` camera-control tensors on the runtime device,
    one per chunk, see `control_tensor`; `actions` keeps the action vectors), `chunk_size`, `frame_tokens`,
    `kv_local_attn_size` (L frames or -1), `kv_sink_size` (S frames), `device`, `dtype`
    (torch dtype), `weights_fingerprint` (sha256 of the model weights) and `session_config`.

    `kv_size` is `frame_tokens * frame_num` in full-length mode, `frame_tokens * L` when rolling.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        actions: Sequence[Sequence[float]],
        prompt: str = "a red car",
        image: Any = None,
        seed: int = 1234,
        num_steps: int = 4,
        local_attn_size: int = -1,
        sink_size: int = 0,
        total_chunks: int | None = None,
        device: str = "cpu",
        dtype: str = "bfloat16",
        hooks: Any = None,
        compute: dict | None = None,
    ) -> None:
        import torch

        if not isinstance(geometry, Geometry):
            raise ConfigError(
                "runtime.geometry", f"expected a Geometry, got {type(geometry).__name__}"
            )
        validate_window(geometry, local_attn_size, sink_size)
        _check_int("runtime.num_steps", num_steps, 1)
        _check_int("runtime.seed", seed, 0)
        if seed >= 1 << 63:
            raise ConfigError("runtime.seed", f"{seed} does not fit in 63 bits")
        _check_dtype(dtype)
        if not isinstance(prompt, str):
            raise ConfigError("runtime.prompt", f"must be a string, got {type(prompt).__name__}")
        device = _check_device(device)
        controls = _check_actions(actions)
        if total_chunks is None:
            total_chunks = len(controls)
        _check_int("runtime.total_chunks", total_chunks, 1)
        if total_chunks > len(controls):
            raise ConfigError(
                "runtime.total_chunks",
                f"{total_chunks} chunks but only {len(controls)} actions",
                "give one action per chunk",
            )
        for name in ("on_runtime_created", "on_chunk_finalized"):
            if hooks is not None and not callable(getattr(hooks, name, None)):
                raise ConfigError("runtime.hooks", f"hooks object lacks {name}()")
        self._gemm = _check_compute(compute)

        g = geometry
        self.geometry = g
        self.hooks = hooks
        self.total_chunks = total_chunks
        self.num_steps = num_steps
        self.device = device
        self.dtype = _torch_dtype(dtype)
        self.dtype_name = dtype
        self.chunk_size = g.chunk_size
        self.frame_tokens = g.frame_tokens
        self.kv_local_attn_size = local_attn_size
        self.kv_sink_size = sink_size
        self.frame_num = total_chunks * g.chunk_size
        window_frames = self.frame_num if local_attn_size == -1 else local_attn_size
        self.kv_size = g.frame_tokens * window_frames
        self.image = default_image() if image is None else image
        for attr in ("mode", "size", "tobytes"):
            if not hasattr(self.image, attr):
                raise ConfigError("runtime.image", f"image lacks {attr!r} (needs a PIL-like image)")

        self.actions = [list(a) for a in controls[:total_chunks]]
        self.control_chunks = [control_tensor(g, a, device=self.device) for a in self.actions]
        self.session_config = SessionConfig(
            prompt=prompt,
            image=self.image,
            seed=seed,
            frame_num=self.frame_num,
            chunk_size=g.chunk_size,
            sample_shift=SAMPLE_SHIFT,
            control_mode=CONTROL_MODE,
            max_attention_size=self.kv_size,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            sampling_steps=num_steps,
            local_attn_size=local_attn_size,
            sink_size=sink_size,
            dtype=dtype,
            size=(g.latent_w * VAE_STRIDE, g.latent_h * VAE_STRIDE),
        )

        base = [1.0 - s / num_steps for s in range(num_steps)]
        self._sigmas = [SAMPLE_SHIFT * s / (1.0 + (SAMPLE_SHIFT - 1.0) * s) for s in base] + [0.0]
        self.timesteps = [1000.0 * s for s in self._sigmas[:-1]]

        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        whole = (1, g.latent_channels, self.frame_num, g.latent_h, g.latent_w)
        noise = torch.randn(whole, generator=self.generator, device=self.device, dtype=torch.float32)
        self.noise_chunks = list(noise.split(g.chunk_size, dim=2))

        ring_shape = (1, self.kv_size, g.n_heads, g.head_dim)
        self.self_kv_cache = [
            {
                "k": torch.zeros(ring_shape, dtype=self.dtype, device=self.device),
                "v": torch.zeros(ring_shape, dtype=self.dtype, device=self.device),
                "global_end_index": 0,
                "local_end_index": 0,
            }
            for _ in range(g.n_layers)
        ]
        self.world_kv_cached_latents: dict[int, torch.Tensor] = {}
        self.frame_hashes: list[bytes] = []
        self.latents: list[torch.Tensor] = []
        self.restored_chunks: list[int] = []
        self.next_chunk = 0
        self._started = False

        weights = _make_weights(g, self._gemm)
        self.weights_fingerprint = _fingerprint(weights)
        if self._gemm is not None and self._gemm["gemms_per_layer_step"] != 1:
            # the GEMM chain length changes the bits too: it is part of the model
            chain = str(self._gemm["gemms_per_layer_step"]).encode()
            self.weights_fingerprint = hashlib.sha256(_lp(self.weights_fingerprint, b"gemms", chain)).digest()
        self._w = {name: w.to(self.device) for name, w in weights.items()}
        if "compute.w" in self._w:
            self._w["compute.w"] = self._w["compute.w"].to(self.dtype)
        self._init_conditioning(prompt)

    # -- public -------------------------------------------------------------------------------

    def generate(self, stop_after: int | None = None) -> list[bytes]:
        """Run (or continue) the session until `stop_after` chunks are done in total (default all);
        returns the per-chunk frame hashes (sha256 of the decoded frames) so far."""
        stop = self.total_chunks if stop_after is None else stop_after
        _check_int("stop_after", stop, 0)
        if stop > self.total_chunks:
            raise ConfigError("stop_after", f"{stop} > total_chunks {self.total_chunks}")
        return self.run_chunks(max(0, stop - self.next_chunk))

    def run_chunks(self, n: int) -> list[bytes]:
        """Run the next `n` chunks (calling `hooks.on_runtime_created` first, once per runtime)."""
        if not self._started:
            self._started = True
            if self.hooks is not None:
                self.hooks.on_runtime_created(self, self.session_config)
        for i in range(self.next_chunk, min(self.total_chunks, self.next_chunk + n)):
            self._run_chunk(i)
        return list(self.frame_hashes)

    def state_snapshot(self) -> dict:
        """Clones of everything a restore must reproduce (`ring_snapshot`) and `next_chunk`.
        Compare with `snapshot_diff`."""
        return ring_snapshot(self, next_chunk=self.next_chunk)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Frames of one chunk: `[chunk_size, 3, latent_h, latent_w]` float32, a fixed channel
        projection of the latent (cheap, deterministic, changes with any latent element)."""
        import torch

        return torch.einsum("cthw,cr->trhw", latent[0].float(), self._w["decode.proj"]).contiguous()

    # -- chunk loop ---------------------------------------------------------------------------

    def _run_chunk(self, i: int) -> None:
        cached = self.world_kv_cached_latents.pop(i, None)
        if cached is not None:
            self._check_latent(i, cached)
            x0 = cached
            self.restored_chunks.append(i)
        else:
            x0 = self._denoise_chunk(i)
            if self.hooks is not None:
                self.hooks.on_chunk_finalized(self, i, x0)
        self.latents.append(x0)
        self.frame_hashes.append(hashlib.sha256(_tensor_bytes(self.decode(x0))).digest())
        self.next_chunk = i + 1

    def _check_latent(self, i: int, latent: Any) -> None:
        shape = tuple(getattr(latent, "shape", ()))
        if shape != self.geometry.latent_shape or getattr(latent, "dtype", None) != self.dtype:
            raise LayoutMismatchError(
                f"cached latent of chunk {i}: {shape} {getattr(latent, 'dtype', None)}, "
                f"runtime needs {self.geometry.latent_shape} {self.dtype}"
            )
        if latent.device.type != self.device.type:
            raise LayoutMismatchError(
                f"cached latent of chunk {i} is on {latent.device}, runtime on {self.device}"
            )

    def _denoise_chunk(self, i: int) -> torch.Tensor:
        import torch

        noise = self.noise_chunks[i]
        x = noise.to(self.dtype)
        window: dict[int, torch.Tensor] = {}
        x0 = x
        for s in range(self.num_steps):
            x0 = self._forward(x, i, self._sigmas[s], window).to(self.dtype)
            if s + 1 < self.num_steps:
                eps = torch.randn(x0.shape, generator=self.generator, device=x0.device, dtype=x0.dtype)
                sigma = self._sigmas[s + 1]
                x = ((1.0 - sigma) * x0.float() + sigma * eps.float()).to(self.dtype)
        self._forward(x0, i, 0.0, window)
        return x0

    # -- the model ----------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor, chunk: int, sigma: float, window: dict) -> torch.Tensor:
        """One pass over chunk `chunk` at noise level `sigma`: writes every layer's K/V, returns
        x0_pred (float32, latent_shape). `window` caches the per-layer window phase of the chunk."""
        import torch

        g, w = self.geometry, self._w
        tokens = self._patchify(x.float())
        temb = torch.sin(sigma * w["embed.time_freq"] + w["embed.time_phase"])
        h = torch.tanh(tokens @ w["embed.in"] + temb + self._action_emb[chunk] + self._cond)
        cos, sin = self._rotary(chunk)
        start = chunk * g.chunk_tokens
        sink_tokens = self.kv_sink_size * g.frame_tokens
        for layer, cache in enumerate(self.self_kv_cache):
            p = f"L{layer}."
            k = _rope(_outer(h, w[p + "kh"], w[p + "kd"], w[p + "kb"]), cos, sin)
            v = _outer(h, w[p + "vh"], w[p + "vd"], w[p + "vb"])
            q = _rope(_outer(h, w[p + "qh"], w[p + "qd"], None), cos, sin)
            k, v = k[None].to(self.dtype), v[None].to(self.dtype)
            ring_write(cache, k, v, start_token=start, sink_tokens=sink_tokens)
            end = cache["local_end_index"]
            if layer not in window:
                window[layer] = self._window_term(layer, cache, end - g.chunk_tokens)
            o = self._attend(cache, end, q.mean(dim=0))
            o_term = torch.einsum("hd,hf,df->f", o, w[p + "oh"], w[p + "od"])
            h = torch.tanh(h + o_term + window[layer] + self._gemm_term(h))
        out = torch.tanh(h @ w["head.out"] + 0.5 * tokens)
        return self._unpatchify(out)

    def _attend(self, cache: dict, end: int, qbar: torch.Tensor) -> torch.Tensor:
        """Softmax attention of one query per head (`[H, D]`) over ring `[:end]`; -> `[H, D]`."""
        import torch

        keys = cache["k"][0, :end].transpose(0, 1)
        values = cache["v"][0, :end].transpose(0, 1)
        scores = torch.bmm(keys, qbar.to(self.dtype)[:, :, None])[:, :, 0].float()
        scores = scores / math.sqrt(self.geometry.head_dim)
        probs = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.bmm(probs.to(self.dtype)[:, None, :], values)[:, 0].float()

    def _window_term(self, layer: int, cache: dict, m: int) -> torch.Tensor:
        """`[F]` term from an exact checksum of ring `[:m]` (the previous frames in the window).

        Per head, K and V bytes are read as int16 and summed with weights that depend on the slot
        and the position in the head, in int64 (exact, no overflow, order-independent), then mixed
        into a phase in [0, 2pi): one changed or misplaced element gives an unrelated phase.
        """
        import torch

        g = self.geometry
        sums = []
        for name in ("k", "v"):
            raw = cache[name][0, :m].view(torch.int16)
            acc = torch.zeros(raw.shape[1:], dtype=torch.int64, device=self.device)
            for s in range(0, m, _CHECKSUM_BLOCK_TOKENS):
                blk = raw[s : s + _CHECKSUM_BLOCK_TOKENS].to(torch.int64)
                acc += (blk * self._slot_weights[s : s + blk.shape[0], None, None]).sum(dim=0)
            dim_w = self._dim_weights[: raw.shape[-1]]
            sums.append((acc * dim_w).sum(dim=-1).tolist())
        phases = []
        for head, (ck, cv) in enumerate(zip(*sums)):
            z = _splitmix64(ck & _M64)
            z = _splitmix64(z ^ (cv & _M64) ^ ((layer * g.n_heads + head) << 40))
            phases.append(z / 2.0**64 * 2.0 * math.pi)
        phase = torch.tensor(phases, dtype=torch.float32, device=self.device)
        return 0.5 * torch.sin(phase @ self._w[f"L{layer}.mix"])

    def _gemm_term(self, h: torch.Tensor) -> torch.Tensor | float:
        """The optional real compute: chained `[T, G] @ [G, G]` GEMMs, folded into h as `[T, 1]`."""
        if self._gemm is None:
            return 0.0
        import torch

        y = (h @ self._w["compute.expand"]).to(self.dtype)
        for _ in range(self._gemm["gemms_per_layer_step"]):
            y = torch.tanh(y @ self._w["compute.w"])
        return 0.01 * y.float().mean(dim=1, keepdim=True)

    # -- token layout -------------------------------------------------------------------------

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """`[1, C, c, Hl, Wl]` -> `[c * (Hl/p) * (Wl/p), C * p * p]`, frame-major token order."""
        g = self.geometry
        p = g.patch
        t = x[0].reshape(g.latent_channels, g.chunk_size, g.latent_h // p, p, g.latent_w // p, p)
        return t.permute(1, 2, 4, 0, 3, 5).reshape(g.chunk_tokens, -1)

    def _unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        p = g.patch
        t = tokens.reshape(g.chunk_size, g.latent_h // p, g.latent_w // p, g.latent_channels, p, p)
        return t.permute(3, 0, 1, 4, 2, 5).reshape(g.latent_shape)

    def _rotary(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, 1, D/2]` of each token's absolute frame index."""
        import torch

        g = self.geometry
        tokens = torch.arange(g.chunk_tokens, device=self.device)
        frames = chunk * g.chunk_size + tokens // g.frame_tokens
        angle = frames.float()[:, None] * self._inv_freq[None, :]
        return torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]

    def _init_conditioning(self, prompt: str) -> None:
        import torch

        g = self.geometry
        feats = g.latent_channels * g.patch * g.patch
        img = self.image
        parts = (prompt.encode(), str(img.mode).encode(), repr(tuple(img.size)).encode())
        cond = _unit_floats(_lp(b"synthetic-cond", *parts, img.tobytes()), feats)
        self._cond = 0.5 * torch.tensor(cond, dtype=torch.float32, device=self.device)
        padded = torch.zeros((self.total_chunks, MAX_ACTION_DIM), dtype=torch.float32)
        for i, a in enumerate(self.actions):
            padded[i, : len(a)] = torch.tensor(a, dtype=torch.float32)
        self._action_emb = torch.tanh(padded.to(self.device) @ self._w["embed.action"])
        half = torch.arange(0, g.head_dim, 2, dtype=torch.float32, device=self.device)
        self._inv_freq = 1.0 / (10000.0 ** (half / g.head_dim))
        slots = torch.arange(self.kv_size, dtype=torch.int64, device=self.device)
        self._slot_weights = 1 + (slots * 2654435761) % 4093
        dims = torch.arange(2 * g.head_dim, dtype=torch.int64, device=self.device)
        self._dim_weights = 1 + (dims * 40503) % 251


# ---------------------------------------------------------------------------------------------
# Model pieces


def _outer(
    h: torch.Tensor, wh: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`[T, F]` -> `[T, H, D]`: tanh of the per-token outer product of two projections of h."""
    import torch

    t = (h @ wh)[:, :, None] * (h @ wd)[:, None, :]
    return torch.tanh(t if bias is None else t + bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs `(x[..., 2j], x[..., 2j+1])` of `[T, H, D]` by the per-token angles."""
    import torch

    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def _make_weights(g: Geometry, gemm: dict | None) -> dict[str, torch.Tensor]:
    """The model's fp32 weights on CPU, drawn in a fixed order from a fixed seed (not the session
    seed: the weights are the model, the seed is the session)."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(_WEIGHT_SEED)
    feats = g.latent_channels * g.patch * g.patch
    hd, d = g.n_heads, g.head_dim

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * scale

    w: dict[str, torch.Tensor] = {
        "embed.in": rnd(feats, feats, scale=1.0 / math.sqrt(feats)),
        "embed.time_freq": rnd(feats, scale=3.0),
        "embed.time_phase": rnd(feats, scale=1.0),
        "embed.action": rnd(MAX_ACTION_DIM, feats, scale=0.5),
    }
    for layer in range(g.n_layers):
        p = f"L{layer}."
        for proj in ("k", "v", "q"):
            w[p + proj + "h"] = rnd(feats, hd, scale=1.5 / math.sqrt(feats))
            w[p + proj + "d"] = rnd(feats, d, scale=1.5 / math.sqrt(feats))
        w[p + "kb"] = rnd(hd, d, scale=0.3)
        w[p + "vb"] = rnd(hd, d, scale=0.3)
        w[p + "oh"] = rnd(hd, feats, scale=1.0 / math.sqrt(hd))
        w[p + "od"] = rnd(d, feats, scale=1.0 / math.sqrt(d))
        w[p + "mix"] = rnd(hd, feats, scale=1.0)
    w["head.out"] = rnd(feats, feats, scale=1.0 / math.sqrt(feats))
    w["decode.proj"] = rnd(g.latent_channels, 3, scale=1.0)
    if gemm is not None:
        dim = gemm["gemm_dim"]
        w["compute.expand"] = rnd(feats, dim, scale=1.0 / math.sqrt(feats))
        w["compute.w"] = rnd(dim, dim, scale=1.0 / math.sqrt(dim))
    return w


def control_tensor(g: Geometry, action: Sequence[float], *, device: Any = "cpu") -> torch.Tensor:
    """The camera-control tensor of one chunk as LingBot-World-fast's pipeline hands it over:
    ``[1, CONTROL_CHANNELS, chunk_size, latent_h, latent_w]`` float32 (6 Plucker coordinates per
    pixel of an 8x8 patch; 7.19 M values a chunk at 480x832). Here a fixed smooth function of
    the action vector: every value depends on every action component, so the action key (a hash
    of this tensor) separates actions exactly as the model does."""
    import torch

    a = torch.zeros(MAX_ACTION_DIM, dtype=torch.float32)
    a[: len(action)] = torch.tensor(list(action), dtype=torch.float32)
    ch = torch.arange(CONTROL_CHANNELS, dtype=torch.float32)
    basis = torch.cos(ch[:, None] * (torch.arange(MAX_ACTION_DIM, dtype=torch.float32)[None, :] + 1.0) * 0.37)
    per_channel = torch.tanh(basis @ a)  # [CONTROL_CHANNELS]
    f = torch.arange(g.chunk_size, dtype=torch.float32)[:, None, None]
    y = torch.arange(g.latent_h, dtype=torch.float32)[None, :, None] / g.latent_h
    x = torch.arange(g.latent_w, dtype=torch.float32)[None, None, :] / g.latent_w
    ramp = (y - 0.5) * (1.0 + 0.1 * f) + (x - 0.5)  # [c, h, w]
    out = per_channel[:, None, None, None] * (1.0 + ramp[None])
    return out[None].to(device).contiguous()


def _fingerprint(weights: dict[str, torch.Tensor]) -> bytes:
    h = hashlib.sha256(_lp(b"synthetic-weights"))
    for name, t in weights.items():
        meta = (name.encode(), repr(tuple(t.shape)).encode(), str(t.dtype).encode())
        h.update(_lp(*meta, _tensor_bytes(t)))
    return h.digest()


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


def _check_dtype(dtype: Any) -> None:
    if dtype not in DTYPES:
        raise ConfigError(
            "runtime.dtype", f"unknown dtype {dtype!r}", "use one of: " + ", ".join(DTYPES)
        )


def _check_device(device: Any) -> torch.device:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            "runtime.device", f"unknown device {device!r}", "use cpu or cuda"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("runtime.device", f"unsupported device {device!r}", "use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "runtime.device", "CUDA is not available", "use runtime.device=cpu"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigError("runtime.device", f"{device!r}: only {count} GPUs")
    return dev


def _check_actions(actions: Any) -> list[list[float]]:
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or not actions:
        raise ConfigError("runtime.actions", "must be a non-empty sequence of per-chunk controls")
    out = []
    for i, a in enumerate(actions):
        try:
            vals = [float(x) for x in a]
        except (TypeError, ValueError):
            raise ConfigError(
                "runtime.actions", f"action {i} is not a sequence of floats: {a!r}"
            ) from None
        if len(vals) > MAX_ACTION_DIM:
            raise ConfigError(
                "runtime.actions", f"action {i} has {len(vals)} values, at most {MAX_ACTION_DIM}"
            )
        if not all(math.isfinite(x) for x in vals):
            raise ConfigError("runtime.actions", f"action {i} has a non-finite value")
        out.append(vals)
    return out


def _check_compute(compute: Any) -> dict | None:
    if compute is None:
        return None
    if not isinstance(compute, dict):
        raise ConfigError(
            "runtime.compute", f"must be a dict or None, got {type(compute).__name__}"
        )
    unknown = set(compute) - {"gemm_dim", "gemms_per_layer_step"}
    if unknown:
        raise ConfigError(
            "runtime.compute",
            f"unknown keys {sorted(unknown)}",
            "use gemm_dim and gemms_per_layer_step",
        )
    out = {
        "gemm_dim": compute.get("gemm_dim"),
        "gemms_per_layer_step": compute.get("gemms_per_layer_step", 1),
    }
    _check_int("runtime.compute.gemm_dim", out["gemm_dim"], 1)
    _check_int("runtime.compute.gemms_per_layer_step", out["gemms_per_layer_step"], 1)
    return out


# ---------------------------------------------------------------------------------------------
# Registration


@dataclasses.dataclass
class SyntheticRuntimeSchema:
    """Hydra schema of `runtime: synthetic`; `compute_gemm_dim` 0 means no extra compute,
    `compute_gemms` is the number of chained GEMMs per layer and forward pass (see `compute`)."""

    _target_: str = "cacheseek.runtime.synthetic.SyntheticRuntimeFactory"
    geometry: str = "tiny"
    local_attn_size: int = -1
    sink_size: int = 0
    num_steps: int = 4
    device: str = "cpu"
    dtype: str = "bfloat16"
    seed: int = 1234
    prompt: str = "a red car driving along a coast road"
    compute_gemm_dim: int = 0
    compute_gemms: int = 1


@RUNTIMES.register("synthetic", SyntheticRuntimeSchema)
class SyntheticRuntimeFactory:
    """Validated settings of a synthetic runtime; `make()` builds one session's runtime."""

    def __init__(
        self,
        *,
        geometry: str = "tiny",
        local_attn_size: int = -1,
        sink_size: int = 0,
        num_steps: int = 4,
        device: str = "cpu",
        dtype: str = "bfloat16",
        seed: int = 1234,
        prompt: str = "a red car driving along a coast road",
        compute_gemm_dim: int = 0,
        compute_gemms: int = 1,
    ) -> None:
        self._geometry = get_geometry(geometry)
        validate_window(self._geometry, local_attn_size, sink_size)
        _check_int("runtime.num_steps", num_steps, 1)
        _check_int("runtime.seed", seed, 0)
        _check_int("runtime.compute_gemm_dim", compute_gemm_dim, 0)
        _check_int("runtime.compute_gemms", compute_gemms, 1)
        _check_dtype(dtype)
        if not isinstance(prompt, str):
            raise ConfigError("runtime.prompt", f"must be a string, got {type(prompt).__name__}")
        self._device = str(_check_device(device))
        self._local_attn_size = local_attn_size
        self._sink_size = sink_size
        self._dtype = dtype
        self.num_steps = num_steps
        self.seed = seed
        self.prompt = prompt
        self.compute_gemm_dim = compute_gemm_dim
        self.compute_gemms = compute_gemms

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    def describe(self) -> dict[str, Any]:
        """What a report names: the runtime, its geometry and device."""
        return {"runtime": "synthetic", "geometry": self._geometry.name, "device": self._device}

    @property
    def local_attn_size(self) -> int:
        return self._local_attn_size

    @property
    def sink_size(self) -> int:
        return self._sink_size

    @property
    def device(self) -> str:
        return self._device

    @property
    def dtype(self) -> str:
        return self._dtype

    def make(
        self,
        actions: Sequence[Sequence[float]],
        hooks: Any = None,
        total_chunks: int | None = None,
        *,
        image: Any = None,
    ) -> SyntheticWorldRuntime:
        """A fresh runtime for one session with these settings."""
        return SyntheticWorldRuntime(
            self._geometry,
            actions=actions,
            prompt=self.prompt,
            image=image,
            seed=self.seed,
            num_steps=self.num_steps,
            local_attn_size=self._local_attn_size,
            sink_size=self._sink_size,
            total_chunks=total_chunks,
            device=self._device,
            dtype=self._dtype,
            hooks=hooks,
            compute=(
                {"gemm_dim": self.compute_gemm_dim, "gemms_per_layer_step": self.compute_gemms}
                if self.compute_gemm_dim
                else None
            ),
        )
