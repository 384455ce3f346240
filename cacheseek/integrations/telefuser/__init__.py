"""CacheSeek on TeleFuser's LingBot-World-fast pipeline, on either TeleFuser layout.

    from cacheseek.integrations.telefuser import attach
    from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding

    attach(pipeline)                     # once, after pipeline.init(); returns the layout found
    session_config.world_kv_binding = LingBotWorldKVBinding(manager, forest)   # one per session
    runtime = pipeline.create_runtime(session_config)     # restores the longest cached prefix
    while runtime.active:
        frames = pipeline.generate_next_chunk(runtime)    # cached chunks are decoded only

On the hooked layout TeleFuser calls the binding itself and `attach` only checks the layout; on
the released 0.1.0.post3 it installs the same hooks around the pipeline (`released`). A layout it
does not know raises `UnsupportedTeleFuserError`.
"""

from __future__ import annotations

from typing import Any

from cacheseek.integrations.telefuser.layouts import (
    TeleFuserLayout,
    UnsupportedTeleFuserError,
    detect_layout,
)
from cacheseek.integrations.telefuser.released import ReleasedHooks

__all__ = ["TeleFuserLayout", "UnsupportedTeleFuserError", "attach", "detach", "detect_layout"]

_ATTR = "_cacheseek_hooks"


def attach(pipeline: Any) -> TeleFuserLayout:
    """Make ``pipeline`` call ``session_config.world_kv_binding`` as the hooked TeleFuser does.
    Idempotent; returns the detected layout."""
    layout = detect_layout(pipeline)
    if layout is TeleFuserLayout.RELEASED and getattr(pipeline, _ATTR, None) is None:
        hooks = ReleasedHooks(pipeline)
        hooks.install()
        setattr(pipeline, _ATTR, hooks)
    return layout


def detach(pipeline: Any) -> None:
    """Undo `attach` (idempotent)."""
    hooks = getattr(pipeline, _ATTR, None)
    if hooks is not None:
        hooks.remove()
        delattr(pipeline, _ATTR)
