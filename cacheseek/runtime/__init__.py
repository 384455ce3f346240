"""World-model runtimes, each named in `cacheseek.registry.RUNTIMES` (``synthetic``, ``telefuser``)
and imported on first use; `geometry` (the sizes of a model) needs no torch."""

from cacheseek.runtime.geometry import GEOMETRIES, Geometry, get_geometry, validate_window

__all__ = ["GEOMETRIES", "Geometry", "get_geometry", "validate_window"]
