"""Store backends, each registered in `cacheseek.registry.STORES` at its class; the registry
reads the names off this package's source and imports a store's module on its name's first use."""
