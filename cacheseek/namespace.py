"""Namespace fingerprint fields: everything that changes the bits of a chunk's KV.

The namespace root is ``H(image_fp, prompt_fp, config_blob_hash)`` and the config blob covers
one entry per registered field below. A change of any of them is a cold miss. A field is a small
class with a ``name`` and ``value(ctx)``; a new runtime knob that changes the bits is one new
class here. `default_fields()` is the set the binding uses unless told otherwise. A field reads
the runtime through its layout adapter (``ctx.layout``), which knows where each part lives.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from cacheseek.errors import ConfigError
from cacheseek.registry import Registry

__all__ = ["FINGERPRINT_FIELDS", "FingerprintContext", "default_fields", "resolve_fields", "config_blob"]

FINGERPRINT_FIELDS: Registry[type] = Registry("fingerprint")  # the fields below


@attrs.frozen
class FingerprintContext:
    session: Any
    runtime: Any
    layout: Any
    store: Any = None


def _field(name: str):
    def deco(fn):
        cls = type(f"{name.title().replace('_', '')}Field", (), {
            "name": name, "value": staticmethod(fn), "__doc__": fn.__doc__,
            "__module__": __name__,
        })
        FINGERPRINT_FIELDS.register(name)(cls)
        return cls
    return deco


def _session(ctx: FingerprintContext, attr: str) -> Any:
    s = ctx.session
    return s.get(attr) if isinstance(s, dict) else getattr(s, attr, None)


@_field("seed")
def _seed(ctx):
    """The session seed (initial noise and every RNG draw)."""
    return _session(ctx, "seed")


@_field("frame_num")
def _frame_num(ctx):
    return _session(ctx, "frame_num")


@_field("chunk_size")
def _chunk_size(ctx):
    return ctx.layout.window(ctx.runtime).chunk_size


@_field("sampler")
def _sampler(ctx):
    """Sampler settings: shift and the timestep schedule."""
    ts = ctx.layout.timesteps(ctx.runtime)
    steps = [float(t) for t in ts] if ts is not None else None
    return {"sample_shift": _session(ctx, "sample_shift"), "timesteps": steps}


@_field("control_mode")
def _control_mode(ctx):
    return _session(ctx, "control_mode")


@_field("sequence_limits")
def _limits(ctx):
    return {"max_attention_size": _session(ctx, "max_attention_size"),
            "max_sequence_length": _session(ctx, "max_sequence_length")}


@_field("attention_window")
def _window(ctx):
    """(L, S): the rolling window and sink, in frames (-1, 0 = full length)."""
    ring = ctx.layout.window(ctx.runtime)
    return [ring.local_attn_size, ring.sink_size]


@_field("resolution")
def _resolution(ctx):
    img = _session(ctx, "image")
    lat = list(ctx.layout.latent_spec(ctx.runtime).shape[-2:])
    return {"image_size": list(img.size) if img is not None else None, "latent_hw": lat}


@_field("dtype")
def _dtype(ctx):
    return str(ctx.layout.layers(ctx.runtime)[0][0].dtype)


@_field("storage_layout")
def _layout(ctx):
    """storage_format, n_layers, kv_shape, kv_dtype, latent_shape, latent_dtype, chunk_size, frame_tokens."""
    return ctx.layout.fingerprint_fields(ctx.runtime)


def default_fields() -> list[str]:
    return FINGERPRINT_FIELDS.names()


def resolve_fields(names: list[str] | None) -> list[Any]:
    names = default_fields() if names is None else list(names)
    out = []
    for n in names:
        if n not in FINGERPRINT_FIELDS:
            raise ConfigError("namespace.fields", f"unknown fingerprint field {n!r}",
                              f"use names from: {', '.join(default_fields())}")
        out.append(FINGERPRINT_FIELDS.get(n))
    return out


def config_blob(fields: list[Any], ctx: FingerprintContext) -> dict[str, Any]:
    return {f.name: f.value(ctx) for f in fields}


@_field("device")
def _device(ctx):
    """Device type: kernels differ in their low bits between CPU and CUDA."""
    return _ring_device(ctx).type


@_field("store_format")
def _store_format(ctx):
    """How the store encodes values: raw Plan bytes and a generic tier's tensors under the same
    key names must never read each other's values (one shared Fluxon service can hold both)."""
    return None if ctx.store is None else ctx.store.storage_format


@_field("codec")
def _codec(ctx):
    """How the store encodes K and V (name and format version, `cacheseek.codecs`): chunks of
    different codecs never mix, and a lossy codec's KV is never served as another's."""
    return None if ctx.store is None else ctx.store.codec_id  # a generic or tiered store's; Plan and HBM: raw bytes


# -- compute identity ---------------------------------------------------------------------------
# Workers that share one cache (a Fluxon service) may run different GPUs or builds. The same
# weights and inputs give KV whose low bits differ when the kernels differ: another GPU
# architecture or SM count (cuBLAS picks other tilings), another torch, CUDA or cuDNN, another CPU
# instruction set. Each is its own field so that a deployment that has proved two of them
# bit-identical can drop that field from ``namespace.fields``.


def _ring_device(ctx) -> Any:
    return ctx.layout.layers(ctx.runtime)[0][0].device


@_field("gpu_arch")
def _gpu_arch(ctx):
    """The GPU that computes the KV: name, compute capability and SM count (None on CPU)."""
    device = _ring_device(ctx)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"sm_{props.major}{props.minor}",
            "sm_count": props.multi_processor_count}


@_field("cpu_isa")
def _cpu_isa(ctx):
    """The instruction set torch's CPU kernels dispatch to (AVX2, AVX512, ...) on a CPU runtime."""
    if _ring_device(ctx).type != "cpu":
        return None
    return torch.backends.cpu.get_cpu_capability()


@_field("torch_version")
def _torch_version(ctx):
    return torch.__version__


@_field("cuda_version")
def _cuda_version(ctx):
    """torch's CUDA and cuDNN versions (None on a CPU build): the kernels' libraries."""
    if torch.version.cuda is None:
        return None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "cudnn": cudnn}
