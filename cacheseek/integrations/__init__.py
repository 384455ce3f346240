"""Integrations of CacheSeek into real world-model runtimes (TeleFuser's LingBot-World-fast)."""
