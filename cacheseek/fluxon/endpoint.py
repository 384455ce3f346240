"""`FluxonEndpoint`: where a Fluxon cluster is attached and how long attaching and each call may
take; the one value every Fluxon constructor builds from its flat config keys (`FluxonClient`,
the ``fluxon`` stores, the ``fluxon_public``/``fluxon_native``/``fluxon`` Plan clients,
`FluxonService`), so each key is checked once, the same way, naming the field and the fix.

A cluster is found by ``cluster_name`` under ``share_mem_path`` (the owner's segment is
``<share_mem_path>/<cluster_name>/mmap.file``, `segment_dir`); ``instance_key`` is the prefix a
client registers under (each client makes it unique). ``field_prefix`` says where the config
gives these keys (``store.``, ``store.client_options.``, or none for the service), for errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError
from cacheseek.fluxon.config import DEFAULT_CLUSTER_NAME, DEFAULT_SHARE_MEM_PATH

__all__ = ["FluxonEndpoint"]


def _seconds(name: str, value: Any, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(name, f"must be a {'' if zero_ok else 'positive '}number of seconds"
                                f"{' (0 or more)' if zero_ok else ''}, got {value!r}")


@attrs.frozen(slots=True)
class FluxonEndpoint:
    """A Fluxon cluster and its time bounds (see the module docstring); checked at construction,
    ``share_mem_path`` normalised."""

    cluster_name: str = DEFAULT_CLUSTER_NAME
    share_mem_path: str = DEFAULT_SHARE_MEM_PATH
    instance_key: str = "cacheseek-client"
    op_timeout_s: float = 30.0
    attach_timeout_s: float = 30.0
    settle_s: float = 2.0
    field_prefix: str = attrs.field(default="store.", eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        at = self.field_prefix
        for name in ("op_timeout_s", "attach_timeout_s"):
            _seconds(f"{at}{name}", getattr(self, name))
        _seconds(f"{at}settle_s", self.settle_s, zero_ok=True)
        if not self.cluster_name or not isinstance(self.cluster_name, str):
            raise ConfigError(f"{at}cluster_name", f"must be a non-empty string, got {self.cluster_name!r}")
        if not isinstance(self.share_mem_path, str) or not os.path.isabs(self.share_mem_path):
            raise ConfigError(f"{at}share_mem_path", f"must be an absolute path, got {self.share_mem_path!r}",
                              "e.g. /dev/shm/cacheseek-fluxon (what the service was started with)")
        if not self.instance_key or not isinstance(self.instance_key, str):
            raise ConfigError(f"{at}instance_key", f"must be a non-empty string, got {self.instance_key!r}")
        object.__setattr__(self, "share_mem_path", os.path.normpath(self.share_mem_path))
        object.__setattr__(self, "op_timeout_s", float(self.op_timeout_s))
        object.__setattr__(self, "attach_timeout_s", float(self.attach_timeout_s))
        object.__setattr__(self, "settle_s", float(self.settle_s))

    @classmethod
    def keywords(cls, **defaults: Any) -> list[tuple[str, Any, Any]]:
        """``(name, type, default)`` of each field, ``defaults`` overriding: the flat config keys
        of a constructor that takes them as ``**endpoint`` (`cacheseek.registry.schema_of`)."""
        attrs.resolve_types(cls)
        return [(f.name, f.type, defaults.get(f.name, f.default)) for f in attrs.fields(cls)
                if f.name != "field_prefix"]

    @classmethod
    def of(cls, options: dict[str, Any], *, field_prefix: str = "store.", **defaults: Any) -> "FluxonEndpoint":
        """The endpoint of the fields given in ``options`` (others ignored), else ``defaults``,
        else the class defaults."""
        names = [f.name for f in attrs.fields(cls) if f.name != "field_prefix"]
        given = {**{k: v for k, v in defaults.items() if k in names}, **{k: options[k] for k in names if k in options}}
        return cls(**given, field_prefix=field_prefix)

    def native_spec(self, instance_key: Optional[str] = None) -> dict[str, Any]:
        """fluxon-py's client config (``FluxonKvClientConfig``) for this cluster, registering as
        ``instance_key`` (default: the endpoint's)."""
        return {"instance_key": instance_key or self.instance_key,
                "fluxonkv_spec": {"cluster_name": self.cluster_name, "share_mem_path": self.share_mem_path}}

    @property
    def segment_dir(self) -> Path:
        """Where the owner's segment (``mmap.file``) and its ``shared.json`` live."""
        return Path(self.share_mem_path) / self.cluster_name
