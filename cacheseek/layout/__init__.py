"""Layout adapters: how a runtime's KV buffer maps to stored bytes."""

from cacheseek.layout import bshd  # noqa: F401  (registers the built-in layout)
