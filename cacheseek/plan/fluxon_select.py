"""The ``fluxon`` Plan client: Fluxon's native Plan API when the installed fluxon-py has it,
else the emulation over the public client, chosen by capability.

`open_fluxon_plan_client` (registered as ``fluxon`` in `cacheseek.registry.PLAN_CLIENTS`) asks
`native_plan_api_problem`: None means every Plan call is there and `FluxonNativePlanClient` is
used; otherwise `FluxonPublicPlanClient`. It logs which, and why. ``api: native|public`` forces
one (native without the API is `PlanUnavailableError`). The options are
`FluxonPublicPlanClient`'s; the native client uses the connection options and ``op_timeout_s``
(as its commit wait).

Importing this module needs neither fluxon-py, numpy nor torch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from cacheseek.errors import ConfigError, PlanUnavailableError
from cacheseek.fluxon.errors import FluxonImportError
from cacheseek.fluxon.loader import load_fluxon
from cacheseek.plan.base import REQUIRED_PLAN_CALLS
from cacheseek.plan.fluxon_native import FluxonNativePlanClient, missing_plan_calls
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient, plan_endpoint
from cacheseek.registry import PLAN_CLIENTS

__all__ = ["native_plan_api_problem", "open_fluxon_plan_client"]

log = logging.getLogger(__name__)

_APIS = ("auto", "native", "public")
_NATIVE_OPTIONS = ("table_arena_bytes", "value_bytes", "chunk_bytes")


def native_plan_api_problem() -> Optional[str]:
    """None when the installed fluxon-py's client offers every Plan call; otherwise why not
    (fluxon-py missing, or the calls its client classes lack)."""
    try:
        fluxon_py = load_fluxon()
    except FluxonImportError as exc:
        return str(exc)
    classes = [c for c in vars(fluxon_py).values() if isinstance(c, type)]
    try:
        from fluxon_py.kvclient.fluxon import FluxonKVCacheStore

        classes.append(FluxonKVCacheStore)
    except ImportError:
        pass
    missing = min((missing_plan_calls(c) for c in classes), key=len, default=list(REQUIRED_PLAN_CALLS))
    if not missing:
        return None
    return (f"fluxon-py {getattr(fluxon_py, '__version__', '?')} has no Plan API "
            f"(missing {', '.join(missing)})")


def _public_options() -> list[tuple[str, Any, Any]]:
    return [(f.name, f.type, f.default) for f in dataclasses.fields(PLAN_CLIENTS.schema("fluxon_public"))
            if f.name != "_target_"]


@PLAN_CLIENTS.register("fluxon", keywords=_public_options)
def open_fluxon_plan_client(api: str = "auto", **options: Any) -> Any:
    """The ``fluxon`` Plan client: the native Plan API when the installed fluxon-py has it
    (`FluxonNativePlanClient`), else `FluxonPublicPlanClient`; ``api`` = ``native`` or ``public``
    forces one. ``options`` are `FluxonPublicPlanClient`'s; the native client uses the
    connection options, the time bounds, ``table_arena_bytes`` and the geometry."""
    if api not in _APIS:
        raise ConfigError("store.client_options.api", f"unknown api {api!r}", f"use one of: {', '.join(_APIS)}")
    problem = native_plan_api_problem() if api != "public" else "forced by api=public"
    if api == "native" and problem:
        raise PlanUnavailableError(f"Plan client 'fluxon' with api=native: {problem}")
    if problem is None:
        log.info("Plan client 'fluxon': the installed fluxon-py offers the Plan API: using it natively "
                 "(fluxon_native)")
        return FluxonNativePlanClient(endpoint=plan_endpoint(options),
                                      **{k: options[k] for k in _NATIVE_OPTIONS if k in options})
    log.info("Plan client 'fluxon': %s; emulating it over the public client (fluxon_public: zero-copy "
             "reads, staged writes copied once by Fluxon)", problem)
    return FluxonPublicPlanClient(**options)
