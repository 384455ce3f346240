"""The Plan tier's side of the Plan client seam: `ClientOptions`, building a client from its
registry name, `ClientCalls`, the optional calls it offers, and `client_records`, the chunk
records it offers, both resolved once when the tier is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import attrs

from cacheseek.errors import ConfigError
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.plan.base import PlanClient
from cacheseek.registry import PLAN_CLIENTS

__all__ = ["ClientCalls", "ClientOptions", "build_client", "client_fields", "client_records", "given_options",
           "offered"]


def client_fields(name: str) -> set[str]:
    """The option names the client ``name``'s schema takes."""
    return {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(name)) if f.name != "_target_"}


def _options_schema() -> type:
    """Every Plan client's options in one dataclass (``store.client_options.*``), so that Hydra
    checks their types whichever client is chosen: a field per option of any client, typed as
    that client's schema types it (``Any`` where two disagree), None where the client's own
    default holds."""
    types: dict[str, Any] = {}
    for name in PLAN_CLIENTS.names():
        for f in dataclasses.fields(PLAN_CLIENTS.schema(name)):
            if f.name != "_target_":
                types[f.name] = f.type if types.get(f.name, f.type) == f.type else Any
    return dataclasses.make_dataclass("ClientOptions", [
        (name, Any if typ is Any else Optional[typ], dataclasses.field(default=None))
        for name, typ in sorted(types.items())])


ClientOptions = _options_schema()
ClientOptions.__module__ = __name__


def given_options(options: Union[ClientOptions, dict[str, Any], None]) -> dict[str, Any]:
    """The options given (not None) in a `ClientOptions` or a plain dict of them."""
    items = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})
    return {k: v for k, v in items.items() if v is not None}


def build_client(name: str, given: dict[str, Any], options: Union[ClientOptions, dict[str, Any], None]) -> PlanClient:
    """The `PLAN_CLIENTS` entry ``name``, built with those of ``given`` that its schema takes,
    then every option given (the store's ``client_options``)."""
    accepted = client_fields(name)
    kwargs = {k: v for k, v in given.items() if k in accepted}
    kwargs.update(given_options(options))
    for key in sorted(set(kwargs) - accepted):
        raise ConfigError(f"store.client_options.{key}", f"the {name!r} Plan client has no option {key!r}",
                          f"use one of: {', '.join(sorted(accepted))}")
    return PLAN_CLIENTS.get(name)(**kwargs)


def client_records(client: Any) -> ChunkRecords:
    """The chunk records ``client`` offers (`PlanSharedRecords`: a Fluxon cluster's), or
    `NO_RECORDS` (an embedded client lives in one process). Read by attribute, like `ClientCalls`,
    so proxies that delegate through ``__getattr__`` keep them."""
    records = getattr(client, "records", None)
    return records if isinstance(records, ChunkRecords) else NO_RECORDS


def offered(client: Any, call: str) -> Optional[Callable[..., Any]]:
    """The client's optional call ``call``, or None when it does not offer it."""
    fn = getattr(client, call, None)
    return fn if callable(fn) else None


@attrs.frozen
class ClientCalls:
    """The optional calls of one Plan client (`PlanClientInfo`, `PlanSegmentPieces`,
    `PlanValueLengths`, ``max_plan_values``), each None where the client does not offer it. Probed by attribute, so
    that proxies delegating through ``__getattr__`` keep them (a Protocol ``isinstance`` would
    miss them)."""

    table_arena: Optional[Callable[[], Optional[tuple[int, int]]]] = None
    usage: Optional[Callable[[], Any]] = None
    segment_timers: Optional[Callable[[], Any]] = None
    max_plan_values: Optional[Callable[[int], int]] = None
    map_local_segments: Optional[Callable[[], list]] = None
    fault_local_range: Optional[Callable[[int, int], None]] = None
    value_lengths: Optional[Callable[[Any], Sequence[int]]] = None

    @classmethod
    def of(cls, client: Any) -> "ClientCalls":
        return cls(**{f.name: offered(client, f.name) for f in attrs.fields(cls)})

    def arena(self) -> Optional[tuple[int, int]]:
        """Where the client's plan tables live now (checked by `decode_plan_table`), when it says."""
        return self.table_arena() if self.table_arena is not None else None
