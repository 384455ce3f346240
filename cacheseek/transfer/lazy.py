"""`LazyModule`: a module imported at its first attribute access.

Importing a transfer backend (or a store built on one) costs nothing; numpy is imported only once
copies are built. Use it as ``np = LazyModule("numpy")`` at module level.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule"]


class LazyModule:
    """Stands for the module ``name``; the first attribute access imports it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        module = self.__dict__["_module"]
        if module is None:
            module = self.__dict__["_module"] = importlib.import_module(self.__dict__["_name"])
        return getattr(module, attr)
