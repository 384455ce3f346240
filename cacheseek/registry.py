"""Registries: the extension points of CacheSeek, one per component kind.

A backend is named once, where it is defined::

    @STORES.register("localdisk")
    class LocalDiskTierStore: ...

A registry reads the names off the source of its package (``cacheseek.stores`` for `STORES`,
...), so naming a backend imports nothing, and imports the module that registers a name when
the name is first used; the modules ``cacheseek.backends`` entry points name (a package outside
CacheSeek: docs/extending.md) are imported when the names are first listed. A second class
under one name is refused. In a registry of configured backends the constructor's signature is the
config: `schema_of` makes the schema dataclass from its named parameters (their defaults, and
their annotations where OmegaConf can check them: int, float, str, bool, Path, an Enum, Optional
or a list of those; anything else is ``Any``), less ``objects``, the parameters the caller hands
over built (a transfer runtime, a client; test seams). So a default cannot differ between a
config and a constructor. The schema (with ``_target_`` pointing at the class) goes into Hydra's
ConfigStore as ``schema/<group>/<name>``. The YAML ``conf/<group>/<name>.yaml`` pulls that schema
in (``- /schema/<group>/<name>@_here_``), so a typo or a wrong type in the YAML or on the command
line is rejected when Hydra composes the config; `import_backends()` finds every backend first.
`instantiate()` builds a backend from its config node (the one call of Hydra's instantiate).
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import enum
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, List, Optional, TypeVar, Union

from omegaconf import MISSING, DictConfig
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object, instantiate as hydra_instantiate

from cacheseek.errors import CacheSeekError, ConfigError

T = TypeVar("T")

ENTRY_POINTS = "cacheseek.backends"  # entry point group: modules of backends outside CacheSeek
_REGISTER = re.compile(r"""\b([A-Z][A-Z_]*)\.register\(\s*["']([\w.-]+)["']""")  # ``STORES.register("name"``


def _modules_of(package: str) -> Iterable[tuple[str, pathlib.Path]]:
    """``(module name, source file)`` of ``package`` and every module below it, found on disk
    without importing them (importing a subpackage would run its imports: torch, ...)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ImportError(f"no package {package!r}")
    yield package, pathlib.Path(spec.origin)
    for root in map(pathlib.Path, spec.submodule_search_locations or []):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if all((root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                name = ".".join((package,) + (parts[:-1] if parts[-1] == "__init__" else parts))
                if name != package:
                    yield name, path


@functools.cache
def _plugins() -> tuple[importlib.metadata.EntryPoint, ...]:
    return tuple(importlib.metadata.entry_points(group=ENTRY_POINTS))


class Registry(Generic[T]):
    """Name -> class (or factory) for one component kind. The names come from the source of its
    ``packages`` (each ``SYMBOL.register("name"`` where ``SYMBOL`` is this registry in this
    module), so naming a backend imports nothing; `get` imports the module that registers it.
    The ``cacheseek.backends`` entry points' modules are imported when the names are first
    listed. Rejects duplicates and lists the known names on a miss."""

    def __init__(self, group: str, packages: Sequence[str] = (), *, default: str | None = None,
                 configured: bool = False) -> None:
        self.group = group
        self.default = default
        self.configured = configured
        self._packages = tuple(packages)
        self._index: Optional[dict[str, str]] = None if packages else {}  # name -> module, from the source
        self._entries: dict[str, T] = {}
        self._options: dict[str, tuple[Sequence[str], Optional[Callable[[], Iterable[tuple[str, Any, Any]]]]]] = {}
        self._schemas: dict[str, type] = {}

    def register(self, name: str, *, objects: Sequence[str] = (),
                 keywords: Callable[[], Iterable[tuple[str, Any, Any]]] | None = None) -> Callable[[T], T]:
        """Register ``obj`` under ``name``; in a configured registry its schema is `schema_of` it
        (``objects``, ``keywords`` as there), stored at once."""

        def decorator(obj: T) -> T:
            taken = self._entries.setdefault(name, obj)
            if taken is not obj:
                raise ValueError(f"{self.group} registry: duplicate name {name!r} "
                                 f"(taken by {taken.__module__}:{taken.__qualname__})")
            self._options[name] = (objects, keywords)
            if self.configured:
                if name not in self._scanned():  # a backend from outside the packages: lists of them change
                    for other, (_, listed) in self._options.items():
                        if listed is not None and other != name:
                            self._schemas.pop(other, None)
                            self.schema(other)
                self.schema(name)
            return obj

        return decorator

    def _scanned(self) -> dict[str, str]:
        if self._index is None:
            symbols = {symbol for symbol, value in globals().items() if value is self}
            index: dict[str, str] = {}
            for package in self._packages:
                for module, path in _modules_of(package):
                    for symbol, name in _REGISTER.findall(path.read_text()):
                        if symbol in symbols and index.setdefault(name, module) != module:
                            raise ValueError(f"{self.group} registry: duplicate name {name!r} "
                                             f"(in {index[name]} and {module})")
            self._index = index
        return self._index

    def get(self, name: str) -> T:
        if name not in self._entries:
            module = self._scanned().get(name)
            if module is None:
                self.names()  # the entry points' modules register as they load
            else:
                importlib.import_module(module)
            if name not in self._entries:
                known = ", ".join(self.names()) or "none registered"
                raise ConfigError(f"{self.group}", f"unknown {self.group} {name!r}", f"use one of: {known}")
        return self._entries[name]

    def names(self) -> list[str]:
        for entry in _plugins():
            entry.load()
        return sorted(set(self._scanned()) | set(self._entries))

    def name_of(self, obj: Any) -> str | None:
        """The name ``obj`` (a class or function) is registered under; None when it is not."""
        return next((name for name, entry in self._entries.items() if entry is obj), None)

    def schema(self, name: str) -> type:
        """The config dataclass of ``name``, stored in Hydra's ConfigStore as ``schema/<group>/<name>``."""
        obj = self.get(name)
        if name not in self._schemas:
            objects, keywords = self._options[name]
            schema = schema_of(obj, objects=objects, keywords=keywords() if keywords else ())
            node = schema(_target_=f"{obj.__module__}.{obj.__qualname__}")  # type: ignore[call-arg]
            ConfigStore.instance().store(group=f"schema/{self.group}", name=name, node=node)
            self._schemas[name] = schema
        return self._schemas[name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._scanned() or name in self.names()


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


STORES: Registry[type] = Registry("store", ["cacheseek.stores"], default="memory", configured=True)
TRANSFERS: Registry[type] = Registry("transfer", ["cacheseek.transfer"], default="auto", configured=True)
LAYOUTS: Registry[type] = Registry("layout", ["cacheseek.layout"], default="bshd", configured=True)
RUNTIMES: Registry[type] = Registry("runtime", ["cacheseek.runtime"], default="synthetic", configured=True)
WORKLOADS: Registry[type] = Registry("workload", ["cacheseek.workloads"], default="abcd", configured=True)
PLAN_CLIENTS: Registry[type] = Registry("plan_client", ["cacheseek.plan"], default="embedded", configured=True)
EVICTION_POLICIES: Registry[type] = Registry("eviction", ["cacheseek.eviction"], default="lru", configured=True)
CODECS: Registry[type] = Registry("codec", ["cacheseek.codecs"], default="none")  # store.codec (cacheseek.codecs)
REGISTRIES = (STORES, TRANSFERS, LAYOUTS, RUNTIMES, WORKLOADS, PLAN_CLIENTS, EVICTION_POLICIES)


def import_backends() -> None:
    """Find every backend, so that every schema is in Hydra's ConfigStore before a config is
    composed."""
    for registry in REGISTRIES + (CODECS,):
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
