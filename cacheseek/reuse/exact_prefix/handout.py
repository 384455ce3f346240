"""`HandOut`: a session on a cached path hands out stored frames; KV moves only where it computes.

A runtime that hands out frames (the TeleFuser seams of the release and the hooked commit, the
synthetic runtime) says so with ``accept_handout()`` before each session's ``on_runtime_created``
and asks, before each chunk ``idx``, ``next_chunk(runtime, idx, spec) -> NextChunk``:

- ``frames``: the chunk is on the session's served path (a planned session's cached prefix found
  at creation, or a live session's chunk whose cached child `LiveChunks` found as its control
  arrived) and its stored frames (`frames.ChunkFrames`, checked against the chunk's key and
  digest) are here: the runtime hands them out and runs nothing of the chunk (no DiT, no decode);
- ``replay``: the session is about to compute (or decode) chunk ``idx`` after serving chunks
  0..idx-1 from frames: the served path was just *materialized* (its window's KV, the cursors,
  the RNG draws and the latents restored into the runtime, as a creation-time restore does, by
  `PrefixWindow`), and the runtime decodes these latents of chunks 0..idx-1 first, in order and
  discarding the frames, so that its decoder's causal state is a cold run's. With
  ``decoder_state_every=N`` (`decoder_states`) the decoder's state stored after the nearest
  resume point ``s <= idx - 1`` comes with them (``decoder_state``, loaded first) and only the
  latents of chunks ``s+1..idx-1`` are decoded (``replay_from = s + 1``); a state missing or
  damaged falls back to the next lower one, then to all of them (`experiments/session_reuse` has
  the table: bytes stored against seconds replayed). A decoder that loads late
  (``RuntimeDecoder.loads_late``) gets ``late_state`` instead (`decoder_states.LateState`): the
  read starts now on a reader thread and the runtime catches the decoder up right before its
  first use, after the chunk's denoising, so the read overlaps the chunk's compute. Latents of
  served chunks beyond ``idx`` stay the runtime's cached latents (decoded, as today's restore
  does);
- ``recompute``: the served path could not be materialized (its KV was evicted or lost since the
  lookup): the runtime computes chunks 0..idx-1 again, discarding their frames (already handed
  out), with these controls (None: the planned one), then chunk ``idx``. Correct, slow, counted;
- neither: compute as usual (a session that has computed keeps today's eager restores).

So a full hit never touches the ring, and a session materializes at most once, at its first
divergence. Nothing is looked up or restored for a runtime that did not accept: TeleFuser main
(its decode runs in its actors) and callers that drive a binding themselves keep the eager
creation-time restore.

Per request the binding counts ``frames_served`` (chunks handed out from frames),
``chunks_materialized`` (chunks of KV restored at divergence) and ``chunks_computed``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch

from cacheseek.kv.frames import FramesSpec
from cacheseek.kv.runtime_decoder import RuntimeDecoder
from cacheseek.reuse.exact_prefix.beside_chunk import side_stream
from cacheseek.reuse.exact_prefix.decoder_states import ChunkDecoderStates, LateState, reader, resume_points
from cacheseek.reuse.exact_prefix.prefix_window import PrefixWindow

log = logging.getLogger("cacheseek.reuse.exact_prefix.telefuser_lingbot")

__all__ = ["HandOut", "NextChunk", "FramesSpec", "RuntimeDecoder"]

NO_DECODER = RuntimeDecoder()
LATE_WAIT_S = 60.0  # the longest a decoder waits for its state read at divergence (past it: replayed)


@attrs.frozen
class NextChunk:
    """What the runtime does with its next chunk (see the module docstring): ``replay`` holds
    the latents of chunks ``replay_from..idx-1``, decoded after ``decoder_state`` (when not None)
    is loaded into the decoder. For a decoder that loads late, ``late_state`` (a
    `decoder_states.LateState`, being read) replaces both: the runtime calls its ``catch_up``
    right before the decoder's first use."""

    frames: Any = None
    replay: tuple = ()
    recompute: tuple = ()
    replay_from: int = 0
    decoder_state: Any = None
    late_state: Any = None

    @property
    def handed_out(self) -> bool:
        return self.frames is not None


COMPUTE = NextChunk()


class HandOut:
    """The frames role of the binding (a mixin of `LingBotWorldKVBinding`; see the module
    docstring). Reads the binding's ``manager``, ``layout``, ``ring``, ``_ns``, ``_cursor``,
    ``last_fast_forward``, ``_restored``, ``bytes_restored``."""

    _handout = False  # the runtime of the coming session hands out frames
    handout_enabled = True
    decoder_state_every = 0  # store the decoder's state after chunks N-1, 2N-1, ... (0: rebuild it by replay)
    _decoder: RuntimeDecoder = NO_DECODER
    _served_path: list
    _decoder_states: Any = None
    _lazy: list
    _lazy_controls: dict
    _computed = False  # the ring holds what the session computed or materialized
    frames_served = 0
    chunks_materialized = 0
    chunks_computed = 0

    def accept_handout(self) -> None:
        """The runtime of the next session asks `next_chunk` before each chunk and hands out
        stored frames: its cached prefix is restored only where it computes (unless the binding
        was made with ``handout=False``)."""
        self._handout = self.handout_enabled

    def _reset_handout(self) -> None:
        self._lazy, self._lazy_controls, self._computed, self._replay_pending = [], {}, False, False
        self._served_path = []
        self.frames_served = self.chunks_materialized = self.chunks_computed = 0

    @property
    def lazy(self) -> bool:
        """Whether the session still serves chunks without touching the ring."""
        return self._handout and not self._computed and self._ns is not None

    def _serve_lazily(self, node: Any, control: Any) -> None:
        """Chunk ``node.depth`` of a live session is on the cached path: served from frames
        (`next_chunk`), its KV left in the store."""
        self._lazy.append(node)
        self._lazy_controls[node.depth] = control

    @property
    def decoder_states(self) -> ChunkDecoderStates:
        if self._decoder_states is None:
            self._decoder_states = ChunkDecoderStates(self.manager)
        return self._decoder_states

    def next_chunk(self, runtime: Any, idx: int, spec: FramesSpec, decoder: RuntimeDecoder = NO_DECODER) -> NextChunk:
        """What to do with chunk ``idx`` (see the module docstring); ``decoder``: the runtime's
        decoder, whose state stored at a resume point may replace the replay. Never raises: a
        failure computes the chunk as a cold session would."""
        try:  # the decoder is not kept: it holds the runtime, which holds this binding
            return self._next_chunk(runtime, idx, spec, decoder)
        except Exception as exc:  # noqa: BLE001 - a cache must never take a session down
            log.exception("chunk %d: choosing between frames and compute failed", idx)
            self.manager.metrics.record_hook_failure("next_chunk", type(exc).__name__)
            return self._recompute(idx) if self._lazy and not self._computed else COMPUTE

    def _next_chunk(self, runtime: Any, idx: int, spec: FramesSpec, decoder: RuntimeDecoder) -> NextChunk:
        if self._replay_pending:  # materialized before this chunk: the decoder catches up first
            return self._replay(runtime, idx, decoder)
        if not self.lazy or not self._lazy:
            if self._handout and idx not in self._restored and idx >= self.last_fast_forward:
                self.chunks_computed += 1
                self._computed = True
            return COMPUTE
        if idx < len(self._lazy):
            node = self._lazy[idx]
            frames = self.manager.frames.read(node.node_key, spec)
            if frames is not None:
                with self.forest.lock:
                    node.last_access = self.manager.clock()
                self.frames_served += 1
                return NextChunk(frames=frames)
        # off the served path: restore it into the runtime (chunk ``idx`` computes or decodes next)
        return self._replay(runtime, idx, decoder) if self.materialize(runtime) else self._recompute(idx)

    def materialize(self, runtime: Any) -> int:
        """Restore the served path into ``runtime`` now, as the session's divergence does (its
        window's KV, cursors, RNG and cached latents; the ring check compares that state with a
        cold run's): the number of chunks restored, 0 when nothing was served or the restore
        failed (nothing published). The next `next_chunk` hands the served chunks' latents to
        the decoder (``replay``) before its chunk runs."""
        lazy = self._lazy
        if not lazy or self._computed:
            return 0
        window = PrefixWindow(self.layout, runtime, self.ring, lambda restored: None)
        ring_k = self.layout.layers(runtime)[0][0]
        try:
            with torch.inference_mode(ring_k.is_inference()):  # written in the mode it was made in
                ok = self.manager.materialize(lazy[-1], window)
        except Exception as exc:  # noqa: BLE001 - a store error: the served path is computed again
            log.warning("restoring the %d served chunks failed (%s)", len(lazy), exc)
            ok = False
        if not ok:
            return 0
        self._served_path = list(lazy)
        self._lazy, self._computed, self._replay_pending = [], True, True
        self.bytes_restored += window.bytes_restored
        self.chunks_materialized += len(lazy)
        self.manager.metrics.add(materializations=1, chunks_materialized=len(lazy))
        return len(lazy)

    def _replay(self, runtime: Any, idx: int, decoder: RuntimeDecoder) -> NextChunk:
        """After a materialization: the served chunks' latents (0..idx-1, leaving the cached
        latents), decoded again before chunk ``idx`` after the nearest stored decoder state, if
        any; later ones stay decode-only."""
        self._replay_pending = False
        cached = self.layout.cached_latents(runtime)
        latents = [cached.pop(j) for j in range(idx)]
        if idx not in cached and idx not in self._restored:
            self.chunks_computed += 1
        wanted = self._resume_specs(idx, decoder)
        if wanted and decoder.loads_late:  # read while the chunk computes; loaded before its decode
            states, device = self.decoder_states, decoder.device
            future = reader().submit(_read_nearest_aside, states, wanted, device)
            return NextChunk(late_state=LateState(future, tuple(latents), self.manager.metrics, LATE_WAIT_S))
        start, state = _read_nearest(self.decoder_states, wanted, decoder.device)
        replay = tuple(latents[start:])
        self.manager.metrics.add(decoder_replays=len(replay))
        return NextChunk(replay=replay, replay_from=start, decoder_state=state)

    def _resume_specs(self, idx: int, decoder: RuntimeDecoder) -> list[tuple[Any, int, Any]]:
        """``(node_key, j, spec)`` of each resume point ``j <= idx - 1`` of the served path,
        nearest first, while the decoder knows its state's layout there (asked here, in the
        runtime's thread: a decoder may run a dry decode to tell)."""
        path, out = self._served_path, []
        for j in resume_points(self.decoder_state_every, min(idx, len(path))):
            try:
                spec = decoder.spec(j)
            except Exception:  # noqa: BLE001 - no layout to check a state against: replay them all
                log.exception("chunk %d: the decoder's state layout after chunk %d is unknown", idx, j)
                break
            if spec is None:
                break
            out.append((path[j].node_key, j, spec))
        return out

    def _recompute(self, idx: int) -> NextChunk:
        """The served chunks 0..idx-1 are computed again (their frames are out already)."""
        controls = tuple(self._lazy_controls.get(j) for j in range(idx))
        self._lazy, self._computed = [], True
        self._restored.clear()
        self.last_fast_forward = 0
        self._cursor = self._ns.root  # the recomputed chunks find their nodes again (kept, not rewritten)
        self.chunks_computed += 1
        self.manager.metrics.add(recomputed_chunks=idx)
        return NextChunk(recompute=controls)

    def on_chunk_frames(self, runtime: Any, idx: int, frames: Any, decoder: RuntimeDecoder = NO_DECODER) -> None:
        """Chunk ``idx`` was computed here and its frames handed out: they are stored beside its
        KV (``frames``: an array or tensor, or a callable returning one), and at a resume point
        (``decoder_state_every``) the state of ``decoder`` after it. Only a chunk this session
        wrote gets its frames written. Never raises."""
        node = self._written.pop(idx, None)
        if node is None or self._ns is None:
            return
        device = self.layout.latent_spec(runtime).device
        self.manager.frames.write(node, frames, device)
        every = self.decoder_state_every
        if every > 0 and (idx + 1) % every == 0:
            try:
                state = decoder.capture()
            except Exception:  # noqa: BLE001 - nothing stored: a divergence here replays
                log.exception("chunk %d: reading the decoder's state failed", idx)
                state = None
            if state:
                self.decoder_states.write(node, state, decoder.device)


def _read_nearest(states: ChunkDecoderStates, wanted: list, device: Any) -> tuple[int, Any]:
    """``(j + 1, state)``: the first of ``wanted`` (`HandOut._resume_specs`) stored and passing its
    checks, read onto ``device``; ``(0, None)`` when none does (each miss counted by
    `ChunkDecoderStates.read`)."""
    for node_key, j, spec in wanted:
        state = states.read(node_key, spec, device)
        if state is not None:
            return j + 1, state
    return 0, None


def _read_nearest_aside(states: ChunkDecoderStates, wanted: list, device: Any) -> tuple[int, Any]:
    """`_read_nearest` on the reader thread: on a GPU on a stream of its own, waited for (the
    runtime's stream records its use of the state: `LateState.catch_up`)."""
    with side_stream(device):
        return _read_nearest(states, wanted, device)
