"""The Plan tier's side of the Plan client seam: building a client from its registry name, and
the optional calls (`PlanClientInfo`, ``max_plan_values``, ``value_lengths``) probed by
attribute, so that proxies delegating through ``__getattr__`` keep the capability (a Protocol
``isinstance`` would miss them, and costs about 0.3 ms)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from cacheseek.plan.base import PlanClient
from cacheseek.registry import PLAN_CLIENTS

__all__ = ["build_client", "client_fields", "offered", "table_arena"]


def client_fields(name: str) -> set[str]:
    """The option names the client ``name``'s schema takes (none for a client without one)."""
    try:
        return {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(name))}
    except KeyError:
        return set()


def build_client(name: str, given: dict[str, Any], options: Optional[dict[str, Any]]) -> PlanClient:
    """The `PLAN_CLIENTS` entry ``name``, built with those of ``given`` that its schema takes,
    then every one of ``options`` (the store's ``client_options``)."""
    factory = PLAN_CLIENTS.get(name)
    accepted = client_fields(name)
    kwargs = {k: v for k, v in given.items() if k in accepted}
    kwargs.update(options or {})
    return factory(**kwargs)


def offered(client: Any, call: str) -> Optional[Callable[..., Any]]:
    """The client's optional call ``call``, or None when it does not offer it."""
    fn = getattr(client, call, None)
    return fn if callable(fn) else None


def table_arena(client: Any) -> Optional[tuple[int, int]]:
    """Where the client's plan tables live (checked by `decode_plan_table`), when it says."""
    fn = offered(client, "table_arena")
    return fn() if fn is not None else None
