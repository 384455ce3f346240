"""A real LingBot-World-fast pipeline with tiny random weights: TeleFuser's own code, no checkpoint.

`build_tiny_pipeline` constructs TeleFuser's ``LingBotWorldFastPipeline`` without ``init()``
(which loads umt5-xxl, the Wan VAE and the 14B DiT from disk) and sets its parts:

- the DiT: TeleFuser's ``LingBotWorldFastDiT`` at any size (default 2 layers, 2 heads, head_dim
  12; `rope_head_dim_problem` says which head_dim its 3-D RoPE takes; LingBot-World 14B is 40 x 40
  x 128, ffn 13824, text_dim 4096), built on its device in bf16 (the default dtype and device set
  around its constructor: no float32 copy on the host), every weight redrawn from ``weight_seed``
  with a generator on that device (its ``init_weights`` zeroes the output head, which would make
  every chunk the same);
- TeleFuser's ``LingBotWorldFastDenoisingStage``, ``LingBotWorldFastTimesteps`` and scheduler;
- for the parts that need weights from disk, stand-ins with the real interfaces and shapes: a
  VAE (8x spatial and 4x temporal compression, z=16; `TinyVAE`), a byte tokenizer and a seeded
  prompt embedding (`TinyTextEncoder`); or, with ``vae="wan"`` and ``text_encoder="umt5"``,
  TeleFuser's own Wan VAE and umT5 encoder with random weights (`wan_parts`; the tokenizer stays).

Everything the binding observes (ring layout and cursors, noise, RNG draws, control tensors,
cached-latent decode, hook order) is TeleFuser's. The VAE stand-in is a pure function of the
latent, so two equal latents decode to equal frames and one changed bit changes them; like the
Wan VAE's convolutions, it refuses a latent whose dtype is not its own. Either VAE is called
through `wan_parts.RecordingVAE`, which keeps the last latent and frames it decoded (the gate
compares them bit for bit).

On TeleFuser main (generation sessions, a streaming scheduler; `is_streaming_telefuser`) the
pipeline is built as its ``init()`` builds it, with these stand-ins where ``init()`` loads
weights or starts processes:

- a module manager (`TinyModules`) that hands the tiny DiT and the VAE stand-in (float32, as
  main's default VAE configs) to TeleFuser's own denoise, VAE-encode and VAE-decode stages;
- `InProcessWorker` in place of ``ParallelWorker``: the stage runs in this process, each call
  outside inference mode and without grad, as in a worker process. (TeleFuser main at 5a12f03
  cannot run a plain one-device denoise stage: ``_create_initialized_session`` allocates the
  ring under ``torch.inference_mode`` and the denoise actor thread, not in inference mode,
  writes it: "Inplace update to inference tensor outside InferenceMode is not allowed".)
- on CPU, `CpuAutocast` around the DiT: main's DiT computes its timestep embedding in float32
  and leaves the rest to CUDA autocast (``denoise_chunk`` enables autocast on CUDA only), so
  with bf16 weights on CPU its first matmul fails. The time embedding, the time projection and
  the affine layer norms (float32 ops under CUDA autocast) keep their bf16-rounded weights in
  float32, what CUDA's autocast computes them with, and the DiT runs under CPU bf16 autocast. On
  CUDA nothing is wrapped.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from cacheseek.integrations.telefuser import wan_parts
from cacheseek.integrations.telefuser.random_weights import redraw

__all__ = ["PARTS", "CpuAutocast", "InProcessWorker", "TinyDiTSpec", "rope_head_dim_problem", "TinyModules",
           "TinyTextEncoder", "TinyTokenizer", "TinyVAE", "build_tiny_pipeline", "is_streaming_telefuser"]

Z_DIM = 16
SPATIAL = 8
TEMPORAL = 4
TEXT_LEN = 512
PARTS = {"vae": ("stand_in", "wan"), "text_encoder": ("stand_in", "umt5")}  # the choices per part


def rope_head_dim_problem(head_dim: int) -> str | None:
    """Why TeleFuser's ``LingBotWorldFastDiT`` cannot run ``head_dim``, or None when it can. Its
    3-D RoPE (0.1.0.post3 and main) splits a head into ``d - 2*(d//3)`` (frames), ``d//3``,
    ``d//3`` (rows, columns) and rotates pairs in each part: ``d`` and ``d//3`` must be even, i.e.
    ``d % 6`` is 0 or 2 (12, 14, 126 and LingBot-World's 128 run; 10 and 16 do not). The DiT
    itself checks only that ``d`` is even, and a ``d//3`` that is odd fails at the first chunk."""
    if head_dim % 2:
        return f"head_dim {head_dim} is odd: RoPE rotates pairs"
    if (head_dim // 3) % 2:
        return (f"head_dim {head_dim} splits into {head_dim - 2 * (head_dim // 3)}, {head_dim // 3}, "
                f"{head_dim // 3} for the 3-D RoPE and {head_dim // 3} is odd (it rotates pairs)")
    return None


class TinyDiTSpec:
    """Sizes of the DiT; ``dim = n_heads * head_dim``, ``ffn_dim`` None = ``2 * dim``."""

    def __init__(self, n_layers: int = 2, n_heads: int = 2, head_dim: int = 12, text_dim: int = 32,
                 weight_seed: int = 0, ffn_dim: int | None = None) -> None:
        problem = rope_head_dim_problem(head_dim)
        if problem:
            raise ValueError(problem)
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.text_dim, self.weight_seed = text_dim, weight_seed
        self.ffn_dim = 2 * self.dim if ffn_dim is None else ffn_dim

    @property
    def dim(self) -> int:
        return self.n_heads * self.head_dim


class TinyTokenizer:
    """TeleFuser's tokenizer call: ``(prompt, return_mask=True, add_special_tokens=True)`` ->
    ids and mask ``[1, 512]``; ids are the prompt's UTF-8 bytes + 2, then an end token (1)."""

    def __call__(self, prompt: str, return_mask: bool = True, add_special_tokens: bool = True) -> Any:
        data = list(prompt.encode("utf-8"))[: TEXT_LEN - 1]
        ids = torch.zeros((1, TEXT_LEN), dtype=torch.long)
        mask = torch.zeros((1, TEXT_LEN), dtype=torch.long)
        n = len(data) + 1
        ids[0, :n] = torch.tensor([b + 2 for b in data] + [1], dtype=torch.long)
        mask[0, :n] = 1
        return (ids, mask) if return_mask else ids


class TinyTextEncoder:
    """``(ids, mask) -> [1, 512, text_dim]``: a seeded embedding table, in the pipeline dtype."""

    def __init__(self, text_dim: int, *, seed: int, device: Any, dtype: Any) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.table = torch.randn((258, text_dim), generator=gen).to(device=device, dtype=dtype)

    def __call__(self, ids: Any, mask: Any) -> Any:
        return self.table[ids.to(self.table.device)]


class TinyVAE:
    """Wan VAE's interface and shapes: ``encode([video [3, F, H, W]]) -> [[16, 1 + (F-1)/4, H/8,
    W/8]]``; ``cached_decode_withflag(latent [1, 16, T, h, w]) -> frames [3, T', 8h, 8w]`` in
    [-1, 1], ``T' = 1 + 4(T-1)`` on the first clip and ``4T`` after (as the streaming decoder)."""

    def __init__(self, *, seed: int, device: Any, dtype: Any) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed + 2)
        self.enc = (torch.randn((Z_DIM, 3), generator=gen) / math.sqrt(3)).to(device)
        self.dec = (torch.randn((3, Z_DIM), generator=gen) / math.sqrt(Z_DIM)).to(device)
        self.dtype = dtype

    def encode(self, videos: list, device: Any = None, tiled: bool = False) -> list:
        return [self._project(torch.cat([v.float()[:, :1], _temporal_mean(v.float()[:, 1:])], dim=1), v.dtype)
                for v in videos]

    def cached_encode_withflag(self, video: Any, device: Any, is_first_clip: bool, is_last_clip: bool,
                               encode_state: Any = None) -> Any:
        """TeleFuser main's chunked encode: ``video [3, F, H, W]`` (``F = 1 + 4(c-1)`` first, ``4c``
        after) -> ``[16, c, H/8, W/8]``."""
        if is_first_clip:
            return self.encode([video])[0]
        return self._project(_temporal_mean(video.float()), video.dtype)

    def _project(self, frames: Any, dtype: Any) -> Any:
        """``[3, lat_f, H, W]`` float32 -> ``[16, lat_f, H/8, W/8]`` in ``dtype``."""
        pooled = F.avg_pool2d(frames.transpose(0, 1), SPATIAL).transpose(0, 1)
        return torch.tanh(torch.einsum("zc,cthw->zthw", self.enc, pooled)).to(dtype)

    def cached_decode_withflag(self, hidden_state: Any, device: Any, is_first_clip: bool,
                               is_last_clip: bool, decode_state: Any = None) -> Any:
        if hidden_state.dtype != self.dtype:
            raise TypeError(f"Input type ({hidden_state.dtype}) and weight type ({self.dtype}) should be the same")
        z = hidden_state[0] if hidden_state.dim() == 5 else hidden_state
        x = torch.tanh(torch.einsum("cz,zthw->cthw", self.dec, z.float()))
        x = x.repeat_interleave(TEMPORAL, dim=1)
        if is_first_clip:
            x = x[:, TEMPORAL - 1 :]
        return x.repeat_interleave(SPATIAL, dim=2).repeat_interleave(SPATIAL, dim=3).to(hidden_state.dtype)


def is_streaming_telefuser() -> bool:
    """Whether the importable TeleFuser is main's streaming layout (generation sessions)."""
    from telefuser.pipelines.lingbot_world_fast import session

    return getattr(session, "LingBotWorldFastRuntimeState", None) is None and hasattr(
        session, "LingBotWorldFastGenerationSession")


def build_tiny_pipeline(*, device: str = "cpu", local_attn_size: int = -1, sink_size: int = 0,
                        height: int = 64, width: int = 64, spec: TinyDiTSpec | None = None,
                        vae: str = "stand_in", text_encoder: str = "stand_in", text_layers: int = 24) -> Any:
    """TeleFuser's ``LingBotWorldFastPipeline`` with random weights (see the module doc), for the
    installed TeleFuser's layout; ``vae`` and ``text_encoder`` choose each part (`PARTS`),
    ``text_layers`` is the umT5 encoder's depth."""
    from telefuser.pipelines.lingbot_world_fast.pipeline import (LingBotWorldFastPipeline,
                                                                 LingBotWorldFastPipelineConfig)

    spec = spec or TinyDiTSpec()
    dtype = torch.bfloat16
    pipeline = LingBotWorldFastPipeline(device=device, torch_dtype=dtype)
    pipeline.config = LingBotWorldFastPipelineConfig(
        control_type="cam", orig_height=height, orig_width=width, max_area=height * width,
        local_attn_size=int(local_attn_size), sink_size=int(sink_size))
    pipeline.text_device = torch.device(device)
    pipeline.vae_device = torch.device(device)
    pipeline.tokenizer = TinyTokenizer()
    if text_encoder == "umt5":
        pipeline.text_encoder = wan_parts.umt5_encoder(text_dim=spec.text_dim, layers=text_layers, device=device,
                                                       dtype=dtype, seed=spec.weight_seed)
    else:
        pipeline.text_encoder = TinyTextEncoder(spec.text_dim, seed=spec.weight_seed, device=device, dtype=dtype)

    def make_vae(vae_dtype: Any) -> Any:
        part = (wan_parts.wan_vae if vae == "wan" else TinyVAE)(seed=spec.weight_seed, device=device, dtype=vae_dtype)
        return wan_parts.RecordingVAE(part)
    dit = _tiny_dit(spec, local_attn_size, sink_size, device, dtype).eval().requires_grad_(False)
    pipeline.dit = dit
    if is_streaming_telefuser():
        _set_streaming_stages(pipeline, torch.device(device), make_vae(torch.float32))
        return pipeline
    from telefuser.pipelines.lingbot_world_fast.denoising import (LingBotWorldFastDenoisingStage,
                                                                  LingBotWorldFastTimesteps)

    pipeline.vae = make_vae(dtype)  # the release casts its VAE to the pipeline's dtype
    pipeline.denoise_stage = LingBotWorldFastDenoisingStage(pipeline.dit, torch_dtype=dtype)
    pipeline.timesteps = LingBotWorldFastTimesteps()
    return pipeline


def _tiny_dit(spec: TinyDiTSpec, local_attn_size: int, sink_size: int, device: Any, dtype: Any) -> Any:
    """TeleFuser's DiT constructed on ``device`` in ``dtype``, then redrawn (`redraw`). Its float64
    RoPE tables are TeleFuser's own, computed on the CPU as ``from_pretrained`` (built on the CPU,
    then moved) has them; its forward moves them to the input's device."""
    from telefuser.models.lingbot_world_fast_dit import LingBotWorldFastDiT

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            dit = LingBotWorldFastDiT(
                patch_size=(1, 2, 2), text_len=TEXT_LEN, in_dim=2 * Z_DIM + 4, dim=spec.dim,
                ffn_dim=spec.ffn_dim, freq_dim=256, text_dim=spec.text_dim, out_dim=Z_DIM,
                num_heads=spec.n_heads, num_layers=spec.n_layers, local_attn_size=int(local_attn_size),
                sink_size=int(sink_size), control_type="cam")
    finally:
        torch.set_default_dtype(default)
    if torch.device(device).type != "cpu":  # its RoPE tables as a checkpoint's DiT has them: from the CPU
        from telefuser.models import lingbot_world_fast_dit as module

        cpu = module.precompute_freqs_cis_3d(spec.head_dim)
        dit.freqs_cos, dit.freqs_sin = (torch.cat([getattr(f, part) for f in cpu], dim=-1) for part in ("real", "imag"))
    redraw(dit, spec.weight_seed, "DiT")
    return dit


def _set_streaming_stages(pipeline: Any, device: Any, vae: Any) -> None:
    """TeleFuser main's stages, as its ``init()`` sets them, on the tiny parts and ``vae``
    (float32, as main's default VAE configs; module doc)."""
    from telefuser.core.config import ModelRuntimeConfig
    from telefuser.pipelines.lingbot_world_fast.denoising import LingBotWorldFastDenoisingStage
    from telefuser.pipelines.lingbot_world_fast.vae_stage import (LingBotWorldFastVAEDecodeStage,
                                                                  LingBotWorldFastVAEEncodeStage)

    cfg = pipeline.config
    pipeline.dit.set_causal_attention_window(cfg.local_attn_size, cfg.sink_size)
    where = {"device_type": device.type, "device_id": device.index or 0}
    cfg.vae_encode_config = ModelRuntimeConfig(torch_dtype=torch.float32, **where)
    cfg.vae_decode_config = ModelRuntimeConfig(torch_dtype=torch.float32, **where)
    cfg.dit_config = ModelRuntimeConfig(torch_dtype=pipeline.torch_dtype, **where)
    pipeline.vae_encode_device = pipeline.vae_decode_device = pipeline.vae_device = device
    pipeline.vae_encode_torch_dtype = torch.float32
    dit = pipeline.dit
    if device.type == "cpu":
        for module in (dit.time_embedding, dit.time_projection,
                       *(m for m in dit.modules() if type(m).__name__ == "LayerNorm")):
            module.float()
        dit = CpuAutocast(dit, pipeline.torch_dtype)
    modules = TinyModules(wan_video_vae=vae, lingbot_world_fast_dit=dit)
    stages = (LingBotWorldFastVAEEncodeStage("lingbot_world_fast_vae_encode", modules, cfg.vae_encode_config),
              LingBotWorldFastVAEDecodeStage("lingbot_world_fast_vae_decode", modules, cfg.vae_decode_config),
              LingBotWorldFastDenoisingStage("lingbot_world_fast_denoise", modules, cfg.dit_config))
    for stage in stages:
        stage.onload_models_flag = True  # the tiny parts are on their device already
    pipeline.vae = vae
    pipeline.vae_encode_worker, pipeline.vae_decode_worker, pipeline.denoise_stage = map(InProcessWorker, stages)


def _temporal_mean(v: Any) -> Any:
    """``[3, 4n, H, W]`` -> ``[3, n, H, W]``: the mean of each group of `TEMPORAL` frames."""
    return v.reshape(3, v.shape[1] // TEMPORAL, TEMPORAL, *v.shape[2:]).mean(dim=2)


class TinyModules:
    """TeleFuser's ``ModuleManager.fetch_module`` over the tiny parts."""

    def __init__(self, **modules: Any) -> None:
        self.modules = modules

    def fetch_module(self, name: str, require_model_path: bool = False) -> Any:
        module = self.modules.get(name)
        return (module, f"/tiny/{name}") if require_model_path else module


class InProcessWorker:
    """``ParallelWorker``'s calling convention (``sync=``; a value or a callable that returns it)
    for a stage in this process; each call runs outside inference mode and without grad, as in a
    worker process. Attributes that are not methods are the stage's own."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.stage, name)
        if not callable(attr):
            return attr

        def call(*args: Any, sync: bool = False, **kwargs: Any) -> Any:
            with torch.inference_mode(False), torch.no_grad():
                return attr(*args, **kwargs)

        return call


class CpuAutocast:
    """Calls a module under CPU autocast to ``dtype``; every other attribute is the module's."""

    def __init__(self, module: Any, dtype: Any) -> None:
        self.__dict__["module"] = module
        self.__dict__["autocast_dtype"] = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=self.__dict__["autocast_dtype"]):
            return self.__dict__["module"](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["module"], name)
