"""A test double of TeleFuser main's LingBot-World-fast layout (1ef8b53 .. 5a12f03), written from
reading it: the names, shapes, dtypes and order the binding and its layout adapter can observe,
with a small seeded model in place of the DiT and the VAE. It imports no TeleFuser.

What it reproduces:

- module layout ``<pkg>.pipeline.LingBotWorldFastPipeline`` next to ``<pkg>.session`` holding
  ``LingBotWorldFastSessionConfig`` (with ``world_kv_binding``) and
  ``LingBotWorldFastGenerationSession`` (no runtime-state class), which `detect_layout` reads;
- the session: ``config``, ``latent_h/w/f``, ``frame_tokens = h*w/4`` (2x2 patches),
  ``chunk_size``, ``kv_cache_capacity_tokens``, ``cache_handle`` (a per-pipeline counter from 0),
  ``current_chunk_index``, ``world_kv_binding``, ``world_kv_cached_latents``, ``chunk_count``;
- the denoise stage's ``_cache_registry[handle]``: ``self_kv_cache`` (per layer ``k``/``v``
  ``[1, kv_size, H, D]`` bf16, cursors as 0-d int64 tensors filled in place), ``timesteps``,
  ``generator`` and ``noise_generator`` seeded as main seeds them, ``noise_shape
  (1, 16, c, h, w)``; ``initialize_cache``, ``denoise_and_update_cache`` (noise drawn per chunk in
  float32, 4 steps, a float32 x0, re-noise draws of x0's shape and dtype, then the clean
  rewrite), ``advance_noise``, ``release_cache``;
- the ring write of main's ``CausalSelfAttention`` (roll with a pinned sink, ``local_end``
  arithmetic, cursors filled after each forward);
- ``_create_initialized_session`` under inference mode, calling ``on_runtime_created`` and
  falling back to a cold run on an exception; ``generate_video(session_config, controls)``
  running every chunk in one other thread (the denoise actor): a cached chunk pops its latent,
  advances the noise RNG, is cast to the pipeline's bf16 and reported to ``on_chunk_finalized``;
  a computed chunk is denoised and reported; then the decode worker gets the latent;
- ``_get_streaming_runtime()``: one streaming runtime per pipeline whose ``create_session`` /
  ``submit_chunk`` / ``try_submit_chunk(session, i, control)`` / ``poll_frames`` are how main's
  service streams a live session (its controls unknown when the session is created); a
  submitted chunk runs at once in the actor thread;
- a VAE decode worker that, like an fp32 Wan VAE, refuses a latent of another dtype.

The model's K/V and x0 depend on the whole attended ring bit for bit (an exact int64 checksum of
the ring's bytes enters every layer), so one wrong byte in a restored ring changes later chunks.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import types
from typing import Any

import torch

PKG = "cacheseek_tests.fake_telefuser_main.pipelines.lingbot_world_fast"
Z = 16
N_LAYERS, N_HEADS, HEAD_DIM = 2, 2, 8
TIMESTEP_INDICES = (0, 179, 358, 679)
CONTROL_CHANNELS = 6 * 8 * 8  # main: 6 camera channels per pixel x (H/h) x (W/w)


# -- session types (module <PKG>.session) -------------------------------------------------------


@dataclasses.dataclass
class LingBotWorldFastSessionConfig:
    prompt: str
    image: Any
    control_mode: str = "cam"
    fps: int = 16
    chunk_size: int = 3
    frame_num: int = 81
    frame_policy: str = "truncate"
    sample_shift: float = 10.0
    seed: int = 42
    max_attention_size: int | None = None
    max_sequence_length: int = 512
    world_kv_binding: object | None = None
    intrinsics: object | None = None


@dataclasses.dataclass
class LingBotWorldFastGenerationSession:
    config: LingBotWorldFastSessionConfig
    prompt_emb: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    latent_h: int = 0
    latent_w: int = 0
    latent_f: int = 0
    height: int = 0
    width: int = 0
    frame_tokens: int = 0
    chunk_size: int = 0
    max_attention_size: int = 0
    kv_cache_capacity_tokens: int = 0
    cache_handle: int | None = None
    current_chunk_index: int = 0
    emitted_frames: int = 0
    world_kv_binding: object | None = None
    world_kv_cached_latents: dict = dataclasses.field(default_factory=dict)

    @property
    def chunk_count(self) -> int:
        return self.latent_f // self.chunk_size


@dataclasses.dataclass
class PipelineConfig:
    local_attn_size: int = -1
    sink_size: int = 0


@dataclasses.dataclass
class _CacheState:
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    self_kv_cache: list
    generator: torch.Generator
    noise_generator: torch.Generator
    noise_shape: tuple


# -- the model ----------------------------------------------------------------------------------


class TinyCausalModel:
    """Stands in for main's DiT: bf16 K/V written into the ring as main's attention writes it,
    float32 output."""

    def __init__(self, *, local_attn_size: int, sink_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.local_attn_size, self.sink_size = local_attn_size, sink_size
        self.num_layers, self.num_heads, self.dim = N_LAYERS, N_HEADS, N_HEADS * HEAD_DIM
        self.patch_size = (1, 2, 2)
        feat = 4 * (2 * Z + 4)
        self.w_in = torch.randn(feat, self.dim, generator=g) / math.sqrt(feat)
        self.w_ctrl = torch.randn(CONTROL_CHANNELS, self.dim, generator=g) / math.sqrt(CONTROL_CHANNELS)
        self.w_k = [torch.randn(self.dim, self.dim, generator=g) / math.sqrt(self.dim) for _ in range(N_LAYERS)]
        self.w_v = [torch.randn(self.dim, self.dim, generator=g) / math.sqrt(self.dim) for _ in range(N_LAYERS)]
        self.w_o = [torch.randn(self.dim, self.dim, generator=g) / math.sqrt(self.dim) for _ in range(N_LAYERS)]
        self.w_out = torch.randn(self.dim, 4 * Z, generator=g) / math.sqrt(self.dim)

    def __call__(self, *, x, timestep, y, control_tensor, kv_cache, current_start, max_attention_size):
        b, _, f, h, w = x.shape
        inp = torch.cat([x.float(), y.float()], dim=1)  # [1, 36, f, h, w]
        tokens = inp.reshape(1, 2 * Z + 4, f, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
        tokens = tokens.reshape(f * (h // 2) * (w // 2), -1)  # [T, feat]
        frame_tokens = (h // 2) * (w // 2)
        ctrl = control_tensor.float().mean(dim=(3, 4))[0].transpose(0, 1)  # [f, C]
        ctrl = ctrl.repeat_interleave(frame_tokens, dim=0)
        pos = torch.arange(current_start, current_start + tokens.shape[0], dtype=torch.float32)[:, None]
        hid = torch.tanh(tokens @ self.w_in + ctrl @ self.w_ctrl + 0.01 * timestep.float()
                         + torch.sin(pos * 0.37 + torch.arange(self.dim) * 0.11))
        for layer in range(self.num_layers):
            cache = kv_cache[layer]
            k = torch.tanh(hid @ self.w_k[layer]).reshape(1, -1, self.num_heads, HEAD_DIM).to(cache["k"].dtype)
            v = torch.tanh(hid @ self.w_v[layer]).reshape(1, -1, self.num_heads, HEAD_DIM).to(cache["v"].dtype)
            local_end = self._write(cache, k, v, current_start, frame_tokens)
            start = max(0, local_end - max_attention_size)
            ks, vs = cache["k"][0, start:local_end].float(), cache["v"][0, start:local_end].float()
            q = hid.reshape(-1, self.num_heads, HEAD_DIM)
            att = torch.softmax(torch.einsum("thd,shd->hts", q, ks) / math.sqrt(HEAD_DIM), dim=-1)
            o = torch.einsum("hts,shd->thd", att, vs).reshape(-1, self.dim)
            hid = torch.tanh(hid + o @ self.w_o[layer] + _ring_phase(cache, local_end))
        out = (hid @ self.w_out).reshape(f, h // 2, w // 2, Z, 2, 2).permute(3, 0, 1, 4, 2, 5)
        return out.reshape(1, Z, f, h, w).float()

    def _write(self, cache, k, v, current_start, frame_tokens) -> int:
        """Main's CausalSelfAttention ring write, cursors filled in place."""
        n = k.shape[1]
        current_end = current_start + n
        sink_tokens = self.sink_size * frame_tokens
        size = cache["k"].shape[1]
        global_end, local_end = int(cache["global_end_index"]), int(cache["local_end_index"])
        if self.local_attn_size != -1 and current_end > global_end and n + local_end > size:
            evicted = n + local_end - size
            rolled = local_end - evicted - sink_tokens
            for name in ("k", "v"):
                buf = cache[name]
                buf[:, sink_tokens:sink_tokens + rolled] = buf[:, sink_tokens + evicted:sink_tokens + evicted + rolled].clone()
            local_end = local_end + current_end - global_end - evicted
        else:
            local_end = local_end + current_end - global_end
        cache["k"][:, local_end - n:local_end] = k
        cache["v"][:, local_end - n:local_end] = v
        cache["global_end_index"].fill_(current_end)
        cache["local_end_index"].fill_(local_end)
        return local_end


def _ring_phase(cache, end) -> torch.Tensor:
    """sin of an exact int64 checksum of the ring's bytes ``[:end]``, position-weighted."""
    total = 0
    for name in ("k", "v"):
        words = cache[name][:, :end].contiguous().view(torch.int16).reshape(-1).long()
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64)
        total += int(((words + 40000) * weights).sum())
    return torch.full((N_HEADS * HEAD_DIM,), math.sin(total % 1000003 * 0.001), dtype=torch.float32)


# -- stages -------------------------------------------------------------------------------------


class LingBotWorldFastDenoisingStage:
    def __init__(self, dit: TinyCausalModel, torch_dtype=torch.bfloat16) -> None:
        self.dit, self.torch_dtype, self.device = dit, torch_dtype, torch.device("cpu")
        self._cache_registry: dict[int, _CacheState] = {}
        self.noise_draws: dict[int, int] = {}

    def initialize_cache(self, cache_handle, batch_size, kv_size, max_sequence_length, sample_shift,
                         generator_state, noise_generator_state, noise_shape, timestep_indices=TIMESTEP_INDICES):
        if cache_handle in self._cache_registry:
            raise ValueError(f"Cache handle {cache_handle} is already registered")
        shape = (batch_size, kv_size, self.dit.num_heads, self.dit.dim // self.dit.num_heads)
        with torch.inference_mode(False):  # as in a worker (TeleFuser main's one-device stage cannot run)
            ring = [{"k": torch.zeros(shape, dtype=self.torch_dtype), "v": torch.zeros(shape, dtype=self.torch_dtype),
                     "global_end_index": torch.zeros((), dtype=torch.int64),
                     "local_end_index": torch.zeros((), dtype=torch.int64)} for _ in range(self.dit.num_layers)]
        generator, noise_generator = torch.Generator(), torch.Generator()
        generator.set_state(torch.tensor(generator_state, dtype=torch.uint8))
        noise_generator.set_state(torch.tensor(noise_generator_state, dtype=torch.uint8))
        t = torch.tensor([1000.0 - i for i in timestep_indices])
        sigmas = t / 1000.0
        self._cache_registry[cache_handle] = _CacheState(t, sigmas, ring, generator, noise_generator,
                                                         tuple(noise_shape))
        return True

    def denoise_and_update_cache(self, cache_handle, condition_chunk, prompt_emb, control_chunk, current_start,
                                 max_attention_size):
        state = self._cache_registry[cache_handle]
        x = self._next_noise(cache_handle)
        kw = dict(y=condition_chunk, control_tensor=control_chunk, kv_cache=state.self_kv_cache,
                  current_start=current_start, max_attention_size=max_attention_size)
        for i, t in enumerate(state.timesteps):
            pred = self.dit(x=x.to(self.torch_dtype), timestep=t, **kw)
            x0 = (x.double() - state.sigmas[i].double() * pred.double()).to(pred.dtype)
            if i < len(state.timesteps) - 1:
                noise = torch.randn(x0.shape, generator=state.generator, dtype=x0.dtype)
                s = state.sigmas[i + 1]
                x = (1 - s) * x0 + s * noise
            else:
                x = x0
        self.dit(x=x.to(self.torch_dtype), timestep=torch.zeros(()), **kw)  # the clean rewrite
        return x

    def advance_noise(self, cache_handle):
        self._next_noise(cache_handle)
        return True

    def _next_noise(self, cache_handle):
        state = self._cache_registry[cache_handle]
        self.noise_draws[cache_handle] = self.noise_draws.get(cache_handle, 0) + 1
        return torch.randn(state.noise_shape, generator=state.noise_generator, dtype=torch.float32)

    def release_cache(self, cache_handle):
        return self._cache_registry.pop(cache_handle, None) is not None


class VAEDecodeWorker:
    """``decode_chunk`` of an fp32 VAE behind a ParallelWorker-like call (``sync=``)."""

    def __init__(self) -> None:
        self.decoded: dict[int, list] = {}

    def initialize_cache(self, cache_handle, sync=False):
        self.decoded[cache_handle] = []
        return True

    def decode_chunk(self, cache_handle, latents, is_first_clip, is_last_clip):
        if latents.dtype != torch.float32:
            raise RuntimeError(f"Input type ({latents.dtype}) and bias type (float) should be the same")
        frames = torch.tanh(latents[0] * 1.7 + 0.1)
        self.decoded[cache_handle].append((latents.detach().clone(), frames))
        return lambda: frames

    def release_cache(self, cache_handle, sync=False):
        return True


# -- the pipeline -------------------------------------------------------------------------------


class LingBotWorldFastPipeline:
    def __init__(self, *, local_attn_size: int = -1, sink_size: int = 0, height: int = 32, width: int = 32) -> None:
        self.device, self.torch_dtype = "cpu", torch.bfloat16
        self.config = PipelineConfig(local_attn_size, sink_size)
        self.height, self.width = height, width
        self.dit = TinyCausalModel(local_attn_size=local_attn_size, sink_size=sink_size)
        self.denoise_stage = LingBotWorldFastDenoisingStage(self.dit)
        self.vae_decode_worker = VAEDecodeWorker()
        self._next_cache_handle = 0
        self._streaming_runtime = None
        self.hook_threads: list[str] = []

    @torch.inference_mode()
    def _create_initialized_session(self, session_config, progress_callback=None):
        c = session_config.chunk_size
        lat_f = (session_config.frame_num - 1) // 4 + 1
        lat_f -= lat_f % c
        lat_h, lat_w = self.height // 8, self.width // 8
        frame_tokens = lat_h * lat_w // 4
        L = self.config.local_attn_size
        kv_size = frame_tokens * (L if L > -1 else lat_f)
        noise_generator = torch.Generator().manual_seed(int(session_config.seed))
        generator = torch.Generator().manual_seed((int(session_config.seed) ^ 0x51A7E5EED) & 0x7FFF_FFFF_FFFF_FFFF)
        handle, self._next_cache_handle = self._next_cache_handle, self._next_cache_handle + 1
        session = LingBotWorldFastGenerationSession(
            config=session_config, prompt_emb=torch.zeros(1), latent_h=lat_h, latent_w=lat_w, latent_f=lat_f,
            height=self.height, width=self.width, frame_tokens=frame_tokens, chunk_size=c,
            max_attention_size=kv_size if session_config.max_attention_size is None else session_config.max_attention_size,
            kv_cache_capacity_tokens=kv_size, cache_handle=handle)
        self.vae_decode_worker.initialize_cache(cache_handle=handle, sync=True)
        self.denoise_stage.initialize_cache(
            cache_handle=handle, batch_size=1, kv_size=kv_size, max_sequence_length=session_config.max_sequence_length,
            sample_shift=session_config.sample_shift, generator_state=generator.get_state().tolist(),
            noise_generator_state=noise_generator.get_state().tolist(), noise_shape=(1, Z, c, lat_h, lat_w))
        if session_config.world_kv_binding is not None:
            session.world_kv_binding = session_config.world_kv_binding
            try:
                session.world_kv_binding.on_runtime_created(session, session_config)
            except Exception:
                session.world_kv_cached_latents = {}
        return session

    def condition(self, session, index: int) -> torch.Tensor:
        """The encode stage's condition chunk ``[1, 4 + 16, c, h, w]`` (mask + image latent)."""
        g = torch.Generator().manual_seed(1000 + index)
        y = torch.randn((1, 4 + Z, session.chunk_size, session.latent_h, session.latent_w), generator=g)
        return y.to(self.torch_dtype)

    def denoise(self, session, index: int, control: torch.Tensor) -> torch.Tensor:
        """Main's denoise actor for one chunk (``_denoise``)."""
        cached = session.world_kv_cached_latents.pop(index, None) if session.world_kv_cached_latents else None
        if cached is not None:
            self.denoise_stage.advance_noise(cache_handle=session.cache_handle)
            latent = cached.to(device=self.device, dtype=self.torch_dtype)
        else:
            latent = self.denoise_stage.denoise_and_update_cache(
                cache_handle=session.cache_handle, condition_chunk=self.condition(session, index),
                prompt_emb=session.prompt_emb, control_chunk=control,
                current_start=index * session.chunk_size * session.frame_tokens,
                max_attention_size=session.max_attention_size)
        if session.world_kv_binding is not None:
            self.hook_threads.append(threading.current_thread().name)
            try:
                session.world_kv_binding.on_chunk_finalized(session, index, latent)
            except Exception:
                pass
        return latent

    def run_chunk(self, session, index: int, control) -> torch.Tensor:
        """Denoise then decode chunk ``index`` in the actor thread; the decoded frames."""
        out: dict = {}

        def actor() -> None:
            try:
                latent = self.denoise(session, index, control)
                out["frames"] = self.vae_decode_worker.decode_chunk(
                    cache_handle=session.cache_handle, latents=latent, is_first_clip=index == 0,
                    is_last_clip=index == session.chunk_count - 1)()
            except BaseException as exc:  # surfaced to the caller like the scheduler's error
                out["error"] = exc

        thread = threading.Thread(target=actor, name=f"lingbot-denoise-actor-{index}")
        thread.start()
        thread.join()
        if "error" in out:
            raise RuntimeError("LingBot streaming scheduler failed") from out["error"]
        session.current_chunk_index = index + 1
        return out["frames"]

    def _get_streaming_runtime(self) -> "StreamingRuntime":
        if self._streaming_runtime is None:
            self._streaming_runtime = StreamingRuntime(self)
        return self._streaming_runtime

    @torch.inference_mode()
    def generate_video(self, session_config, controls, progress_callback=None, timeout=300.0):
        session = self._create_initialized_session(session_config, progress_callback)
        controls = [c() if callable(c) else c for c in controls]
        frames = [self.run_chunk(session, i, controls[i]) for i in range(session.chunk_count)]
        self.last_session = session
        return frames


@dataclasses.dataclass
class StreamingSession:
    session_id: str
    cache_handle: int


class StreamingRuntime:
    """Main's streaming runtime as its service drives it: a control per submitted chunk."""

    def __init__(self, pipeline: LingBotWorldFastPipeline) -> None:
        self.pipeline = pipeline
        self._runtimes: dict[int, Any] = {}
        self._frames: dict[int, list] = {}

    def create_session(self, runtime, progress_callback=None) -> StreamingSession:
        self._runtimes[runtime.cache_handle] = runtime
        self._frames[runtime.cache_handle] = []
        return StreamingSession(f"lingbot-{runtime.cache_handle}", runtime.cache_handle)

    def submit_chunk(self, session: StreamingSession, chunk_index: int, control) -> None:
        if not self.try_submit_chunk(session, chunk_index, control):
            raise RuntimeError("LingBot streaming ingress is full")

    def try_submit_chunk(self, session: StreamingSession, chunk_index: int, control) -> bool:
        runtime = self._runtimes[session.cache_handle]
        frames = self.pipeline.run_chunk(runtime, chunk_index, control)
        self._frames[session.cache_handle].append((chunk_index, frames))
        return True

    def poll_frames(self, session: StreamingSession) -> list:
        out, self._frames[session.cache_handle] = self._frames[session.cache_handle], []
        return out


def controls_for(actions, *, chunk_size: int = 3, height: int = 32, width: int = 32) -> list[torch.Tensor]:
    """One control ``[1, 384, c, h/8, w/8]`` float32 per chunk from its action vector."""
    out = []
    for a in actions:
        base = torch.tensor(list(a) + [0.0] * (4 - len(a)), dtype=torch.float32)
        grid = torch.linspace(-1, 1, CONTROL_CHANNELS)[:, None, None, None]
        out.append((torch.sin(grid * (1 + base.sum()) + base[0]) * torch.ones(
            (CONTROL_CHANNELS, chunk_size, height // 8, width // 8))).unsqueeze(0).contiguous())
    return out


def session_config(n_chunks: int, *, chunk_size: int = 3, seed: int = 42, binding=None) -> LingBotWorldFastSessionConfig:
    return LingBotWorldFastSessionConfig(prompt="a red car", image=None, chunk_size=chunk_size,
                                         frame_num=4 * (n_chunks * chunk_size - 1) + 1, seed=seed,
                                         world_kv_binding=binding)


def _install_modules() -> None:
    """Put the classes where TeleFuser main keeps them, for `detect_layout`."""
    parts = PKG.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    session_mod = types.ModuleType(f"{PKG}.session")
    pipeline_mod = types.ModuleType(f"{PKG}.pipeline")
    for cls in (LingBotWorldFastSessionConfig, LingBotWorldFastGenerationSession):
        cls.__module__ = session_mod.__name__
        setattr(session_mod, cls.__name__, cls)
    LingBotWorldFastPipeline.__module__ = pipeline_mod.__name__
    pipeline_mod.LingBotWorldFastPipeline = LingBotWorldFastPipeline
    sys.modules[session_mod.__name__] = session_mod
    sys.modules[pipeline_mod.__name__] = pipeline_mod


_install_modules()
