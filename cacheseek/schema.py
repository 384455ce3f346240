"""Typed schemas of the primary config sections that are not backend groups.

Backend groups (store, transfer, layout, runtime, workload) get their schemas from the
registries; this module types the rest so that a typo such as ``manager.break_even=2`` or a wrong
type is rejected when Hydra composes the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclasses.dataclass
class EvictionConf:
    """``manager.eviction``: an `EVICTION_POLICIES` name and the watermarks as fractions of the
    store's capacity (above ``high_watermark`` after a write, evict down to ``low_watermark``)."""

    policy: str = "lru"
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    enabled: bool = True
    # Sink pins hold while their namespace was used by one of the last N sessions.
    live_sessions: int = 4


@dataclasses.dataclass
class SharedIndexConf:
    """``manager.shared_index``: lookups past the local trie ask the store's chunk records,
    ``window`` keys a probe; a live session waits up to ``wait_s`` for a chunk another process
    is computing (`cacheseek.reuse.exact_prefix.config.SharedIndexConfig`)."""

    enabled: bool = True
    window: int = 8
    wait_s: float = 10.0


@dataclasses.dataclass
class ManagerConf:
    break_even_k: int = 1
    # store the decoder's state after chunks N-1, 2N-1, ... (0: rebuild it at divergence by replay)
    decoder_state_every: int = 2
    # frames / decoder states written off the request path at once (one more is dropped,
    # counted); 0: written on the request path
    frames_in_flight: int = 8
    decoder_states_in_flight: int = 1
    eviction: EvictionConf = dataclasses.field(default_factory=EvictionConf)
    shared_index: SharedIndexConf = dataclasses.field(default_factory=SharedIndexConf)


@dataclasses.dataclass
class NamespaceConf:
    fields: Optional[List[str]] = None
    model_fingerprint: str = "lingbot-world-fast"


@dataclasses.dataclass
class MetricsConf:
    """``metrics``: the Prometheus endpoint (`cacheseek.metrics_server.MetricsConfig`): off while
    ``port`` is null, 0 lets the OS pick; ``host`` must be a loopback address; ``hold_s``: keep
    serving that long after the report (SIGTERM ends it early)."""

    port: Optional[int] = None
    host: str = "127.0.0.1"
    hold_s: float = 0.0


@dataclasses.dataclass
class RootConf:
    runtime: Any = MISSING
    transfer: Any = MISSING
    layout: Any = MISSING
    workload: Any = MISSING
    store: Any = None
    manager: ManagerConf = dataclasses.field(default_factory=ManagerConf)
    namespace: NamespaceConf = dataclasses.field(default_factory=NamespaceConf)
    metrics: MetricsConf = dataclasses.field(default_factory=MetricsConf)


ConfigStore.instance().store(name="root_schema", node=RootConf)
