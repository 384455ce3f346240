"""`ChunkWindow`: one chunk of a live session restored instead of computed.

A live session streams one control per chunk. While it follows a cached path (its trie cursor at
depth ``i - 1`` and a ready child for chunk ``i``'s key) the binding restores chunk ``i`` alone,
before the chunk runs. The runtime then holds exactly what a cold run holds before chunk ``i``
(every earlier chunk was computed or restored), so the restore is exact when it leaves what a
computed chunk ``i`` leaves:

- the chunk's stored KV (the clean rewrite) where the DiT writes it, with the DiT's roll rule,
  and both cursors advanced (`RingLayout.append_chunk`);
- the RNG draws of a computed chunk (`advance_rng`: ``len(timesteps) - 1`` draws of x0's shape
  and dtype on the denoiser's generator);
- the stored latent as chunk ``i``'s cached latent: the runtime decodes it instead of denoising
  (or, on TeleFuser main, the latent its denoise call returns: ``publish_latent=False``).

Lifetime of one restore (the manager's `Restorer` with ``chunk_only``): the chunk's values are
fetched into staging first, where nothing of the runtime is touched: a whole-path store copies
into device buffers of one chunk leased from `StagingPool` (``restore_target``), a generic tier
hands owned tensors (``seed_latents``, ``seed_layer``). So a miss or a store failure leaves the
runtime as a cold chunk finds it, and the chunk is computed. Then ``set_resume_depth``, the single
publication point, draws (rolled back if a draw fails), appends, publishes. Shapes: per layer K and
V ``[1, c * ft, H, D]`` in the ring's dtype; the latent in the runtime's latent spec.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from cacheseek.errors import CacheSeekError, GeometryError, LayoutMismatchError
from cacheseek.kv.payload import RestoreTarget
from cacheseek.kv.ring import CopyRun
from cacheseek.reuse.exact_prefix.keys import node_key
from cacheseek.reuse.exact_prefix.restore import RestoreWindow

__all__ = ["RingWindow", "ChunkWindow", "StagingPool", "STAGING", "advance_rng", "check_latents", "node_problem"]


def node_problem(layout: Any, runtime: Any, ring: Any, node: Any, in_window: bool) -> Optional[str]:
    """Why the binding cannot restore ``node`` (None: it can): its key is not the binding's
    ``node_key(parent, action)``, or (a window node) its blob does not fit the runtime: layer
    count, (K, V) pairs, a chunk's bytes (0: not recorded)."""
    parent = node.parent
    if parent is None or not isinstance(node.action, bytes) or node.node_key != node_key(parent.node_key, node.action):
        return "its key is not node_key(parent, action)"
    if not in_window:
        return None
    blob = node.blob
    n_layers = len(layout.layers(runtime))
    if blob.n_layers != n_layers:
        return f"its blob has {blob.n_layers} layers, the runtime {n_layers}"
    if not blob.pairs:
        return "its blob's layers are not (K, V) pairs"
    want = n_layers * 2 * ring.chunk_size * ring.frame_tokens * layout.token_bytes(runtime)
    if blob.nbytes not in (0, want):
        return f"its blob has {blob.nbytes} bytes, a chunk of the runtime {want}"
    return None


def check_latents(spec: Any, latents: Sequence[Any]) -> None:
    """Stored latents in the runtime's latent shape, in one floating dtype (the model's x0)."""
    for i, lat in enumerate(latents):
        if tuple(lat.shape) != spec.shape or not lat.dtype.is_floating_point or lat.dtype != latents[0].dtype:
            raise LayoutMismatchError(f"latent {i}: stored {tuple(lat.shape)} {lat.dtype}, the runtime "
                                      f"expects {spec.shape} in one floating dtype for the whole path")


def advance_rng(layout: Any, runtime: Any, latents: Sequence[Any]) -> None:
    """The denoiser's re-noise draws of one computed chunk per latent (``len(timesteps) - 1``
    draws of its shape and dtype); on a failure the generator is put back as it was."""
    draws = max(len(layout.timesteps(runtime)) - 1, 0)
    gen = layout.generator(runtime)
    state = gen.get_state()
    try:
        for lat in latents:
            for _ in range(draws):
                torch.randn(tuple(lat.shape), generator=gen, dtype=lat.dtype, device=gen.device)
    except BaseException:
        gen.set_state(state)
        raise


class StagingPool:
    """Device buffers for one chunk's KV, per (device, layers, shape, dtype), leased to one
    restore at a time (a lease waits for the one before it: restores of one chunk take
    milliseconds, and one chunk at 480p is 3.57 GiB, too much to keep per session). A lease
    ends only after the leasing thread's current stream has finished its work (the ring append
    reads the buffers there), so the next lessee, on whatever stream, writes into idle buffers.
    The buffers stay until `clear` (a binding's ``close`` calls it): freed, they go back to
    torch's caching allocator."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[threading.Lock, list]] = {}

    @contextlib.contextmanager
    def lease(self, device: Any, n_layers: int, shape: tuple[int, ...], dtype: Any) -> Iterator[list]:
        key = (str(device), n_layers, tuple(shape), str(dtype))
        with self._lock:
            entry = self._entries.setdefault(key, (threading.Lock(), []))
        lock, buffers = entry
        with lock:
            if not buffers:
                buffers.extend((torch.empty(shape, dtype=dtype, device=device),
                                torch.empty(shape, dtype=dtype, device=device)) for _ in range(n_layers))
            try:
                yield buffers
            finally:
                if buffers[0][0].is_cuda:
                    torch.cuda.current_stream(buffers[0][0].device).synchronize()

    def clear(self) -> None:
        """Free every buffer not leased now (the next lease allocates again)."""
        with self._lock:
            entries = list(self._entries.items())
        for key, (lock, buffers) in entries:
            if lock.acquire(blocking=False):
                try:
                    buffers.clear()
                finally:
                    lock.release()


STAGING = StagingPool()


class RingWindow(RestoreWindow):
    """A restore target in a runtime's ring, through its layout adapter (``layout``); ``ring``:
    its `RingGeometry`. What the two windows share; each publishes in its own way."""

    restores_paths = True

    def __init__(self, layout: Any, runtime: Any, ring: Any) -> None:
        self.layout, self.runtime, self.ring = layout, runtime, ring
        self.bytes_restored = 0

    def node_problem(self, node: Any, in_window: bool) -> Optional[str]:
        """Why ``node`` cannot be restored here (`node_problem`); None: it can."""
        return node_problem(self.layout, self.runtime, self.ring, node, in_window)


class ChunkWindow(RingWindow):
    """The restore target of chunk ``idx`` of a live session (see the module docstring).
    ``staging``: device buffers per layer ``(k, v)`` for a whole-path store, None otherwise."""

    def __init__(self, layout: Any, runtime: Any, ring: Any, idx: int, staging: Any = None, *,
                 publish_latent: bool = True) -> None:
        super().__init__(layout, runtime, ring)
        self.publish_latent = publish_latent  # False: the caller hands the latent to the runtime itself
        self.idx = idx
        self.staging = staging
        self.chunk_tokens = ring.chunk_size * ring.frame_tokens
        self.values: list[tuple[Any, Any]] = []
        self.latent: Any = None
        self.published = False
        if layout.cursors(runtime)[0] != ring.cursors(idx):  # the ring must hold chunks 0..idx-1
            raise GeometryError("runtime", f"chunk {idx}: the ring's cursors {layout.cursors(runtime)[0]} are "
                                f"not those of {idx} chunks {ring.cursors(idx)}")

    # generic tiers -------------------------------------------------------------------------

    def seed_latents(self, latents: Sequence[Any]) -> None:
        spec = self.layout.latent_spec(self.runtime)
        if len(latents) != 1:
            raise CacheSeekError(f"chunk {self.idx}: {len(latents)} latents for one chunk")
        check_latents(spec, latents)
        self.latent = latents[0].to(spec.device, copy=True)

    def seed_layer(self, layer: int, blobs: list[tuple[int, Any]], depth: int) -> None:
        k_ring, _ = self.layout.layers(self.runtime)[layer]
        if depth != self.idx or [d for d, _ in blobs] != [self.idx] or layer != len(self.values):
            raise CacheSeekError(f"chunk {self.idx}: seeded depth {depth}, chunks {[d for d, _ in blobs]}, "
                                 f"layer {layer} after {len(self.values)}")
        k, v = blobs[0][1]
        want = (1, self.chunk_tokens, k_ring.shape[2], k_ring.shape[3])
        for t in (k, v):
            if tuple(t.shape) != want or t.dtype != k_ring.dtype:
                raise LayoutMismatchError(f"layer {layer} chunk {self.idx}: stored {tuple(t.shape)} {t.dtype}, "
                                          f"the ring takes {want} {k_ring.dtype}", depth=self.idx)
        self.values.append((k.to(k_ring.device), v.to(k_ring.device)))
        self.bytes_restored += 2 * int(k.numel() * k.element_size())

    # whole-path stores ----------------------------------------------------------------------

    def restore_target(self, depth: int, window_depths: Sequence[int]) -> RestoreTarget:
        if self.staging is None or depth != 1 or list(window_depths) != [self.idx]:
            raise CacheSeekError(f"chunk {self.idx}: a one-chunk target for a path of {depth}, window "
                                 f"{list(window_depths)}, staging {'given' if self.staging else 'none'}")
        spec = self.layout.latent_spec(self.runtime)
        self.latent = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        self.values = list(self.staging)
        token_bytes = self.layout.token_bytes(self.runtime)
        self.bytes_restored = 2 * self.chunk_tokens * token_bytes * len(self.values)
        return RestoreTarget(kv=tuple(self.values), runs=(CopyRun(self.idx, 0, 0, self.chunk_tokens),),
                             window_depths=(self.idx,), token_bytes=token_bytes,
                             chunk_tokens=self.chunk_tokens, latents=(self.latent,))

    # publication ----------------------------------------------------------------------------

    def set_resume_depth(self, depth: int) -> None:
        """The single publication point; ``depth`` is the restored node's, chunk ``idx``."""
        if depth != self.idx or self.latent is None or not self.values:
            raise CacheSeekError(f"chunk {self.idx}: publication of depth {depth} with "
                                 f"{'a' if self.latent is not None else 'no'} latent, {len(self.values)} layers")
        gen = self.layout.generator(self.runtime)
        state = gen.get_state()
        advance_rng(self.layout, self.runtime, [self.latent])
        ring_k = self.layout.layers(self.runtime)[0][0]
        try:
            with torch.inference_mode(ring_k.is_inference()):  # written in the mode it was made in
                self.layout.append_chunk(self.runtime, self.values)  # checks first; a mismatch writes nothing
        except BaseException:
            gen.set_state(state)
            raise
        if self.publish_latent:
            self.layout.cached_latents(self.runtime)[self.idx] = self.latent
        self.published = True
