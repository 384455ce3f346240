"""`PrefixWindow`: a new session's longest cached prefix, restored when the session is created.

The manager's `Restorer` fills it (``restore_target`` for a whole-path store, which copies the
window's runs straight into the ring; ``seed_latents`` and ``seed_layer`` for a generic tier),
then calls ``set_resume_depth``, the single publication point: only then are the cursors of every
layer, the cached latents (decode only), the RNG advance of K computed chunks and the binding's
``last_fast_forward`` set. Ring slots written before a failure lie beyond the published cursors
(a new session's are 0), so the runtime's state (cursors, ``ring[:local_end]``, latents, RNG) is
exactly as before. Shapes: per layer K and V ``[1, c * ft, H, D]`` in the ring's dtype, the
latents in the runtime's latent spec and the dtype they were stored with.

A live session's chunks, restored one at a time mid-session, use `chunk_window.ChunkWindow`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from cacheseek.errors import CacheSeekError, GeometryError, LayoutMismatchError
from cacheseek.kv.payload import RestoreTarget
from cacheseek.reuse.exact_prefix.chunk_window import RingWindow, advance_rng, check_latents

__all__ = ["PrefixWindow"]


class PrefixWindow(RingWindow):
    """The restore target of a session's cached prefix (see the module docstring). ``layout``:
    the runtime's layout adapter; ``ring``: its `RingGeometry`; ``on_published(K)``: called at
    publication with the number of chunks restored (the binding's ``last_fast_forward``)."""

    def __init__(self, layout: Any, runtime: Any, ring: Any, on_published: Callable[[int], None]) -> None:
        super().__init__(layout, runtime, ring)
        self.on_published = on_published
        self.latents: list[Any] = []

    # generic tiers -------------------------------------------------------------------------

    def seed_latents(self, latents: Sequence[Any]) -> None:
        spec = self.layout.latent_spec(self.runtime)
        check_latents(spec, latents)  # the dtype is as stored: the model's x0, whatever the ring's
        self.latents = [lat.to(spec.device, copy=True) for lat in latents]

    def seed_layer(self, layer: int, blobs: list[tuple[int, Any]], depth: int) -> None:
        k_ring, v_ring = self.layout.layers(self.runtime)[layer]
        by_depth = dict(blobs)
        expected = (1, self.ring.chunk_size * self.ring.frame_tokens, k_ring.shape[2], k_ring.shape[3])
        for d, (k, v) in blobs:
            for t in (k, v):
                if tuple(t.shape) != expected or t.dtype != k_ring.dtype:
                    raise LayoutMismatchError(f"layer {layer} chunk {d}: stored {tuple(t.shape)} "
                                              f"{t.dtype}, ring expects {expected} {k_ring.dtype}", depth=d)
        for run in self.ring.restore_runs(depth + 1):  # depth: of the deepest restored node
            k, v = by_depth[run.chunk_depth]
            src = slice(run.src_token, run.src_token + run.n_tokens)
            dst = slice(run.dst_token, run.dst_token + run.n_tokens)
            k_ring[:, dst].copy_(k[:, src])
            v_ring[:, dst].copy_(v[:, src])
            self.bytes_restored += 2 * run.n_tokens * self.layout.token_bytes(self.runtime)

    # whole-path stores ----------------------------------------------------------------------

    def restore_target(self, depth: int, window_depths: Sequence[int]) -> RestoreTarget:
        if list(window_depths) != self.ring.window_depths(depth):
            raise GeometryError("manager.window_chunks",
                                f"window path {list(window_depths)} != ring window {self.ring.window_depths(depth)}")
        rt = self.runtime
        spec = self.layout.latent_spec(rt)
        self.latents = [torch.empty(spec.shape, dtype=spec.dtype, device=spec.device) for _ in range(depth)]
        runs = self.ring.restore_runs(depth)
        token_bytes = self.layout.token_bytes(rt)
        kv = tuple(self.layout.layers(rt))
        self.bytes_restored = sum(2 * r.n_tokens for r in runs) * token_bytes * len(kv)
        return RestoreTarget(kv=kv, runs=runs, window_depths=tuple(window_depths), token_bytes=token_bytes,
                             chunk_tokens=self.ring.chunk_size * self.ring.frame_tokens, latents=tuple(self.latents))

    # publication ----------------------------------------------------------------------------

    def set_resume_depth(self, depth: int) -> None:
        """The single publication point of a restore; ``depth`` is the deepest restored node's."""
        rt = self.runtime
        depth += 1  # from here on: K, the number of restored chunks
        if len(self.latents) != depth:
            raise CacheSeekError(f"restore of depth {depth} has {len(self.latents)} latents")
        global_end, local_end = self.ring.cursors(depth)
        layout = self.layout
        advance_rng(layout, rt, self.latents)  # a cold chunk re-noises its x0: x0's shape and dtype
        # Nothing below can fail: cursors, latents and the depth are published together.
        layout.set_cursors(rt, global_end, local_end)
        layout.publish_latents(rt, self.latents)
        self.on_published(depth)
