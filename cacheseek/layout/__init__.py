"""Layout adapters: where a runtime keeps its ring, cursors, noise, controls and RNG, and how its
KV buffer maps to stored bytes (`ring_layout`). Importing registers the built-in layouts."""

from cacheseek.layout import auto, bshd, telefuser_main  # noqa: F401  (register the built-in layouts)
