"""Store backends, each registered in `cacheseek.registry.STORES` at its class; the registry
imports this package on first use."""
