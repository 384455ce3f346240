"""Store backends. Importing this package registers every built-in backend (no heavy imports)."""

from cacheseek.stores import fluxon_bytes, hbm, localdisk, memory, per_tensor, plan_tier, tiered  # noqa: F401
