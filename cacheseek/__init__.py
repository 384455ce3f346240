"""CacheSeek: exact-prefix KV-cache reuse for autoregressive video world models."""

__version__ = "0.1.0"
