"""``layout: auto`` (the default): the layout adapter the runtime names, else ``bshd``.

A runtime factory that knows which layout its runtimes have says so with a ``layout_name``
attribute (the ``telefuser`` runtime reads it off the installed TeleFuser, the synthetic runtime
names ``bshd``); a runtime that names none gets ``bshd``. A binding made without ``layout=``
tells the layout from the runtime it is handed (`layout_name_of_runtime`): each layout declares
which runtimes it matches (`RingLayout.matches`; a ring of its own is ``bshd``, a session whose
ring sits behind a cache handle is TeleFuser main's) and which TeleFuser releases it lays out
(`layout_name_of_release`).
"""

from __future__ import annotations

import logging
from typing import Any

from cacheseek.registry import LAYOUTS

log = logging.getLogger(__name__)

__all__ = ["auto_layout", "layout_name_of_runtime", "layout_name_of_release"]


def auto_layout(runtime_factory: Any = None) -> Any:
    """An instance of the layout ``runtime_factory.layout_name`` names, else of ``bshd``."""
    name = getattr(runtime_factory, "layout_name", None) or LAYOUTS.default
    log.info("layout: auto -> %r", name)
    return LAYOUTS.get(name)()


def _ring_layouts() -> list[tuple[str, Any]]:
    return [(name, LAYOUTS.get(name)) for name in LAYOUTS.names() if name != "auto"]


def layout_name_of_runtime(runtime: Any) -> str:
    """The first registered layout that `matches` ``runtime``, else the default (``bshd``)."""
    return next((name for name, cls in _ring_layouts() if cls.matches(runtime)), LAYOUTS.default)


def layout_name_of_release(release: str) -> str:
    """The layout that lists the TeleFuser ``release`` (a `TeleFuserLayout` value) in its
    ``telefuser_releases``, else the default (``bshd``)."""
    return next((name for name, cls in _ring_layouts() if release in cls.telefuser_releases), LAYOUTS.default)


LAYOUTS.register("auto", objects=("runtime_factory",))(auto_layout)
