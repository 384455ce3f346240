"""``layout: auto`` (the default): the layout adapter the runtime names, else ``bshd``.

A runtime factory that knows which layout its runtimes have says so with a ``layout_name``
attribute (the ``telefuser`` runtime reads it off the installed TeleFuser, the synthetic runtime
names ``bshd``); a runtime that names none gets ``bshd``. A binding made without ``layout=``
tells the layout from the runtime it is handed (`layout_name_of_runtime`): a ring of its own
(``self_kv_cache``) is ``bshd``, a session whose ring sits behind a cache handle is TeleFuser
main's.
"""

from __future__ import annotations

import logging
from typing import Any

from cacheseek.registry import LAYOUTS

log = logging.getLogger(__name__)

__all__ = ["auto_layout", "layout_name_of_runtime"]


def auto_layout(runtime_factory: Any = None) -> Any:
    """An instance of the layout ``runtime_factory.layout_name`` names, else of ``bshd``."""
    name = getattr(runtime_factory, "layout_name", None) or LAYOUTS.default
    log.info("layout: auto -> %r", name)
    return LAYOUTS.get(name)()


def layout_name_of_runtime(runtime: Any) -> str:
    """``bshd`` for a runtime that holds its ring, ``telefuser_main`` for a session with a cache
    handle and no ring of its own (TeleFuser main's generation session)."""
    if not hasattr(runtime, "self_kv_cache") and hasattr(runtime, "cache_handle"):
        return "telefuser_main"
    return "bshd"


LAYOUTS.register("auto", objects=("runtime_factory",))(auto_layout)
