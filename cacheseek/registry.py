"""Registries: the extension points of CacheSeek, one per component kind.

Each registry maps a name to ``"module:attr"`` and imports the module when the name is first
used, so a backend module imports what it needs (torch included) at its top and naming a backend
costs nothing. The module registers its class::

    @STORES.register("localdisk")
    class LocalDiskTierStore: ...

Registration checks the class against the table (a second class under one name is refused). In a
registry of configured backends the constructor's signature is the config: `schema_of` makes the
schema dataclass from its named parameters (their defaults, and their annotations where OmegaConf
can check them: int, float, str, bool, Path, an Enum, Optional or a list of those; anything else
is ``Any``), less ``objects``, the parameters the caller hands over built (a transfer runtime, a
client; test seams). So a default cannot differ between a config and a constructor. The schema
(with ``_target_`` pointing at the class) goes into Hydra's ConfigStore as
``schema/<group>/<name>``. The YAML ``conf/<group>/<name>.yaml`` pulls that schema in
(``- /schema/<group>/<name>@_here_``), so a typo or a wrong type in the YAML or on the command
line is rejected when Hydra composes the config; `import_backends()` resolves every name first.
`instantiate()` builds a backend from its config node (the one call of Hydra's instantiate).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import enum
import importlib
import inspect
import pathlib
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, List, Optional, TypeVar, Union

from omegaconf import MISSING, DictConfig
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object, instantiate as hydra_instantiate

from cacheseek.errors import CacheSeekError, ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> ``"module:attr"`` for one component kind, imported on first `get`; rejects
    duplicates and lists the known names on a miss."""

    def __init__(self, group: str, targets: Mapping[str, str] = (), *, default: str | None = None,
                 configured: bool = False) -> None:
        self.group = group
        self.default = default
        self.configured = configured
        self._targets: dict[str, str] = dict(targets)
        self._entries: dict[str, T] = {}
        self._schemas: dict[str, type] = {}

    def register(self, name: str, *, objects: Sequence[str] = (),
                 keywords: Callable[[], Iterable[tuple[str, Any, Any]]] | None = None) -> Callable[[T], T]:
        """Register ``obj`` under ``name``; in a configured registry its schema is `schema_of` it
        (``objects``, ``keywords`` as there)."""

        def decorator(obj: T) -> T:
            target = self._targets.setdefault(name, f"{obj.__module__}:{obj.__qualname__}")
            if target != f"{obj.__module__}:{obj.__qualname__}" or self._entries.get(name, obj) is not obj:
                raise ValueError(f"{self.group} registry: duplicate name {name!r} (taken by {target})")
            self._entries[name] = obj
            if self.configured:
                self._store_schema(name, schema_of(obj, objects=objects, keywords=keywords() if keywords else ()), obj)
            return obj

        return decorator

    def _store_schema(self, name: str, schema: type, obj: Any) -> None:
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

    def name_of(self, obj: Any) -> str | None:
        """The name ``obj`` (a class or function) is registered under, without importing anything;
        None when it is not registered."""
        target = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
        return next((name for name, t in self._targets.items() if t == target), None)

    def schema(self, name: str) -> type:
        self.get(name)
        return self._schemas[name]

    def __contains__(self, name: str) -> bool:
        return name in self._targets


_PLAIN = (int, float, str, bool, pathlib.Path)


def config_type(annotation: Any, namespace: Mapping[str, Any]) -> Any:
    """The OmegaConf type of a parameter annotated ``annotation`` (a string is evaluated in the
    defining module's ``namespace``), ``Any`` where OmegaConf cannot check it."""
    try:
        hint = eval(annotation, dict(namespace)) if isinstance(annotation, str) else annotation  # noqa: S307
    except Exception:
        return Any
    if hint in _PLAIN or (isinstance(hint, type) and issubclass(hint, enum.Enum)) or dataclasses.is_dataclass(hint):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union and len(args) == 2 and type(None) in args:
        inner = config_type(next(a for a in args if a is not type(None)), namespace)
        return Any if inner is Any else Optional[inner]
    if origin in (list, tuple, Sequence) and args and (len(args) == 1 or args[1] is Ellipsis):
        inner = config_type(args[0], namespace)
        return List[inner] if inner is not Any else list
    return Any


def schema_of(obj: Callable[..., Any], *, objects: Sequence[str] = (),
              keywords: Iterable[tuple[str, Any, Any]] = ()) -> type:
    """The config dataclass of the constructor ``obj``: one field per named parameter but
    ``objects`` (one without a default is required: OmegaConf's ``???``), and one per ``keywords``
    entry ``(name, type, default)`` for what its ``**kwargs`` take."""
    namespace = getattr(obj.__init__ if isinstance(obj, type) else obj, "__globals__", {})  # where it is defined
    params = inspect.signature(obj).parameters
    unknown = set(objects) - set(params)
    if unknown:
        raise TypeError(f"{obj.__qualname__}: objects {sorted(unknown)} are not parameters")
    target = f"{obj.__module__}.{obj.__qualname__}"
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=target))]
    named = [(p.name, config_type(p.annotation, namespace), p.default) for p in params.values()
             if p.name not in objects and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for name, typ, default in named + list(keywords):
        if default is inspect.Parameter.empty:
            fields.append((name, typ, dataclasses.field(default=MISSING)))
        elif isinstance(default, (list, tuple, dict)) or dataclasses.is_dataclass(default):
            copy = list if isinstance(default, tuple) else copy_module.deepcopy
            fields.append((name, typ, dataclasses.field(default_factory=lambda d=default, c=copy: c(d))))
        else:
            fields.append((name, typ, dataclasses.field(default=default)))
    schema = dataclasses.make_dataclass(f"{obj.__name__}Config", fields)
    schema.__module__ = obj.__module__
    return schema


STORES: Registry[type] = Registry("store", {
    "memory": "cacheseek.stores.memory:InMemoryTierStore",
    "localdisk": "cacheseek.stores.localdisk:LocalDiskTierStore",
    "fluxon_plan": "cacheseek.stores.plan_tier:PlanTierStore",
    "hbm": "cacheseek.stores.hbm:HbmTierStore",
    "fluxon": "cacheseek.stores.fluxon_bytes:FluxonTensorTier",
    "per_tensor": "cacheseek.stores.per_tensor:PerTensorTierStore",
    "tiered": "cacheseek.stores.tiered:TieredStore",
}, default="memory", configured=True)
TRANSFERS: Registry[type] = Registry("transfer", {
    "auto": "cacheseek.transfer:auto_transfer_runtime",
    "host": "cacheseek.transfer.host_transfer:HostTransferRuntime",
    "cuda": "cacheseek.transfer.cuda_transfer:CudaTransferRuntime",
}, default="auto", configured=True)
LAYOUTS: Registry[type] = Registry("layout", {
    "auto": "cacheseek.layout.auto:auto_layout",
    "bshd": "cacheseek.layout.bshd:BshdLayout",
    "telefuser_main": "cacheseek.layout.telefuser_main:TeleFuserMainLayout",
}, default="bshd", configured=True)
FINGERPRINT_FIELDS: Registry[type] = Registry("fingerprint")  # filled by cacheseek.namespace
RUNTIMES: Registry[type] = Registry("runtime", {
    "synthetic": "cacheseek.runtime.synthetic:SyntheticRuntimeFactory",
    "telefuser": "cacheseek.runtime.telefuser:TeleFuserRuntimeFactory",
}, default="synthetic", configured=True)
WORKLOADS: Registry[type] = Registry("workload", {
    "abcd": "cacheseek.workloads.prefix_gate:PrefixGate",
    "stress": "cacheseek.workloads.stress:StressWorkload",
    "interactive": "cacheseek.workloads.interactive:InteractiveWorkload",
}, default="abcd", configured=True)
PLAN_CLIENTS: Registry[type] = Registry("plan_client", {
    "embedded": "cacheseek.plan.embedded:EmbeddedPlanClient",
    "device": "cacheseek.plan.device:DevicePlanClient",
    "fluxon_native": "cacheseek.plan.fluxon_native:FluxonNativePlanClient",
    "fluxon_public": "cacheseek.plan.fluxon_public:FluxonPublicPlanClient",
    "fluxon": "cacheseek.plan.fluxon_select:open_fluxon_plan_client",
}, default="embedded", configured=True)
EVICTION_POLICIES: Registry[type] = Registry("eviction", {"lru": "cacheseek.eviction.lru:LruPolicy"}, default="lru",
                                              configured=True)
CODECS: Registry[type] = Registry("codec", {
    "none": "cacheseek.codecs.base:NoneCodec",
    "lossless": "cacheseek.codecs.lossless:ExponentSplitCodec",
    "int8": "cacheseek.codecs.kivi:Int8Codec",
    "int4": "cacheseek.codecs.kivi:Int4Codec",
}, default="none")  # store.codec: how a generic tier encodes K and V (cacheseek.codecs)
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
    Not recursive: a backend builds the nodes nested in its config itself (the tiered store's levels).

    Call-site objects are passed only to constructors that name them."""
    target = node.get("_target_") if isinstance(node, (dict, DictConfig)) else None
    if target is None:
        raise ConfigError("_target_", f"config node {node!r} names no class")
    factory = get_object(target)  # a class, or a factory function (``auto`` entries)
    params = inspect.signature(factory).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in call_site.items() if v is not None and (accepts_any or k in params)}
    try:
        return hydra_instantiate(node, _convert_="all", _recursive_=False, **kwargs)
    except Exception as exc:  # hydra wraps constructor errors; surface ours unchanged
        cause = exc
        while cause is not None and not isinstance(cause, CacheSeekError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, CacheSeekError):
            raise cause from None
        raise
