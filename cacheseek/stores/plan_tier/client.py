"""The Plan tier's side of the Plan client seam: building a client from its registry name, and
`ClientCalls`, the optional calls it offers, resolved once when the tier is built."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import attrs

from cacheseek.plan.base import PlanClient
from cacheseek.registry import PLAN_CLIENTS

__all__ = ["ClientCalls", "build_client", "client_fields", "offered"]


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


@attrs.frozen
class ClientCalls:
    """The optional calls of one Plan client (`PlanClientInfo`, `PlanSegmentPieces`,
    ``max_plan_values``), each None where the client does not offer it. Probed by attribute, so
    that proxies delegating through ``__getattr__`` keep them (a Protocol ``isinstance`` would
    miss them)."""

    table_arena: Optional[Callable[[], Optional[tuple[int, int]]]] = None
    usage: Optional[Callable[[], Any]] = None
    segment_timers: Optional[Callable[[], Any]] = None
    max_plan_values: Optional[Callable[[int], int]] = None
    map_local_segments: Optional[Callable[[], list]] = None
    fault_local_range: Optional[Callable[[int, int], None]] = None

    @classmethod
    def of(cls, client: Any) -> "ClientCalls":
        return cls(**{f.name: offered(client, f.name) for f in attrs.fields(cls)})

    def arena(self) -> Optional[tuple[int, int]]:
        """Where the client's plan tables live now (checked by `decode_plan_table`), when it says."""
        return self.table_arena() if self.table_arena is not None else None
