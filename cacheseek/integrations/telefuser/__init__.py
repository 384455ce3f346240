"""CacheSeek on TeleFuser's LingBot-World-fast pipeline, on every TeleFuser layout it knows.

On the 0.1.0.post3 release and the hooked commit (layout adapter ``bshd``, the binding's
default)::

    from cacheseek.integrations.telefuser import attach
    from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding

    attach(pipeline)                     # once, after pipeline.init(); returns the layout found
    session_config.world_kv_binding = LingBotWorldKVBinding(manager, forest)   # one per session
    runtime = pipeline.create_runtime(session_config)     # restores the longest cached prefix
    while runtime.active:
        frames = pipeline.generate_next_chunk(runtime)    # cached chunks are decoded only

On TeleFuser main (layout adapter ``telefuser_main``)::

    layout = attach(pipeline)            # right after init(), before any generation
    session_config.world_kv_binding = LingBotWorldKVBinding(manager, forest, layout=layout.adapter())
    frames = pipeline.generate_video(session_config, controls)   # restores, then streams

On the hooked layout TeleFuser calls the binding itself and `attach` only marks the model around
``create_runtime`` (`hooked`); on the released 0.1.0.post3 it installs the same hooks around the
pipeline (`pypi_release`); on main it tells the layout adapter which pipeline holds a session's
ring and which controls the session gets, and decodes restored latents as stored (`streaming`). A caller that drives main's streaming
scheduler itself (as TeleFuser's service does) calls `plan_controls(session_config, controls)`
before creating the session. A layout it does not know raises `UnsupportedTeleFuserError`.

On every layout the binding fingerprints the DiT that created the runtime (`cacheseek.weights`,
once per model): two checkpoints never share a namespace. Without `attach` and without a
``model_fingerprint``, the binding refuses a TeleFuser runtime (a `ConfigError` naming the fix).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from cacheseek import weights
from cacheseek.integrations.telefuser.hooked import HookedHooks
from cacheseek.integrations.telefuser.layouts import TeleFuserLayout, UnsupportedTeleFuserError, detect_layout
from cacheseek.integrations.telefuser.pypi_release import ReleasedHooks
from cacheseek.integrations.telefuser.streaming import StreamingHooks
from cacheseek.layout.telefuser_main import forget_controls, plan_controls

__all__ = ["TeleFuserLayout", "UnsupportedTeleFuserError", "attach", "detach", "detect_layout",
           "forget_controls", "hooks_of", "plan_controls", "unattached_release"]

_ATTR = "_cacheseek_hooks"
_RELEASE_SESSION = "telefuser.pipelines.lingbot_world_fast.session"
_attached: list[bool] = []  # set by the first attach of this process
_HOOKS = {TeleFuserLayout.RELEASED: ReleasedHooks, TeleFuserLayout.MAIN: StreamingHooks,
          TeleFuserLayout.HOOKED: HookedHooks}


def attach(pipeline: Any) -> TeleFuserLayout:
    """Make ``pipeline`` call ``session_config.world_kv_binding`` as the hooked TeleFuser does,
    with what the layout adapter needs. Idempotent; returns the detected layout (its
    ``adapter()`` is the binding's ``layout``). A pipeline that ``init()`` loaded from
    ``config.checkpoint_dir`` has its DiT identified by its files (`weights.from_files`)."""
    layout = detect_layout(pipeline)
    dit_files = _dit_checkpoint(pipeline)
    if dit_files is not None:
        weights.from_files(pipeline.dit, dit_files)
    if getattr(pipeline, _ATTR, None) is None:
        hooks = _HOOKS[layout](pipeline)
        hooks.install()
        setattr(pipeline, _ATTR, hooks)
    _attached[:] = [True]
    return layout


def _dit_checkpoint(pipeline: Any) -> Any:
    """The DiT's checkpoint directory of a pipeline that ``init()`` loaded (it records
    ``_model_info``), or None (a pipeline built in code: its tensors identify it)."""
    cfg = getattr(pipeline, "config", None)
    root, sub = getattr(cfg, "checkpoint_dir", ""), getattr(cfg, "fast_checkpoint_subdir", "")
    if not (getattr(pipeline, "_model_info", None) and root and sub):
        return None
    path = Path(root).expanduser().resolve() / sub
    return path if path.is_dir() else None


def unattached_release() -> bool:
    """Whether TeleFuser's 0.1.0.post3 release is imported and no pipeline of this process was
    ever attached: that TeleFuser calls no binding by itself, so one would never run."""
    session = sys.modules.get(_RELEASE_SESSION)
    state = getattr(session, "LingBotWorldFastRuntimeState", None)
    if _attached or state is None or not dataclasses.is_dataclass(state):
        return False
    return "world_kv_binding" not in {f.name for f in dataclasses.fields(state)}


def hooks_of(pipeline: Any) -> Any:
    """The hooks `attach` installed on ``pipeline`` (`ReleasedHooks`, `StreamingHooks` or
    `HookedHooks`, by layout), None when it is not attached: they hold what the seams replaced."""
    return getattr(pipeline, _ATTR, None)


def detach(pipeline: Any) -> None:
    """Undo `attach` (idempotent)."""
    hooks = getattr(pipeline, _ATTR, None)
    if hooks is not None:
        hooks.remove()
        delattr(pipeline, _ATTR)
