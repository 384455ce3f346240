"""`put_beside_chunk`: a chunk's small companion value (its frames, its decoder state) stored beside
its KV, the one way both are written.

The value goes through the store's latent path (``put_skeleton``), so every store and tier holds
and counts it, but it never evicts KV to make room: a full store drops it. The chunk's KV may be
evicted or invalidated while the value is written; the value then goes too, so no value outlives
the chunk it belongs to."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cacheseek.errors import StoreError

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["put_beside_chunk"]


def put_beside_chunk(ctx: "WorldKVManager", node: Any, locator: str, value: Any, *, what: str, dropped: str,
                     free: Callable[[], None]) -> bool:
    """Store ``value`` (``what`` in the log) under ``locator`` beside chunk ``node``'s KV: True when
    stored and the chunk still holds its KV. A store error counts the metric ``dropped``; a chunk
    whose KV left meanwhile has the value removed again by ``free``. Raises what ``put_skeleton``
    raises beyond a `StoreError`."""
    try:
        ctx.store.put_skeleton(locator, value)
    except StoreError as exc:
        log.info("the %s of %r was not stored: %s", what, node, exc)
        ctx.metrics.add(**{dropped: 1})
        return False
    with ctx.forest.lock:
        gone = node.blob is None or node.blob.error is not None
    if gone:
        free()
        return False
    return True
