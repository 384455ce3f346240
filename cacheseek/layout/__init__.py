"""Layout adapters: where a runtime keeps its ring, cursors, noise, controls and RNG, and how its
KV buffer maps to stored bytes (`ring_layout`). Each is named in `cacheseek.registry.LAYOUTS`."""
