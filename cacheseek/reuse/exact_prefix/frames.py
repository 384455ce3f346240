"""`ChunkFrames`: each chunk's handed-out frames, kept beside its KV (the manager's ``frames``).

A restored chunk hands out the frames a cold run handed out instead of decoding its latent
(`handout.HandOut`). The frames are one value per chunk, ``{hex}:frm`` (`cacheseek.kv.frames`:
bound to the node key, digest-checked on every read), written through the store's small-value
path (``put_skeleton``, as the latent), so every store and tier holds them and counts them in
its capacity. Lifetime:

- written once the chunk's frames are out (after the user has them), off the request path
  (`beside_chunk.write_beside_chunk`): stacked, packed (one digest pass and one copy) and put on
  the store's writer thread, at most ``frames_in_flight`` at a time (more are dropped);
  a store that is full drops them too (counted as ``frames_dropped``: no chunk's KV is evicted
  for frames; the chunk stays cached and its restore decodes). The store's ``flush`` waits for
  them and its ``close`` stops the writer, so a closed store never sees a write arrive. What the
  runtime handed out is read by the writer later, so the runtime never writes to it again (a
  frames tensor on a GPU is read after an event on the stream that made it);
- read when a restored chunk is handed out (`read`): a missing value is ``frames_missing``, a
  value that fails its checks ``frames_corrupt`` (removed; both are misses: the chunk is then
  decoded or computed, never handed out wrong);
- freed with the chunk's KV (eviction, invalidation: `free`), so no frames outlive their chunk.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from cacheseek.errors import CorruptValueError
from cacheseek.kv import frames as frames_value
from cacheseek.kv.frames import FramesSpec
from cacheseek.kv.locators import frames_locator
from cacheseek.reuse.exact_prefix.beside_chunk import FRAMES, write_beside_chunk
from cacheseek.reuse.exact_prefix.decoder_states import free_decoder_state

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

__all__ = ["ChunkFrames", "FramesSpec", "free_frames"]


class ChunkFrames:
    """The frames of each chunk in the manager's store (see the module docstring)."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx

    # -- write ------------------------------------------------------------------------------------

    def write(self, node: Any, frames: Any, device: Any) -> bool:
        """Store the frames of ``node`` (its chunk computed here and ingested) off the request
        path: ``frames`` is the handed-out frames (a tensor, an array, or a callable returning
        one: called on the writer thread), stored on ``device`` (the runtime's, for a store that
        takes device tensors). False when they were not taken (counted as ``frames_dropped``).
        Never raises."""
        ctx = self.ctx
        on_gpu = isinstance(frames, torch.Tensor) and frames.device.type == "cuda"
        work = frames.device if on_gpu else device if ctx.store.accepts_device_views else "cpu"
        return write_beside_chunk(ctx, node, frames_locator(node.node_key),
                                  lambda: _capture(node.node_key, frames, device, ctx.store), FRAMES, device=work,
                                  free=lambda: free_frames(ctx, node.node_key))

    # -- read -----------------------------------------------------------------------------------

    def read(self, node_key: bytes, spec: FramesSpec) -> Any:
        """The frames of chunk ``node_key`` as a host numpy array of ``spec``, or None (missing,
        unreadable, or failing a check: then removed). Never raises."""
        ctx = self.ctx
        loc = frames_locator(node_key)
        try:
            if ctx.store.reads_paths:  # a Plan-style store: read by length, raw bytes back
                value = ctx.store.get_skeleton(loc, nbytes=frames_value.packed_nbytes(spec))
            else:
                value = ctx.store.get_skeleton(loc)
            if value is None:
                ctx.metrics.add(frames_missing=1)
                return None
            out = frames_value.unpack(node_key, value, spec, loc)
        except CorruptValueError as exc:
            log.warning("frames of chunk %s: %s; removed, the chunk is decoded or computed instead",
                        node_key.hex()[:12], exc.problem)
            ctx.metrics.add(frames_corrupt=1)
            self.free(node_key)
            return None
        except Exception as exc:  # noqa: BLE001 - a frames read that fails is a miss
            log.warning("reading the frames of chunk %s failed: %s", node_key.hex()[:12], exc)
            ctx.metrics.add(frames_missing=1)
            return None
        ctx.metrics.add(frames_handed_out=1, frames_read_bytes=int(out.nbytes))
        return out

    # -- free -----------------------------------------------------------------------------------

    def free(self, node_key: bytes) -> None:
        free_frames(self.ctx, node_key)


def _capture(key: bytes, frames: Any, device: Any, store: Any) -> Any:
    """What cannot wait of a frames write: a frames tensor on a GPU marked by an event on the
    stream that made it (the writer copies it once that has passed). Returns the finish (on the
    writer thread): the frames packed (one digest pass and one copy), on ``device`` for a store
    that takes device tensors."""
    ready = None
    if isinstance(frames, torch.Tensor) and frames.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(frames.device))

    def finish() -> Any:
        if ready is not None:
            ready.synchronize()
        value = frames_value.pack(key, frames() if callable(frames) else frames)
        if store.accepts_device_views and str(device) != "cpu":  # on the writer's stream (`side_stream`)
            value = value.to(device)
            torch.cuda.current_stream(value.device).synchronize()
        return value

    return finish


def free_frames(ctx: "WorldKVManager", node_key: bytes) -> None:
    """Remove the frames of chunk ``node_key`` and its decoder state (`decoder_states`), if any
    (idempotent; a failure is logged: a value no node names is removed by the next reconcile).
    Eviction and invalidation call it with the KV's free."""
    if not ctx.store.frees_latents:
        return
    try:
        ctx.store.free_skeleton(frames_locator(node_key))
    except Exception as exc:  # noqa: BLE001
        log.warning("freeing the frames of chunk %s failed: %s", node_key.hex()[:12], exc)
    free_decoder_state(ctx, node_key)
