"""`write_beside_chunk` and `put_beside_chunk`: a chunk's companion value (its frames, its decoder
state) stored beside its KV, the one way both are written.

`write_beside_chunk` takes what the caller captured at that moment and finishes the value (its
copies waited for, its digest, its header) and stores it on the store's writer thread
(`TierStore.write_beside`), off the request path: at most ``manager.frames_in_flight`` frames
and ``manager.decoder_states_in_flight`` decoder states in flight; past it the value is dropped
and counted, the caller never waits. 0 writes them in the caller's thread, as before.

The value goes through the store's latent path (``put_skeleton``), so every store and tier holds
and counts it, but it never evicts KV to make room: a full store drops it. A store's put is its
commit point: the value is findable only once whole (packed and checked before it is put). The
chunk's KV may be evicted or invalidated while the value is written; the value then goes too
(or is never put), so no value outlives the chunk it belongs to."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch

from cacheseek.errors import StoreError

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["put_beside_chunk", "write_beside_chunk", "BesideKind", "FRAMES", "DECODER_STATES"]


@attrs.frozen
class BesideKind:
    """One kind of value kept beside a chunk: its name on the writer (``kind``: the in-flight
    bound counts per kind), how the log names it and its `CacheMetrics` counters."""

    kind: str
    what: str
    written: str
    write_bytes: str
    dropped: str


FRAMES = BesideKind("frames", "frames (its restore decodes)", "frames_written", "frames_write_bytes", "frames_dropped")
DECODER_STATES = BesideKind("decoder_state", "decoder state (a divergence there replays)", "decoder_states_written",
                            "decoder_state_write_bytes", "decoder_states_dropped")


def write_beside_chunk(ctx: "WorldKVManager", node: Any, locator: str, capture: Callable[[], Callable[[], Any]],
                       kind: BesideKind, *, device: Any, free: Callable[[], None]) -> bool:
    """Store a value under ``locator`` beside chunk ``node``'s KV (see the module docstring):
    ``capture()``, in this thread once the writer has a place, takes what cannot wait and
    returns ``finish``; ``finish()``, on the store's writer thread, returns the value, whole and
    checked. False when refused (the writer holds ``ctx.beside_in_flight[kind.kind]`` values of
    this kind already, or the store is closed; nothing captured) or the capture failed: counted as
    ``kind.dropped``. Never raises; a failure of the write itself is logged and counted on the
    writer's thread. ``device``: where the value is made; on a GPU the writer's work there runs
    on a stream of its own (`side_stream`), never behind the runtime's queued work."""

    def start() -> Callable[[], None]:
        finish = capture()
        return lambda: job(finish)

    def job(finish: Callable[[], Any]) -> None:
        try:
            if _gone(ctx, node):  # the chunk left before the write's turn: nothing to write
                return
            with side_stream(device):
                value = finish()
                stored = put_beside_chunk(ctx, node, locator, value, what=kind.what, dropped=kind.dropped, free=free)
            if stored:
                ctx.metrics.add(**{kind.written: 1, kind.write_bytes: int(value.numel())})
        except Exception:  # noqa: BLE001 - not stored: its reader finds it missing
            log.exception("writing the %s of %r failed", kind.what, node)
            ctx.metrics.add(**{kind.dropped: 1})

    try:
        if ctx.store.write_beside(start, kind=kind.kind, limit=ctx.beside_in_flight[kind.kind]):
            return True
    except Exception:  # noqa: BLE001 - a cache must never take a session down
        log.exception("capturing the %s of %r failed", kind.what, node)
    ctx.metrics.add(**{kind.dropped: 1})
    return False


@contextlib.contextmanager
def side_stream(device: Any) -> Iterator[None]:
    """On a GPU ``device``: the block runs on a fresh stream of that device (torch's pool: not
    ordered after the runtime's default stream, so a copy there never waits for the model's
    queued work), waited for at the end; elsewhere as it is."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


def _gone(ctx: "WorldKVManager", node: Any) -> bool:
    with ctx.forest.lock:
        return node.blob is None or node.blob.error is not None


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
    if _gone(ctx, node):
        free()
        return False
    return True
