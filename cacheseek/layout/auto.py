"""``layout: auto`` (the default): the layout adapter the runtime names, else ``bshd``.

A runtime factory that knows which layout its runtimes have says so with a ``layout_name``
attribute (the ``telefuser`` runtime reads it off the installed TeleFuser, the synthetic runtime
names ``bshd``); a runtime that names none gets ``bshd``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from cacheseek.registry import LAYOUTS

log = logging.getLogger(__name__)

__all__ = ["AutoLayoutSchema", "auto_layout"]


@dataclasses.dataclass
class AutoLayoutSchema:
    _target_: str = "cacheseek.layout.auto.auto_layout"


def auto_layout(runtime_factory: Any = None) -> Any:
    """An instance of the layout ``runtime_factory.layout_name`` names, else of ``bshd``."""
    name = getattr(runtime_factory, "layout_name", None) or LAYOUTS.default
    log.info("layout: auto -> %r", name)
    return LAYOUTS.get(name)()


LAYOUTS.register("auto", AutoLayoutSchema)(auto_layout)
