"""Registries: the extension points of CacheSeek, one per component kind.

Each registry maps a name to ``"module:attr"`` and imports the module when the name is first
used, so a backend module imports what it needs (torch included) at its top and naming a backend
costs nothing. The module registers its class with a typed schema dataclass::

    @STORES.register("localdisk", LocalDiskSchema)
    class LocalDiskTierStore: ...

Registration checks the class against the table (a second class under one name is refused) and
stores the schema (with ``_target_`` pointing at the class) in Hydra's ConfigStore as
``schema/<group>/<name>``. The YAML ``conf/<group>/<name>.yaml`` pulls that schema in
(``- /schema/<group>/<name>@_here_``), so a typo or a wrong type in the YAML or on the command
line is rejected when Hydra composes the config; `import_backends()` resolves every name first.
`instantiate()` builds a backend from its config node (the one call of Hydra's instantiate).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from omegaconf import DictConfig
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object, instantiate as hydra_instantiate

from cacheseek.errors import CacheSeekError, ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> ``"module:attr"`` for one component kind, imported on first `get`; rejects
    duplicates and lists the known names on a miss."""

    def __init__(self, group: str, targets: Mapping[str, str] = (), *, default: str | None = None) -> None:
        self.group = group
        self.default = default
        self._targets: dict[str, str] = dict(targets)
        self._entries: dict[str, T] = {}
        self._schemas: dict[str, type] = {}

    def register(self, name: str, schema: type | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            target = self._targets.setdefault(name, f"{obj.__module__}:{obj.__qualname__}")
            if target != f"{obj.__module__}:{obj.__qualname__}" or self._entries.get(name, obj) is not obj:
                raise ValueError(f"{self.group} registry: duplicate name {name!r} (taken by {target})")
            self._entries[name] = obj
            if schema is not None:
                self._store_schema(name, schema, obj)
            return obj

        return decorator

    def _store_schema(self, name: str, schema: type, obj: Any) -> None:
        if not dataclasses.is_dataclass(schema):
            raise TypeError(f"schema for {self.group}/{name} must be a dataclass")
        target = f"{obj.__module__}.{obj.__qualname__}"
        node = schema(_target_=target)  # type: ignore[call-arg]
        ConfigStore.instance().store(group=f"schema/{self.group}", name=name, node=node)
        self._schemas[name] = schema

    def get(self, name: str) -> T:
        if name not in self._entries:
            if name not in self._targets:
                known = ", ".join(self.names()) or "none registered"
                raise ConfigError(f"{self.group}", f"unknown {self.group} {name!r}", f"use one of: {known}")
            module, _, attr = self._targets[name].partition(":")
            self._entries.setdefault(name, getattr(importlib.import_module(module), attr))
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._targets)

    def schema(self, name: str) -> type:
        self.get(name)
        return self._schemas[name]

    def __contains__(self, name: str) -> bool:
        return name in self._targets


STORES: Registry[type] = Registry("store", {
    "memory": "cacheseek.stores.memory:InMemoryTierStore",
    "localdisk": "cacheseek.stores.localdisk:LocalDiskTierStore",
    "fluxon_plan": "cacheseek.stores.plan_tier:PlanTierStore",
    "hbm": "cacheseek.stores.hbm:HbmTierStore",
    "fluxon": "cacheseek.stores.fluxon_bytes:FluxonTensorTier",
    "per_tensor": "cacheseek.stores.per_tensor:PerTensorTierStore",
    "tiered": "cacheseek.stores.tiered:TieredStore",
}, default="memory")
TRANSFERS: Registry[type] = Registry("transfer", {
    "auto": "cacheseek.transfer:auto_transfer_runtime",
    "host": "cacheseek.transfer.host_transfer:HostTransferRuntime",
    "cuda": "cacheseek.transfer.cuda_transfer:CudaTransferRuntime",
}, default="auto")
LAYOUTS: Registry[type] = Registry("layout", {
    "auto": "cacheseek.layout.auto:auto_layout",
    "bshd": "cacheseek.layout.bshd:BshdLayout",
    "telefuser_main": "cacheseek.layout.telefuser_main:TeleFuserMainLayout",
}, default="bshd")
FINGERPRINT_FIELDS: Registry[type] = Registry("fingerprint")  # filled by cacheseek.namespace
RUNTIMES: Registry[type] = Registry("runtime", {
    "synthetic": "cacheseek.runtime.synthetic:SyntheticRuntimeFactory",
    "telefuser": "cacheseek.runtime.telefuser:TeleFuserRuntimeFactory",
}, default="synthetic")
WORKLOADS: Registry[type] = Registry("workload", {
    "abcd": "cacheseek.workloads.prefix_gate:PrefixGate",
    "stress": "cacheseek.workloads.stress:StressWorkload",
    "interactive": "cacheseek.workloads.interactive:InteractiveWorkload",
}, default="abcd")
PLAN_CLIENTS: Registry[type] = Registry("plan_client", {
    "embedded": "cacheseek.plan.embedded:EmbeddedPlanClient",
    "device": "cacheseek.plan.device:DevicePlanClient",
    "fluxon_native": "cacheseek.plan.fluxon_native:FluxonNativePlanClient",
    "fluxon_public": "cacheseek.plan.fluxon_public:FluxonPublicPlanClient",
    "fluxon": "cacheseek.plan.fluxon_select:open_fluxon_plan_client",
}, default="embedded")
EVICTION_POLICIES: Registry[type] = Registry("eviction", {"lru": "cacheseek.eviction.lru:LruPolicy"}, default="lru")
REGISTRIES = (STORES, TRANSFERS, LAYOUTS, RUNTIMES, WORKLOADS, PLAN_CLIENTS, EVICTION_POLICIES)


def import_backends() -> None:
    """Resolve every registered name (and the fingerprint fields), so that every schema is in
    Hydra's ConfigStore before a config is composed."""
    importlib.import_module("cacheseek.namespace")
    for registry in REGISTRIES:
        for name in registry.names():
            registry.get(name)


def instantiate(node: Any, **call_site: Any) -> Any:
    """The one place that calls ``hydra.utils.instantiate`` (Hydra 1.4 will want a whitelist).

    Call-site objects are passed only to constructors that name them."""
    target = node.get("_target_") if isinstance(node, (dict, DictConfig)) else None
    if target is None:
        raise ConfigError("_target_", f"config node {node!r} names no class")
    factory = get_object(target)  # a class, or a factory function (``auto`` entries)
    params = inspect.signature(factory).parameters
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
