"""The store seams: what the manager asks of a tier, and the optional whole-path capability.

Generic tiers (`TierStore`) keep the per-layer path: ``put_async`` receives a caller-owned CPU
snapshot of each layer (the runtime overwrites its ring right after the hook returns) and calls
``on_ready(handle)`` once every value is durably written; ``get_layer`` returns one layer's
``(k, v)`` or ``None`` when either half is missing (a partial layer is a miss, never a crash).
A generic tier also takes layers that are not ``(k, v)`` pairs (any object, as upstream CacheSeek's
tests store strings) and returns each as it was stored (``BlobHandle.pairs`` is then False).

A generic tier may also offer ``get_layers(requests)``: every ``(handle, layer)`` a restore
reads, in one call, so that it can overlap the reads (`KeyValueTier.read_parallelism`); the
manager then uses it instead of ``get_layer`` (`StoreOffers.reads_layers`).

A store that also satisfies `PathReadStore` (checked with ``isinstance``, a runtime-checkable
Protocol) moves bytes itself: it accepts detached views of the live ring on write
(``accepts_device_views``) and restores a whole window path straight into the runtime's buffers
through a `RestoreTarget` on read. The manager dispatches on that capability.

Write lifecycle (both kinds)::

    put_async(locator, payload, tier=..., on_ready=cb) -> BlobHandle (PENDING)
        success: every value committed -> handle.ready = True -> cb(handle)
        failure: nothing of the blob stays in the store, handle.error set, counted in stats
    free(handle): removes the values (idempotent); raises if removal fails (the caller keeps the blob)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

from cacheseek.kv.handles import BlobHandle, ChunkNode, Tier
from cacheseek.kv.payload import LayerPayload, RestoreTarget

__all__ = ["TierStore", "PathReadStore", "RestoreTarget", "LayerPayload"]


@runtime_checkable
class TierStore(Protocol):
    def put_async(
        self,
        locator: str,
        payload: Sequence[Any],
        *,
        tier: Tier,
        on_ready: Optional[Callable[[BlobHandle], None]] = None,
    ) -> BlobHandle: ...

    def get_layer(self, handle: BlobHandle, layer: int) -> Optional[Any]: ...

    def put_skeleton(self, locator: str, latent: Any) -> None: ...

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any: ...

    def free(self, handle: BlobHandle) -> None: ...

    def flush(self) -> None: ...


@runtime_checkable
class PathReadStore(Protocol):
    """Capability: a store that restores a whole window path in one call."""

    accepts_device_views: bool

    def read_path(
        self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget
    ) -> bool:
        """Fill ``target.latents`` from every node of ``path`` (depth 0..K-1), then the KV of the
        ``window`` nodes into ``target.kv`` following ``target.runs``; synchronize; release
        every view. Returns False (a miss) when a value is missing or only a partial prefix is
        transferable; raises on a store or transfer error. Publishes nothing."""
        ...
