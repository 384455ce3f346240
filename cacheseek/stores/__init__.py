"""Store backends. Importing this package registers every built-in backend (no heavy imports)."""

from cacheseek.stores import localdisk, memory  # noqa: F401
