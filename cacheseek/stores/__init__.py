"""Store backends, each named in `cacheseek.registry.STORES` and imported on first use."""
