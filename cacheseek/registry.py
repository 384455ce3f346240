"""Registries: the extension points of CacheSeek, one per component kind.

A backend is one class plus one short YAML. The class registers itself with a typed schema
dataclass::

    @STORES.register("localdisk", LocalDiskSchema)
    class LocalDiskTierStore: ...

Registration records ``name -> class`` and stores the schema (with ``_target_`` pointing at the
class) in Hydra's ConfigStore as ``schema/<group>/<name>``. The YAML ``conf/<group>/<name>.yaml``
pulls that schema in (``- /schema/<group>/<name>@_here_``), so a typo or a wrong type in the YAML
or on the command line is rejected when Hydra composes the config, before anything runs.

Registering costs nothing: backend modules import torch, CUDA or Fluxon only inside methods.
`import_backends()` imports every built-in backend module so that the registries are full, and
`instantiate()` builds a backend from its config node (the one call of Hydra's instantiate).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from omegaconf import DictConfig

from cacheseek.errors import CacheSeekError, ConfigError

T = TypeVar("T")

# Modules whose import registers the built-in backends. Each must import without torch.
BACKEND_MODULES = (
    "cacheseek.stores",
    "cacheseek.transfer",
    "cacheseek.layout",
    "cacheseek.runtime",
    "cacheseek.workloads",
    "cacheseek.namespace",
)


class Registry(Generic[T]):
    """Name -> class for one component kind; rejects duplicates and lists known names on a miss."""

    def __init__(self, group: str, *, default: str | None = None) -> None:
        self.group = group
        self.default = default
        self._entries: dict[str, T] = {}
        self._schemas: dict[str, type] = {}

    def register(self, name: str, schema: type | None = None) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.group} registry: duplicate name {name!r}")
            self._entries[name] = obj
            if schema is not None:
                self._store_schema(name, schema, obj)
            return obj

        return decorator

    def _store_schema(self, name: str, schema: type, obj: Any) -> None:
        if not dataclasses.is_dataclass(schema):
            raise TypeError(f"schema for {self.group}/{name} must be a dataclass")
        from hydra.core.config_store import ConfigStore

        target = f"{obj.__module__}.{obj.__qualname__}"
        node = schema(_target_=target)  # type: ignore[call-arg]
        ConfigStore.instance().store(group=f"schema/{self.group}", name=name, node=node)
        self._schemas[name] = schema

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none registered"
            raise ConfigError(
                f"{self.group}", f"unknown {self.group} {name!r}", f"use one of: {known}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def schema(self, name: str) -> type:
        return self._schemas[name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries


STORES: Registry[type] = Registry("store", default="memory")
TRANSFERS: Registry[type] = Registry("transfer", default="auto")
LAYOUTS: Registry[type] = Registry("layout", default="bshd")
FINGERPRINT_FIELDS: Registry[type] = Registry("fingerprint")
RUNTIMES: Registry[type] = Registry("runtime", default="synthetic")
WORKLOADS: Registry[type] = Registry("workload", default="abcd")
PLAN_CLIENTS: Registry[type] = Registry("plan_client", default="embedded")
EVICTION_POLICIES: Registry[type] = Registry("eviction", default="lru")


def import_backends() -> None:
    """Import every built-in backend module so that all registries are populated."""
    for mod in BACKEND_MODULES:
        importlib.import_module(mod)


def instantiate(node: Any, **call_site: Any) -> Any:
    """The one place that calls ``hydra.utils.instantiate`` (Hydra 1.4 will want a whitelist).

    Call-site objects are passed only to constructors that name them."""
    from hydra.utils import get_object, instantiate as hydra_instantiate

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
