"""World-model runtimes. Importing this package registers them (torch is imported lazily)."""

from cacheseek.runtime import geometry, synthetic, telefuser
from cacheseek.runtime.geometry import GEOMETRIES, Geometry, get_geometry, validate_window
from cacheseek.runtime.synthetic import (
    SyntheticImage,
    SyntheticRuntimeFactory,
    SyntheticRuntimeSchema,
    SyntheticWorldRuntime,
)

__all__ = [
    "GEOMETRIES",
    "Geometry",
    "SyntheticImage",
    "SyntheticRuntimeFactory",
    "SyntheticRuntimeSchema",
    "SyntheticWorldRuntime",
    "geometry",
    "get_geometry",
    "synthetic",
    "telefuser",
    "validate_window",
]
