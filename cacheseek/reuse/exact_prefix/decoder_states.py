"""`ChunkDecoderStates`: the decoder's causal state stored at chosen chunks (``decoder_state_every``).

At a served session's divergence (`handout.HandOut`) the decoder must hold what a cold run's
decoder held before the chunk it computes. Rebuilt, that costs one decode per served chunk (the
default at ``decoder_state_every=0``); stored, it costs the state's bytes per resume point (the Wan
VAE's feature cache: 1.76 GiB at 480p) and one copy back. With ``decoder_state_every=N`` the state
after chunk ``j`` is stored for ``(j + 1) % N == 0`` (chunks N-1, 2N-1, ...); at divergence before
chunk ``idx`` the nearest stored state at or below ``idx - 1`` is loaded and only the chunks after
it are decoded again. `experiments/session_reuse` has the table (bytes against seconds).

The state is one value per chunk, ``{hex}:dec`` (`cacheseek.kv.decoder_state`: bound to the node
key, digest-checked on every read), written through the store's small-value path as the frames
are, off the request path (copied on its device at once, since the decoder overwrites it; sealed
and put on the store's writer thread, at most ``decoder_states_in_flight`` states held: one more
is dropped), counted in its capacity, never evicting KV to make room (a full store drops it:
``decoder_states_dropped``), freed with the chunk (`frames.free_frames` frees both). A missing
state is ``decoder_states_missing``, a damaged one ``decoder_states_corrupt`` (removed): both fall
back to the next lower resume point, then to the replay; a wrong state is never loaded.

`cacheseek.kv.runtime_decoder.RuntimeDecoder` is the runtime's side of the seam.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

import torch

from cacheseek.errors import CorruptValueError
from cacheseek.kv import decoder_state as state_value
from cacheseek.kv.decoder_state import DecoderStateSpec
from cacheseek.kv.locators import decoder_state_locator
from cacheseek.kv.runtime_decoder import RuntimeDecoder
from cacheseek.reuse.exact_prefix.beside_chunk import DECODER_STATES, write_beside_chunk

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["ChunkDecoderStates", "LateState", "RuntimeDecoder", "DecoderStateSpec", "resume_points"]


def resume_points(every: int, below: int) -> list[int]:
    """The chunks ``j < below`` whose state is stored at ``every``, nearest first."""
    if every <= 0:
        return []
    return [j for j in range(below - 1, -1, -1) if (j + 1) % every == 0]


class ChunkDecoderStates:
    """The decoder states of chunks in the manager's store (see the module docstring)."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx

    def write(self, node: Any, entries: list, device: Any) -> bool:
        """Store ``entries`` (the decoder's state after chunk ``node``, computed here) on
        ``device`` off the request path: here the state is copied into one value on its device
        (queued on the current stream, before the decoder's next decode overwrites it); its
        digest, header and put run on the store's writer thread (`beside_chunk`). False when not
        taken (counted as ``decoder_states_dropped``: the writer holds as many states as it may,
        the store is closed). Never raises."""
        ctx = self.ctx

        def capture() -> Any:
            snap = state_value.snapshot(node.node_key, entries, device)
            return lambda: _finish(snap, ctx.store)

        return write_beside_chunk(ctx, node, decoder_state_locator(node.node_key), capture, DECODER_STATES,
                                  device=device, free=lambda: free_decoder_state(ctx, node.node_key))

    def read(self, node_key: bytes, spec: DecoderStateSpec, device: Any) -> Optional[list]:
        """The decoder state stored after chunk ``node_key`` on ``device``, or None (missing,
        unreadable, or failing a check: then removed). Never raises."""
        ctx = self.ctx
        loc = decoder_state_locator(node_key)
        owned = False
        try:
            if ctx.store.reads_paths:  # a Plan-style store: read by length into a fresh device tensor
                value = ctx.store.get_skeleton(loc, like=state_value.empty_like_spec(spec, device))
                owned = True
            else:
                value = ctx.store.get_skeleton(loc)
            if value is None:
                ctx.metrics.add(decoder_states_missing=1)
                return None
            out = state_value.unpack(node_key, value, spec, loc, device, owned=owned)
        except CorruptValueError as exc:
            log.warning("decoder state after chunk %s: %s; removed, the decoder is rebuilt instead",
                        node_key.hex()[:12], exc.problem)
            ctx.metrics.add(decoder_states_corrupt=1)
            free_decoder_state(ctx, node_key)
            return None
        except Exception as exc:  # noqa: BLE001 - a read that fails is a miss
            log.warning("reading the decoder state after chunk %s failed: %s", node_key.hex()[:12], exc)
            ctx.metrics.add(decoder_states_missing=1)
            return None
        ctx.metrics.add(decoder_states_restored=1,
                        decoder_state_read_bytes=sum(t.numel() * t.element_size() for t in out
                                                     if isinstance(t, torch.Tensor)))
        return out


class LateState:
    """The decoder's state at a divergence, read and checked while the chunk computes.

    Made by the binding as the session materializes (`HandOut.next_chunk`) for a decoder that
    loads late (`RuntimeDecoder.loads_late`): the nearest stored state at or below the last
    served chunk is read on a reader thread (on a GPU on a stream of its own, waited for there)
    and its digest checked; a missing or damaged one falls back to the next lower resume point,
    then to none. The runtime calls `catch_up` right before the decoder's first use (after the
    chunk's denoising): it waits for the read (bounded: ``wait_s``, past it a miss), loads the
    state and decodes the served latents after it, in order, or all of them when none was found.
    A state that fails its check is never loaded: the replay rebuilds the decoder instead."""

    def __init__(self, future: Any, latents: tuple, metrics: Any, wait_s: float) -> None:
        self.future = future
        self.latents = latents  # chunks 0..idx-1, every one the replay may need
        self.metrics = metrics
        self.wait_s = wait_s
        self.caught_up = False

    def result(self) -> tuple[int, Optional[list]]:
        """``(start, state)``: the state after chunk ``start - 1`` (None, 0: none found in time)."""
        try:
            return self.future.result(timeout=self.wait_s)
        except Exception as exc:  # noqa: BLE001 - a read not done in time, or failed, is a miss
            log.warning("the decoder's stored state was not read in %.0f s (%r): the decoder is rebuilt",
                        self.wait_s, exc)
            self.metrics.add(decoder_states_missing=1)
            return 0, None

    def catch_up(self, decoder: RuntimeDecoder, decode: Callable[[Any, bool], Any]) -> None:
        """Before the decoder's first use: load the state read (``decoder.load``), then
        ``decode(latent, first)`` each served latent after it, in order (once)."""
        if self.caught_up:
            return
        self.caught_up = True
        start, state = self.result()
        if state is not None:
            for t in state:  # made on the reader's stream, used on this one from now on
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(torch.cuda.current_stream(t.device))
            decoder.load(state)
        self.metrics.add(decoder_replays=len(self.latents) - start)
        for j in range(start, len(self.latents)):
            decode(self.latents[j], j == 0)


_reader: list = []
_reader_lock = threading.Lock()


def reader() -> ThreadPoolExecutor:
    """The process's reader of decoder states at divergence (one thread, started on first use)."""
    with _reader_lock:
        if not _reader:
            _reader.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheseek-decoder-state-read"))
        return _reader[0]


def _finish(snap: state_value.Snapshot, store: Any) -> Any:
    """On the writer thread: the state's value sealed (its copies waited for, its check computed
    over exactly the bytes stored), on the host for a store that takes no device tensors."""
    value = snap.seal()
    if not store.accepts_device_views and value.device.type != "cpu":
        value = value.cpu()
    return value


def free_decoder_state(ctx: "WorldKVManager", node_key: bytes) -> None:
    """Remove the decoder state stored after chunk ``node_key`` (idempotent; a failure is logged)."""
    try:
        ctx.store.free_skeleton(decoder_state_locator(node_key))
    except Exception as exc:  # noqa: BLE001
        log.warning("freeing the decoder state of chunk %s failed: %s", node_key.hex()[:12], exc)
