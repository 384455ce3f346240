"""The generic orchestrator: turns a composed config into a running stack.

``build_stack(cfg)`` instantiates, from the registries, the runtime factory, the transfer runtime
(``auto`` follows the runtime's device), the layout adapter, the namespace fingerprint fields and
the store (``store: null`` resolves to the registry's default backend, logged). Objects that
OmegaConf cannot hold (a transfer runtime, a fake client) are passed at the call site to the
classes whose constructors name them: that is also how tests inject fakes.

A `Stack` hands out managers and bindings that share one forest, one store and one
`CacheMetrics`, which is what a serving process does with many sessions. Managers get the
``manager.eviction`` section (policy and watermarks).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Optional

import attrs
from omegaconf import DictConfig, OmegaConf

from cacheseek import namespace
from cacheseek.errors import CacheSeekError, ConfigError
from cacheseek.registry import STORES, TRANSFERS, import_backends

log = logging.getLogger(__name__)

__all__ = ["Stack", "build_stack", "instantiate"]


def instantiate(node: Any, **call_site: Any) -> Any:
    """The one place that calls ``hydra.utils.instantiate`` (Hydra 1.4 will want a whitelist).

    Call-site objects are passed only to constructors that name them."""
    from hydra.utils import get_class, instantiate as hydra_instantiate

    target = node.get("_target_") if isinstance(node, (dict, DictConfig)) else None
    if target is None:
        raise ConfigError("_target_", f"config node {node!r} names no class")
    cls = get_class(target)
    params = inspect.signature(cls).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in call_site.items() if v is not None and (accepts_any or k in params)}
    try:
        return hydra_instantiate(node, _convert_="all", **kwargs)
    except Exception as exc:  # hydra wraps constructor errors; surface ours unchanged
        cause = exc
        while cause is not None and not isinstance(cause, CacheSeekError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, CacheSeekError):
            raise cause from None
        raise


@attrs.define
class Stack:
    cfg: Any
    runtime_factory: Any
    store: Any
    store_name: str
    transfer: Any
    layout: Any
    fields: list[Any]
    forest: Any
    run_dir: Path
    metrics: Any = attrs.field(factory=lambda: _new_metrics())

    def manager_config(self):
        from cacheseek.reuse.exact_prefix.telefuser_lingbot import make_full_kv_config, make_rolling_config

        rt = self.runtime_factory
        be = int(self.cfg.manager.break_even_k)
        if be < 1:
            raise ConfigError("manager.break_even_k", f"must be >= 1, got {be}")
        if rt.local_attn_size == -1:
            return make_full_kv_config(break_even_k=be)
        return make_rolling_config(local_attn_size=rt.local_attn_size, sink_size=rt.sink_size,
                                   chunk_size=rt.geometry.chunk_size, break_even_k=be)

    def eviction_config(self):
        from cacheseek.eviction import EvictionConfig, make_policy

        cfg = EvictionConfig.from_conf(self.cfg.manager.get("eviction"))
        make_policy(cfg.policy)  # an unknown name is a ConfigError now, not at the first session
        return cfg

    def new_manager(self, forest: Any = None):
        from cacheseek.reuse.exact_prefix import WorldKVManager

        return WorldKVManager(forest if forest is not None else self.forest, self.store,
                              self.manager_config(), eviction=self.eviction_config(),
                              metrics=self.metrics)

    def new_binding(self, manager: Any = None, *, ingest_enabled: bool = True):
        from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding

        manager = manager if manager is not None else self.new_manager()
        model = str(self.cfg.namespace.model_fingerprint).encode()
        weights = getattr(self.runtime_factory, "weights_fingerprint", None)  # a runtime that knows its weights
        return LingBotWorldKVBinding(
            manager, manager.forest,
            model_fingerprint=model + b":" + weights.hex().encode() if weights else model,
            ingest_enabled=ingest_enabled, layout=self.layout, fingerprint_fields=self.fields,
        )

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            close()


def build_stack(cfg: Any, *, run_dir: Optional[Path] = None, **objects: Any) -> Stack:
    """Instantiate the configured stack. ``objects`` (e.g. ``store=``, ``transfer=``,
    ``plan_client=``, ``cudart=``) override or are injected into the configured components."""
    from cacheseek.reuse.exact_prefix import NamespaceForest

    import_backends()
    run_dir = Path(run_dir) if run_dir is not None else Path.cwd()
    runtime_factory = objects.pop("runtime_factory", None) or instantiate(cfg.runtime)
    layout = instantiate(cfg.layout)
    fields = namespace.resolve_fields(
        None if cfg.namespace.fields is None else list(cfg.namespace.fields))

    transfer = objects.pop("transfer", None)
    if transfer is None:
        transfer = _build_transfer(cfg.transfer, runtime_factory.device, objects)

    store = objects.pop("store", None)
    store_name = "injected"
    if store is None:
        store_cfg = cfg.get("store")
        if store_cfg is None:
            store_name = STORES.default
            log.info("store: null -> the embedded default store %r", store_name)
            store_cfg = OmegaConf.create({"_target_": _target_of(STORES.get(store_name))})
        else:
            store_name = _name_of(STORES, store_cfg["_target_"])
        store_cfg = OmegaConf.to_container(store_cfg, resolve=True)
        if "root" in store_cfg and store_cfg["root"] is None:
            store_cfg["root"] = str(run_dir / "kvstore")
        for name, node in store_cfg.items():  # the levels of a tiered store
            if isinstance(node, dict) and "root" in node and node["root"] is None:
                node["root"] = str(run_dir / "kvstore" / name)
        store = instantiate(store_cfg, transfer=transfer, **objects)
    stack = Stack(cfg=cfg, runtime_factory=runtime_factory, store=store, store_name=store_name,
                  transfer=transfer, layout=layout, fields=fields, forest=NamespaceForest(),
                  run_dir=run_dir)
    stack.manager_config()  # validates the manager section against the runtime before any work
    stack.eviction_config()
    stack.metrics.bind_store(store)
    return stack


def _new_metrics() -> Any:
    from cacheseek.metrics import CacheMetrics

    return CacheMetrics()


def _build_transfer(node: Any, device: str, objects: dict[str, Any]) -> Any:
    name = _name_of(TRANSFERS, node["_target_"])
    if name == "auto":
        name = "cuda" if str(device).startswith("cuda") else "host"
        node = OmegaConf.create({"_target_": _target_of(TRANSFERS.get(name))})
        log.info("transfer: auto -> %r for runtime device %r", name, device)
    return instantiate(node, **objects)


def _target_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _name_of(registry: Any, target: str) -> str:
    for name in registry.names():
        if _target_of(registry.get(name)) == target:
            return name
    return target
