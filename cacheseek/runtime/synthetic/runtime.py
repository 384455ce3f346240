"""`SyntheticWorldRuntime`: one session of the synthetic world model, chunk after chunk.

It has the cache semantics of the TeleFuser LingBot-World runtime (docs/design.md section 1) and
the attributes `LingBotWorldKVBinding` reads and writes (docs/api.md); the model is
`SyntheticModel`, the ring write `ring_write`. The latent of every step feeds the next and every
chunk's KV depends on the attended window, so a wrong byte anywhere in the window propagates to
every later chunk.

Sampling, as TeleFuser's LingBot-World-fast loop does it: at construction one float32 draw
``[1, C, frame_num, h, w]`` from `generator` for the whole video, split along dim 2 into
`noise_chunks` (float32 views, one per chunk). Per denoised chunk: ``x = noise_chunks[i]`` cast to
the model dtype; for each of `num_steps` steps predict x0 (in the model dtype, bf16 by default),
then, except after the last step, re-noise to the next sigma with a fresh draw
``torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)``. So a denoised
chunk draws `len(timesteps) - 1` tensors of x0's shape and dtype; a restored chunk draws none (the
binding advances the generator with the same calls instead). The stored and decoded latent is x0
in the model dtype, never the noise's float32. A last pass over the clean x0 rewrites the chunk's
KV (the ring keeps the clean rewrite).

Decoding is causal, as the Wan VAE's streaming decode is: a chunk's frames are its latent's
projection plus a term of the previous chunk's last frame (the decoder's state), so a chunk's
frames depend on every chunk before it. With ``handout`` the runtime asks the
binding before each chunk (`HandOut.next_chunk`): a chunk on the cached path hands out its
stored frames (no denoise, no decode, the decoder's state untouched); at divergence the
binding restores the served path and the runtime decodes its latents again, in order, to rebuild
the decoder's state before the chunk it computes (after loading the decoder's state the binding
stored at a resume point, if it has one: `SyntheticDecoder`).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from cacheseek.hooks import as_hooks
from cacheseek.errors import ConfigError, LayoutMismatchError
from cacheseek.kv.decoder_state import DecoderStateSpec
from cacheseek.kv.frames import FramesSpec
from cacheseek.kv.runtime_decoder import RuntimeDecoder
from cacheseek.runtime.geometry import Geometry, validate_window
from cacheseek.runtime.snapshot import ring_snapshot
from cacheseek.runtime.synthetic.checks import (check_actions, check_compute, check_device, check_dtype, check_int,
                                                check_prompt, torch_dtype)
from cacheseek.runtime.synthetic.control import control_tensor
from cacheseek.runtime.synthetic.hashing import tensor_bytes
from cacheseek.runtime.synthetic.model import SyntheticModel
from cacheseek.runtime.synthetic.session import (CONTROL_MODE, MAX_SEQUENCE_LENGTH, SAMPLE_SHIFT, VAE_STRIDE,
                                                 SessionConfig, default_image)

__all__ = ["SyntheticWorldRuntime", "SyntheticDecoder", "sigma_schedule"]


class SyntheticDecoder(RuntimeDecoder):
    """The causal decoder's state of a `SyntheticWorldRuntime`: the previous chunk's last frame
    ``[3, latent_h, latent_w]`` float32. It loads late: a stored state is read while the chunk
    denoises and loaded right before its decode (`NextChunk.late_state`)."""

    loads_late = True

    def __init__(self, runtime: "SyntheticWorldRuntime") -> None:
        self.runtime = weakref.proxy(runtime)  # the runtime holds its decoder: no cycle keeps its ring
        self.device = runtime.device

    def spec(self, after_chunk: int) -> DecoderStateSpec:
        g = self.runtime.geometry
        return DecoderStateSpec([((3, g.latent_h, g.latent_w), torch.float32)])

    def capture(self) -> Any:
        state = self.runtime._decoder_state
        return None if state is None else [state]

    def load(self, entries: list) -> None:
        self.runtime._decoder_state = entries[0]


def sigma_schedule(num_steps: int) -> list[float]:
    """The shifted flow-matching sigmas of `num_steps` steps, then 0.0 (`num_steps + 1` values)."""
    base = [1.0 - s / num_steps for s in range(num_steps)]
    return [SAMPLE_SHIFT * s / (1.0 + (SAMPLE_SHIFT - 1.0) * s) for s in base] + [0.0]


class SyntheticWorldRuntime:
    """One session: generates `total_chunks` chunks of video, one per action.

    Attributes the binding reads or writes (names are a contract, see docs/api.md):
    `self_kv_cache` (n_layers dicts: `k`, `v` `[1, kv_size, H, D]` in `dtype`, int cursors),
    `world_kv_cached_latents` (`{chunk_idx: latent}` the binding fills; each is popped when its
    chunk comes up and decoded instead of denoised), `generator`, `timesteps`, `noise_chunks`
    (float32 views `latent_shape` of one whole-video draw, see the module docstring),
    `control_chunks` (float32 `[1, 384, c, h, w]` camera-control tensors on the runtime device,
    one per chunk, see `control_tensor`; None for a ``streamed`` session, whose chunk ``i``
    reaches ``hooks.on_chunk_control(runtime, i, control, may_restore=True)`` as it starts, as a
    live TeleFuser session's does (with ``lookahead`` n, the controls of the next n chunks reach
    ``hooks.on_control_arrived`` first, as queued actions would); `actions` keeps the action
    vectors), `chunk_size`, `frame_tokens`,
    `kv_local_attn_size` (L frames or -1), `kv_sink_size` (S frames), `device`, `dtype`
    (torch dtype), `weights_fingerprint` (sha256 of the model weights) and `session_config`.

    `kv_size` is `frame_tokens * frame_num` in full-length mode, `frame_tokens * L` when rolling.
    `compute` (optional): ``{"gemm_dim", "gemms_per_layer_step"}``, real GEMMs folded into the
    model (see `cacheseek.runtime.synthetic.model`); part of `weights_fingerprint`.
    """

    def __init__(self, geometry: Geometry, *, actions: Sequence[Sequence[float]], prompt: str = "a red car",
                 image: Any = None, seed: int = 1234, num_steps: int = 4, local_attn_size: int = -1,
                 sink_size: int = 0, total_chunks: int | None = None, device: str = "cpu", dtype: str = "bfloat16",
                 hooks: Any = None, compute: dict | None = None, streamed: bool = False, lookahead: int = 0,
                 handout: bool = False) -> None:
        if not isinstance(geometry, Geometry):
            raise ConfigError("runtime.geometry", f"expected a Geometry, got {type(geometry).__name__}")
        validate_window(geometry, local_attn_size, sink_size)
        check_int("runtime.num_steps", num_steps, 1)
        check_int("runtime.seed", seed, 0)
        if seed >= 1 << 63:
            raise ConfigError("runtime.seed", f"{seed} does not fit in 63 bits")
        check_dtype(dtype)
        check_prompt(prompt)
        device = check_device(device)
        controls = check_actions(actions)
        if total_chunks is None:
            total_chunks = len(controls)
        check_int("runtime.total_chunks", total_chunks, 1)
        if total_chunks > len(controls):
            raise ConfigError("runtime.total_chunks", f"{total_chunks} chunks but only {len(controls)} actions",
                              "give one action per chunk")
        for name in ("on_runtime_created", "on_chunk_finalized"):
            if hooks is not None and not callable(getattr(hooks, name, None)):
                raise ConfigError("runtime.hooks", f"hooks object lacks {name}()")
        gemm = check_compute(compute)

        g = geometry
        self.geometry = g
        self.hooks = as_hooks(hooks)
        self.total_chunks = total_chunks
        self.num_steps = num_steps
        self.device = device
        self.dtype = torch_dtype(dtype)
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
        self.streamed = bool(streamed)
        check_int("runtime.lookahead", lookahead, 0)
        self.lookahead = lookahead
        self._controls = [control_tensor(g, a, device=self.device) for a in self.actions]
        self.control_chunks = None if self.streamed else self._controls  # a live session plans none
        self.session_config = SessionConfig(
            prompt=prompt, image=self.image, seed=seed, frame_num=self.frame_num, chunk_size=g.chunk_size,
            sample_shift=SAMPLE_SHIFT, control_mode=CONTROL_MODE, max_attention_size=self.kv_size,
            max_sequence_length=MAX_SEQUENCE_LENGTH, sampling_steps=num_steps, local_attn_size=local_attn_size,
            sink_size=sink_size, dtype=dtype, size=(g.latent_w * VAE_STRIDE, g.latent_h * VAE_STRIDE))

        self._sigmas = sigma_schedule(num_steps)
        self.timesteps = [1000.0 * s for s in self._sigmas[:-1]]

        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        whole = (1, g.latent_channels, self.frame_num, g.latent_h, g.latent_w)
        noise = torch.randn(whole, generator=self.generator, device=self.device, dtype=torch.float32)
        self.noise_chunks = list(noise.split(g.chunk_size, dim=2))

        ring_shape = (1, self.kv_size, g.n_heads, g.head_dim)
        self.self_kv_cache = [{"k": torch.zeros(ring_shape, dtype=self.dtype, device=self.device),
                               "v": torch.zeros(ring_shape, dtype=self.dtype, device=self.device),
                               "global_end_index": 0, "local_end_index": 0} for _ in range(g.n_layers)]
        self.world_kv_cached_latents: dict[int, torch.Tensor] = {}
        self.frame_hashes: list[bytes] = []
        self.keep_frames = False  # True: ``frames`` keeps each chunk's frames (a lossy codec's quality verdict)
        self.frames: list[torch.Tensor] = []
        self.latents: list[torch.Tensor] = []
        self.restored_chunks: list[int] = []
        self.handed_out: list[int] = []  # chunks whose stored frames were handed out
        self.next_chunk = 0
        self._started = False
        self.handout = bool(handout)
        self._decoder_state: torch.Tensor | None = None  # the previous chunk's last frame
        self.decoder = SyntheticDecoder(self)

        self._model = SyntheticModel(g, actions=self.actions, prompt=prompt, image=self.image, kv_size=self.kv_size,
                                     device=self.device, dtype=self.dtype, gemm=gemm)
        self.weights_fingerprint = self._model.fingerprint

    # -- public -------------------------------------------------------------------------------

    def generate(self, stop_after: int | None = None) -> list[bytes]:
        """Run (or continue) the session until `stop_after` chunks are done in total (default all);
        returns the per-chunk frame hashes (sha256 of the decoded frames) so far."""
        stop = self.total_chunks if stop_after is None else stop_after
        check_int("stop_after", stop, 0)
        if stop > self.total_chunks:
            raise ConfigError("stop_after", f"{stop} > total_chunks {self.total_chunks}")
        return self.run_chunks(max(0, stop - self.next_chunk))

    def run_chunks(self, n: int) -> list[bytes]:
        """Run the next `n` chunks (calling `hooks.on_runtime_created` first, once per runtime)."""
        if not self._started:
            self._started = True
            if self.hooks is not None:
                if self.handout:
                    self.hooks.accept_handout()
                self.hooks.on_runtime_created(self, self.session_config)
        for i in range(self.next_chunk, min(self.total_chunks, self.next_chunk + n)):
            self._run_chunk(i)
        return list(self.frame_hashes)

    def state_snapshot(self) -> dict:
        """Clones of everything a restore must reproduce (`ring_snapshot`) and `next_chunk`:
        the state the next chunk computes on (what the session served from frames is restored
        first, `materialize_restored`). Compare with `snapshot_diff`."""
        self.materialize_restored()
        return ring_snapshot(self, next_chunk=self.next_chunk)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """The latent's part of a chunk's frames: `[chunk_size, 3, latent_h, latent_w]` float32,
        a fixed channel projection of the latent (cheap, deterministic, changes with any latent
        element)."""
        return self._model.decode(latent)

    def decode_chunk(self, latent: torch.Tensor, *, first: bool) -> torch.Tensor:
        """A chunk's frames from the causal decoder (`decode` plus a term of the previous
        chunk's last frame; ``first`` resets the state), which advances its state."""
        frames = self.decode(latent)
        if not first and self._decoder_state is not None:
            frames = frames + 0.25 * torch.tanh(self._decoder_state)[None]
        self._decoder_state = frames[-1].clone()
        return frames

    @property
    def frames_spec(self) -> Any:
        """What one chunk's handed-out frames are: ``[chunk_size, 3, h, w]`` float32."""
        g = self.geometry
        return FramesSpec((g.chunk_size, 3, g.latent_h, g.latent_w), torch.float32)

    def materialize_restored(self) -> int:
        """Restore what the session served from frames into the ring now, as its divergence
        would (the ring check compares that state with a cold run's); chunks restored."""
        return self.hooks.materialize(self) if self.handout and self.hooks is not None else 0

    # -- chunk loop ---------------------------------------------------------------------------

    def _run_chunk(self, i: int) -> None:
        if self.streamed and self.hooks is not None:
            # controls queued ahead of their chunks, as a service queues its users' actions; then
            # chunk i's control arrives, as in a live session: the binding may restore the chunk
            for j in range(i + 1, min(i + 1 + self.lookahead, self.total_chunks)):
                self.hooks.on_control_arrived(self, j, self._controls[j])
            self.hooks.on_chunk_control(self, i, self._controls[i], may_restore=True)
        plan = self.hooks.next_chunk(self, i, self.frames_spec, decoder=self.decoder) if self.handout and self.hooks is not None else None
        if plan is not None:
            if plan.handed_out:
                frames = torch.from_numpy(plan.frames.copy())
                self.handed_out.append(i)
                self.restored_chunks.append(i)
                self.latents.append(None)
                self.frame_hashes.append(hashlib.sha256(tensor_bytes(frames)).digest())
                if self.keep_frames:
                    self.frames.append(frames.float())
                self.next_chunk = i + 1
                return
            if plan.decoder_state is not None:  # stored at a resume point: only the chunks after it replay
                self.decoder.load(plan.decoder_state)
            for j, latent in enumerate(plan.replay):  # the decoder's state, as a cold run leaves it
                self.decode_chunk(latent, first=plan.replay_from + j == 0)
            if plan.recompute:
                self._recompute(len(plan.recompute))
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
        if plan is not None and plan.late_state is not None:  # the decoder's first use since the divergence
            plan.late_state.catch_up(self.decoder, lambda latent, first: self.decode_chunk(latent, first=first))
        frames = self.decode_chunk(x0, first=i == 0)
        self.frame_hashes.append(hashlib.sha256(tensor_bytes(frames)).digest())
        if self.keep_frames:
            self.frames.append(frames.detach().float().cpu())
        if self.handout and i not in self.restored_chunks and self.hooks is not None:
            self.hooks.on_chunk_frames(self, i, frames, decoder=self.decoder)
        self.next_chunk = i + 1

    def _recompute(self, n: int) -> None:
        """Compute chunks 0..n-1 again (the binding lost what it served of them); their frames
        were handed out already and are dropped here."""
        for j in range(n):
            x0 = self._denoise_chunk(j)
            self.hooks.on_chunk_finalized(self, j, x0)
            self.latents[j] = x0
            self.decode_chunk(x0, first=j == 0)
        self.restored_chunks = [j for j in self.restored_chunks if j >= n]

    def _check_latent(self, i: int, latent: Any) -> None:
        shape = tuple(getattr(latent, "shape", ()))
        if shape != self.geometry.latent_shape or getattr(latent, "dtype", None) != self.dtype:
            raise LayoutMismatchError(f"cached latent of chunk {i}: {shape} {getattr(latent, 'dtype', None)}, "
                                      f"runtime needs {self.geometry.latent_shape} {self.dtype}")
        if latent.device.type != self.device.type:
            raise LayoutMismatchError(f"cached latent of chunk {i} is on {latent.device}, runtime on {self.device}")

    def _denoise_chunk(self, i: int) -> torch.Tensor:
        x = self.noise_chunks[i].to(self.dtype)
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

    def _forward(self, x: torch.Tensor, chunk: int, sigma: float, window: dict) -> torch.Tensor:
        """One model pass over chunk `chunk` that writes this session's ring (`SyntheticModel.forward`)."""
        sink_tokens = self.kv_sink_size * self.geometry.frame_tokens
        return self._model.forward(x, chunk, sigma, window, self.self_kv_cache, sink_tokens=sink_tokens)
