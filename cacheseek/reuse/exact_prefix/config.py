"""`WorldKVConfig`: which chunks form a restore window and when a hit is worth restoring."""

from __future__ import annotations

from dataclasses import dataclass

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix.types import Tier

__all__ = ["WorldKVConfig", "SharedIndexConfig"]


@dataclass(frozen=True)
class WorldKVConfig:
    """Window = the most recent ``window_chunks`` chunks plus the ancestors with depth < ``sink_chunks``.

    ``window_chunks`` <= 0 means full length (every chunk of the path). Hits shorter than
    ``break_even_k`` chunks are not worth restoring.
    """

    window_chunks: int
    sink_chunks: int
    break_even_k: int
    quant: str = "none"
    group_size: int = 64
    commit_tier: Tier = Tier.FLUXON_DRAM

    def __post_init__(self) -> None:
        for name in ("window_chunks", "sink_chunks", "break_even_k", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"WorldKVConfig.{name}", f"must be an int, got {value!r}")
        if self.sink_chunks < 0:
            raise ConfigError("WorldKVConfig.sink_chunks", f"must be >= 0, got {self.sink_chunks}")
        if self.break_even_k < 1:
            raise ConfigError("WorldKVConfig.break_even_k", f"must be >= 1, got {self.break_even_k}")
        if self.quant != "none":
            raise ConfigError("WorldKVConfig.quant", f"unsupported quantization {self.quant!r}", "use 'none'")
        if not isinstance(self.commit_tier, Tier):
            object.__setattr__(self, "commit_tier", Tier(self.commit_tier))

    @property
    def full_length(self) -> bool:
        return self.window_chunks <= 0

    def window_depths(self, k: int) -> list[int]:
        """Chunk depths (oldest first, no duplicates) whose KV restores depth ``k``."""
        if self.full_length:
            return list(range(k))
        recent = range(max(0, k - self.window_chunks), k)
        sinks = range(min(self.sink_chunks, k))
        return sorted(set(recent) | set(sinks))


@dataclass(frozen=True)
class SharedIndexConfig:
    """``manager.shared_index``: whether a lookup that runs off the local trie asks the store's
    chunk records for the session's next keys (`SharedIndex`), and how many keys one probe asks
    for (``window``; a live session asks for one a chunk). Off, each process finds only what
    its own trie holds (the behaviour before the shared index). ``wait_s``: how long a live
    session waits for a chunk another process has claimed (is computing) before computing it
    itself; 0 claims nothing and never waits."""

    enabled: bool = True
    window: int = 8
    wait_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError("manager.shared_index.enabled", f"must be true or false, got {self.enabled!r}",
                              "manager.shared_index.enabled=true (the default)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 1 <= self.window <= 256:
            raise ConfigError("manager.shared_index.window", f"must be an integer in [1, 256], got {self.window!r}",
                              "manager.shared_index.window=8 (the default)")
        if isinstance(self.wait_s, bool) or not isinstance(self.wait_s, (int, float)) or not 0 <= self.wait_s <= 3600:
            raise ConfigError("manager.shared_index.wait_s", f"must be a number of seconds in [0, 3600], "
                              f"got {self.wait_s!r}", "manager.shared_index.wait_s=10 (the default; 0: never wait)")

    @classmethod
    def from_conf(cls, node: object) -> "SharedIndexConfig":
        """From the ``manager.shared_index`` section (a mapping, an instance, or None: defaults)."""
        if isinstance(node, cls):
            return node
        if node is None:
            return cls()
        get = node.get if hasattr(node, "get") else lambda k, d=None: getattr(node, k, d)
        return cls(enabled=get("enabled", True), window=get("window", 8), wait_s=get("wait_s", 10.0))
