"""Store backends. Importing this package registers every built-in backend (no heavy imports)."""

from cacheseek.stores import fluxon_bytes, localdisk, memory, per_tensor, plan_tier  # noqa: F401
