"""`LiveChunks`: the binding's role in a live session, whose controls arrive one chunk at a time.

A live TeleFuser session plans no controls: its service streams one per chunk, and the
integration's per-chunk seam (`cacheseek.integrations.telefuser`) names each to the binding
(``on_control_arrived`` ahead of its chunk, ``withdraw_control`` when a scheduler refused it,
``on_chunk_control`` as the chunk starts; ``restore_chunk`` as TeleFuser main's denoise actor is
about to compute it).

A chunk is restored when the trie cursor sits at depth ``idx - 1`` with a ready child for its key
(in the local trie, or found by its key in the store's chunk records: `SharedIndex.child`; a
chunk another live process is computing is waited for, bounded, and restored from its record once
it lands, and a chunk nobody has is claimed while this session computes it:
`SharedIndex.claim_or_wait`):
the manager restores that node alone into a `ChunkWindow` (its values into staging first, then
one publication point: RNG draws, ring append, latent), so a miss or a failure leaves the runtime
as a cold chunk finds it. A restored chunk's key must be the one it runs with; a chunk restored at
creation for a planned control and run with another raises `ControlMismatchError`. A chunk
whose control is never named is not cached, nor are the session's later chunks
(``chunks_unkeyed``, logged once).

`LiveChunks` is a mixin of `LingBotWorldKVBinding`: it reads and moves the session's state that
the binding keeps (``_keys``, ``_cursor``, ``_ns``, ``ring``, ``layout``, ``manager``,
``last_fast_forward``, ``ingest_enabled``, ``bytes_restored``) and keeps its own: ``_restored``
(chunks restored mid-session), ``_unkeyed_from`` (the first chunk no control was named for) and
what `chunk_finished` timed (``_timed``, ``_session_t0``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Optional

from cacheseek.errors import ControlMismatchError
from cacheseek.reuse.exact_prefix.actions import chunk_action_key
from cacheseek.reuse.exact_prefix.chunk_window import STAGING, ChunkWindow
from cacheseek.reuse.exact_prefix.hook_failures import counted_failures
from cacheseek.reuse.exact_prefix.lazy_keys import UNKNOWN

log = logging.getLogger("cacheseek.reuse.exact_prefix.telefuser_lingbot")

__all__ = ["LiveChunks"]

_logged_unkeyed: list[bool] = []


class LiveChunks:
    """The live-session hooks of the binding (see the module docstring)."""

    _restored: set[int]
    _unkeyed_from: Optional[int]
    _claimed = False  # whether the session asked the shared index to claim a chunk

    def _reset_live(self) -> None:
        """A new session: nothing restored mid-session, every control still to be named, no
        chunk timed; the claims a previous session of this binding still holds go."""
        self._release_claims()
        self._restored = set()
        self._unkeyed_from = None
        self._timed = set()
        self._session_t0 = time.perf_counter()

    def chunk_finished(self, idx: int, seconds: float, *, since_session_start: bool = False) -> None:
        """Chunk ``idx`` finished (its frames are out) after ``seconds`` of wall as its driver
        timed it: the metrics' ``cacheseek_chunk_seconds`` (restored or computed), and for chunk 0
        the session's time to first frame (``since_session_start``: measured from this
        session's start here, the binding's creation hook, instead of ``seconds``). Counted once
        per chunk: the first driver to report it wins (attach's seam, inside a caller that
        times the same chunk). Never raises."""
        timed = self._timed
        if idx in timed or idx < 0:
            return
        timed.add(idx)
        restored = idx in self._restored or idx < self.last_fast_forward or idx < self.frames_served
        metrics = self.manager.metrics
        if idx == 0:
            metrics.observe_first_frame(time.perf_counter() - self._session_t0 if since_session_start else seconds,
                                        restored=restored)
        else:
            metrics.observe_chunk(seconds, restored=restored)

    def _close_live(self) -> None:
        """The session's end: its live restores' staging buffers go (those no other session
        holds), and the claims of chunks it did not commit (`SharedIndex.release_claims`)."""
        self._release_claims()
        if self._restored:
            STAGING.clear()

    def _release_claims(self) -> None:
        if self._claimed:
            self._claimed = False
            self.manager.index.release_claims(self)

    def on_control_arrived(self, runtime: Any, idx: int, control: Any) -> None:
        """Chunk ``idx``'s control arrived ahead of the chunk (a service queues it, or builds the
        override first): its key is computed now, off the chunk's path, on the keys' thread;
        in this thread instead when chunk ``idx`` is the next to run and its lookup will read
        the key (`_looks_up`): the chunk would wait for it anyway, and handing it to the thread
        and back cost more than the key (3.2 against 1.7 ms on the H200 host, 480p). The chunk
        still reports the control it runs with through ``on_chunk_control``."""
        keys = self._keys
        if keys is None or not 0 <= idx < len(keys) or idx < self.last_fast_forward:
            return
        with contextlib.suppress(Exception):  # a key that fails is computed, and reported, at its chunk
            with counted_failures(self, "on_control_arrived"):
                keys.supply(idx, control)
                if self._looks_up(idx):
                    with contextlib.suppress(ValueError):  # kept for its index: the chunk reports it
                        keys[idx]
                keys.compute_rest_in_background()

    def _looks_up(self, idx: int) -> bool:
        """Whether chunk ``idx`` is looked up when it starts (`_restore_chunk`): the cursor sits
        at depth ``idx - 1`` with children, or a shared index may know one."""
        parent = self._cursor
        return (self._ns is not None and parent is not None and parent.depth == idx - 1
                and bool(parent.children or self.manager.index.active))

    def withdraw_control(self, idx: int) -> None:
        """Chunk ``idx``'s control, named ahead of the chunk, was not taken (a scheduler refused
        the submission): the chunk's control is unknown again until it is named anew."""
        keys = self._keys
        if keys is not None and 0 <= idx < len(keys) and idx >= self.last_fast_forward and idx not in self._restored:
            keys.supply(idx, UNKNOWN)

    def on_chunk_control(self, runtime: Any, idx: int, control: Any, *, may_restore: bool = False) -> None:
        """Chunk ``idx`` starts with ``control`` (what the model gets; None for none). With
        ``may_restore`` (the caller runs the chunk right after, in this thread, and the ring is
        writable here), a chunk on a cached path is restored instead (`ChunkWindow`). Raises
        `ControlMismatchError` when ``idx`` was restored for another (planned) control; any
        other failure is counted and leaves the chunk to be computed."""
        try:
            with counted_failures(self, "on_chunk_control"):
                self._on_chunk_control(runtime, idx, control, may_restore)
        except ControlMismatchError:
            raise
        except Exception:  # counted and logged: the chunk stays as it was known
            pass

    def _count_unkeyed(self, idx: int) -> None:
        """Chunk ``idx`` is not cached: its control, or an earlier chunk's, was never named."""
        self.manager.metrics.add(chunks_unkeyed=1)
        if not _logged_unkeyed:
            _logged_unkeyed.append(True)
            log.warning("chunk %d's control was neither planned nor named as the chunk started, so it and the "
                        "session's later chunks are not cached (counted as chunks_unkeyed); attach CacheSeek to the "
                        "pipeline (cacheseek.integrations.telefuser.attach) so each chunk's control reaches the "
                        "binding", self._unkeyed_from)

    def _on_chunk_control(self, runtime: Any, idx: int, control: Any, may_restore: bool) -> None:
        keys = self._keys
        if keys is None or not 0 <= idx < len(keys):  # bypassed, or a chunk beyond the session
            return
        if idx < self.last_fast_forward:
            planned = keys.control(idx)
            if control is not planned and chunk_action_key(idx, control) != keys[idx]:
                raise ControlMismatchError(
                    f"chunk {idx} was restored for the control the session planned, but it is run with "
                    "another control: plan the controls the session will be driven with, or stream them "
                    "without planning (each chunk is then looked up as its control arrives)")
            return
        keys.supply(idx, control)
        if may_restore and self._restore_chunk(runtime, idx, publish_latent=True, control=control) is not None:
            return
        if self.ingest_enabled:
            keys.compute_rest_in_background()  # the chunk is computed: its key is needed at ingest

    def restore_chunk(self, runtime: Any, idx: int) -> Any:
        """The runtime is about to compute chunk ``idx`` (its control already named): restore it
        instead when the session is on a cached path. Returns the chunk's stored latent (its KV,
        cursors and RNG draws are then published; the runtime hands the latent on as the
        chunk's x0), or None: compute it. TeleFuser main's integration calls it in the denoise
        actor. Never raises (a failure is counted; the chunk is computed)."""
        if self._keys is None or not 0 <= idx < len(self._keys) or idx in self._restored:
            return None
        try:
            with counted_failures(self, "restore_chunk"):
                return self._restore_chunk(runtime, idx, publish_latent=False)
        except Exception:
            return None

    def _restore_chunk(self, runtime: Any, idx: int, *, publish_latent: bool, control: Any = None) -> Any:
        """Restore chunk ``idx`` when the cursor sits at depth ``idx - 1`` with a ready child for
        its key (computed here only when the cursor has children): its latent, or None. Each
        chunk that reaches here is a lookup in the metrics (``live_lookups``): a hit, or a miss
        (``live_not_cached``, ``live_misses``) or a failure (``live_restore_failures``). A
        session that hands out frames and has computed nothing yet only serves the chunk
        (`HandOut`): its node is returned and its KV stays in the store."""
        parent = self._cursor
        index = self.manager.index
        if self._ns is None or parent is None or parent.depth != idx - 1:
            return None
        self.manager.metrics.add(live_lookups=1)  # every live chunk on the session's path is a lookup
        if not (parent.children or index.active):  # nothing below the cursor, nowhere else to ask
            self.manager.metrics.add(live_not_cached=1)
            return None
        try:
            action = self._keys[idx]
        except ValueError:  # no key: the chunk is computed, and its ingest says why
            self.manager.metrics.add(live_not_cached=1)
            return None
        child = index.child(self._ns, parent, action)  # the local trie's, else the store's record of it
        if child is None and self.ingest_enabled and index.active:
            self._claimed = True
            child = index.claim_or_wait(self._ns, parent, action, self)  # in flight elsewhere: wait for it
        if child is None:
            self.manager.metrics.add(live_not_cached=1)
            return None
        if publish_latent and self.lazy and len(self._lazy) == idx:
            self._serve_lazily(child, control)
            self._cursor = child
            self._restored.add(idx)
            self.manager.metrics.record_live_hit(idx)
            return child
        k, _ = self.layout.layers(runtime)[0]
        shape = (1, self.ring.chunk_size * self.ring.frame_tokens, int(k.shape[2]), int(k.shape[3]))
        lease = (STAGING.lease(k.device, len(self.layout.ring_layers(runtime)), shape, k.dtype)
                 if self.manager.store.reads_paths else contextlib.nullcontext(None))
        window: Optional[ChunkWindow] = None
        try:
            with lease as staging:
                window = ChunkWindow(self.layout, runtime, self.ring, idx, staging, publish_latent=publish_latent)
                self.manager.restore_chunk(child, window)
        except Exception:
            if window is None or not window.published:
                self.manager.metrics.add(live_restore_failures=1)
                raise
            log.warning("chunk %d: an error after its restore was published", idx, exc_info=True)
        if window is None or not window.published:  # the runtime is as a cold chunk finds it
            return None
        self._cursor = child
        self._restored.add(idx)
        self.bytes_restored += window.bytes_restored
        return window.latent

    @property
    def restored_chunks(self) -> list[int]:
        """The chunks of the session restored instead of computed: at creation (0..K-1) and
        mid-session (a live session on a cached path)."""
        return sorted(set(range(self.last_fast_forward)) | self._restored)
