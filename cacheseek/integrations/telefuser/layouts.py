"""Which TeleFuser is installed, told from what its LingBot-World-fast session types expose.

The binding reads and writes fields of TeleFuser's runtime state; which fields exist depends on
the release:

- ``hooked`` (TeleFuser main from 2026-07-06, the commit that added ``world_kv``, to 2026-07-13):
  the session config has ``world_kv_binding``; the runtime state has ``kv_local_attn_size``,
  ``kv_sink_size``, ``world_kv_binding`` and ``world_kv_cached_latents``; the pipeline calls the
  binding's hooks itself.
- ``released`` (PyPI ``telefuser==0.1.0.post3``): the same pipeline and DiT without the hook
  calls and those four fields; `cacheseek.integrations.telefuser.pypi_release` installs the same
  behaviour around the pipeline.
- ``main`` (TeleFuser main from 2026-07-13, 1ef8b53, to at least 5a12f03 of 2026-07-24): no
  runtime state class; a ``LingBotWorldFastGenerationSession`` with a ``cache_handle`` into the
  denoise stage, which holds the ring (0-d tensor cursors), timesteps and RNGs; chunks flow
  through a streaming scheduler (``generate_video``); the pipeline calls the hooks itself.

The first two keep the ring as ``runtime.self_kv_cache`` (per layer ``k``/``v``
``[1, kv_size, H, D]`` and integer cursors), ``noise_chunks``, ``control_chunks``, ``generator``
and ``timesteps``: the ``bshd`` layout adapter. ``main`` needs the ``telefuser_main`` adapter
(`TeleFuserLayout.layout_name`). Any other shape is refused with `UnsupportedTeleFuserError`
naming what is missing, never half-driven.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any

from cacheseek.errors import CacheSeekError
from cacheseek.layout.auto import layout_name_of_release
from cacheseek.registry import LAYOUTS

__all__ = ["TeleFuserLayout", "UnsupportedTeleFuserError", "detect_layout", "RING_FIELDS", "HOOK_FIELDS",
           "SESSION_FIELDS"]

RING_FIELDS = ("self_kv_cache", "noise_chunks", "control_chunks", "generator", "timesteps",
               "chunk_size", "frame_tokens", "current_chunk_index")
HOOK_FIELDS = ("kv_local_attn_size", "kv_sink_size", "world_kv_binding", "world_kv_cached_latents")
SESSION_FIELDS = ("cache_handle", "chunk_size", "frame_tokens", "latent_f", "current_chunk_index", "config",
                  "world_kv_binding", "world_kv_cached_latents")
_PIPELINE_PARTS = ("create_runtime", "generate_next_chunk", "denoise_stage", "dit", "config")
_MAIN_PIPELINE_PARTS = ("_create_initialized_session", "generate_video", "denoise_stage", "vae_decode_worker",
                        "dit", "config")
_MAIN_STAGE_PARTS = ("initialize_cache", "denoise_and_update_cache", "advance_noise", "release_cache")


class UnsupportedTeleFuserError(CacheSeekError):
    """The installed TeleFuser's LingBot-World-fast has a layout this binding does not know."""


class TeleFuserLayout(str, enum.Enum):
    HOOKED = "hooked"
    RELEASED = "released"
    MAIN = "main"

    @property
    def layout_name(self) -> str:
        """The layout adapter (``cacheseek.registry.LAYOUTS``) for sessions of this TeleFuser: the
        one whose ``telefuser_releases`` lists it."""
        return layout_name_of_release(self.value)

    def adapter(self) -> Any:
        """A new layout adapter for this TeleFuser's sessions (``layout=`` of the binding)."""
        return LAYOUTS.get(self.layout_name)()


def detect_layout(pipeline: Any) -> TeleFuserLayout:
    """The layout of ``pipeline`` (a ``LingBotWorldFastPipeline`` whose parts are set, i.e. after
    ``init()``). Raises `UnsupportedTeleFuserError` with what is missing and what is supported."""
    session = _session_module(pipeline)
    if getattr(session, "LingBotWorldFastRuntimeState", None) is None and hasattr(
            session, "LingBotWorldFastGenerationSession"):
        return _detect_main(pipeline, session)
    missing_parts = [p for p in _PIPELINE_PARTS if not hasattr(pipeline, p)]
    if missing_parts:
        raise UnsupportedTeleFuserError(
            f"{type(pipeline).__name__} lacks {', '.join(missing_parts)}: attach CacheSeek to a "
            "LingBotWorldFastPipeline after init() (or after its dit, denoise_stage and config are set)")
    runtime_fields = _fields(session, "LingBotWorldFastRuntimeState")
    config_fields = _fields(session, "LingBotWorldFastSessionConfig")
    lacking = [f for f in RING_FIELDS if f not in runtime_fields]
    if lacking:
        raise UnsupportedTeleFuserError(
            f"this TeleFuser's LingBotWorldFastRuntimeState has no {', '.join(lacking)} (its KV is "
            "not a per-layer self_kv_cache ring): supported are telefuser 0.1.0.post3 from PyPI, "
            "TeleFuser main with the world_kv hooks (2026-07-06 to 2026-07-13) and TeleFuser main's "
            "generation sessions with cache handles (from 2026-07-13)")
    hooks = [f for f in HOOK_FIELDS if f in runtime_fields]
    native = "world_kv_binding" in config_fields
    if native and len(hooks) == len(HOOK_FIELDS):
        return TeleFuserLayout.HOOKED
    if not native and not hooks:
        return TeleFuserLayout.RELEASED
    raise UnsupportedTeleFuserError(
        f"this TeleFuser has only part of the world_kv hooks (runtime fields {hooks}, session "
        f"world_kv_binding {'present' if native else 'absent'}): neither the 0.1.0.post3 release "
        "nor the hooked main layout")


def _detect_main(pipeline: Any, session: Any) -> TeleFuserLayout:
    missing = [p for p in _MAIN_PIPELINE_PARTS if not hasattr(pipeline, p)]
    if missing:
        raise UnsupportedTeleFuserError(
            f"{type(pipeline).__name__} lacks {', '.join(missing)}: attach CacheSeek to TeleFuser main's "
            "LingBotWorldFastPipeline after init() (or after its dit, denoise_stage, VAE workers and "
            "config are set)")
    stage = pipeline.denoise_stage
    lacking = [f for f in SESSION_FIELDS if f not in _fields(session, "LingBotWorldFastGenerationSession")]
    lacking += [f"LingBotWorldFastSessionConfig.{f}" for f in ("world_kv_binding",)
                if f not in _fields(session, "LingBotWorldFastSessionConfig")]
    lacking += [f"denoise_stage.{m}" for m in _MAIN_STAGE_PARTS if not hasattr(type(stage), m)
                and not hasattr(stage, m)]
    if lacking:
        raise UnsupportedTeleFuserError(
            f"this TeleFuser's generation session layout lacks {', '.join(lacking)}: supported is "
            "TeleFuser main from 1ef8b53 (2026-07-13) to 5a12f03 (2026-07-24)")
    return TeleFuserLayout.MAIN


def _session_module(pipeline: Any) -> Any:
    package = type(pipeline).__module__.rsplit(".", 1)[0]
    name = f"{package}.session"
    module = sys.modules.get(name)
    if module is None:
        import importlib

        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise UnsupportedTeleFuserError(
                f"cannot import {name} next to {type(pipeline).__module__}: is this TeleFuser's "
                f"LingBotWorldFastPipeline? ({exc})") from None
    return module


def _fields(module: Any, cls_name: str) -> set[str]:
    cls = getattr(module, cls_name, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise UnsupportedTeleFuserError(f"{module.__name__} has no dataclass {cls_name}")
    return {f.name for f in dataclasses.fields(cls)}
