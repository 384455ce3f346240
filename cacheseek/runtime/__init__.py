"""World-model runtimes, each registered in `cacheseek.registry.RUNTIMES` at its class
(``synthetic``, ``telefuser``); `geometry` (the sizes of a model) needs no torch."""

from cacheseek.runtime.geometry import GEOMETRIES, Geometry, get_geometry, validate_window

__all__ = ["GEOMETRIES", "Geometry", "get_geometry", "validate_window"]
