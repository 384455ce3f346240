"""`LazyActionKeys`: a session's action keys, each computed when first needed, the rest off the
request path.

A 480p chunk's key costs about 30 ms (`actions`), and a session needs few of them before its first
chunk runs: the lookup reads key ``i`` only while the trie walk still has children to match at
depth ``i`` (a fresh namespace needs none, a cold miss at most key 0, a hit of depth K keys
0..K). Every other key is needed only when its chunk is ingested, seconds of compute later. So
the binding hands the lookup this sequence, then `compute_rest_in_background` keys what is left
on one thread, and chunk ``i``'s ingest takes key ``i`` from it.

    keys = LazyActionKeys(controls)     len(keys) == len(controls); nothing computed yet
    keys[i] / iter(keys) / keys[:k]     key i computed now in this thread (once), or waited for
                                        while the background thread computes it; a control with
                                        no key raises its ValueError ("chunk i's control: ...")
    keys.compute_rest_in_background()   one daemon thread ("cacheseek-action-keys") keys every
                                        known index not computed yet, in order; an error is kept
                                        for its index and raised where that key is asked for;
                                        called again after `supply`, it starts a new thread
                                        when the last one has ended
    keys.supply(i, control)             chunk i runs with ``control`` (a streamed control, or an
                                        override of the planned one): its key is that control's
    keys.known_prefix()                 how many leading chunks have a known control
    keys.close(timeout_s)               the thread stops after the key under way and is joined

A chunk whose control is not known yet (`UNKNOWN`: a live session's controls arrive one chunk
at a time) has no key: asking for it raises `ControlUnknownError` until `supply` names the
control. ``None`` is a known control, the chunk without one (``b"noctrl"``).

Keys are those of `action_keys`, byte for byte. A CUDA control is quantized on the asking thread's
current stream; the background thread uses a side stream of the controls' device, made to wait on
the caller's current stream when the work is handed over (the controls were produced there), so
its kernels do not queue behind the model's on the main stream. On the CPU it is just a thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union, overload

import torch

from cacheseek.reuse.exact_prefix.actions import chunk_action_key

log = logging.getLogger(__name__)

__all__ = ["ControlUnknownError", "LazyActionKeys", "THREAD_NAME", "UNKNOWN"]

THREAD_NAME = "cacheseek-action-keys"


class _Unknown:
    """The control of a chunk that has not arrived yet (see `UNKNOWN`)."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


class ControlUnknownError(ValueError):
    """A key was asked for a chunk whose control is not known (never supplied, never planned)."""


class _Keys:
    """The shared state of one session's keys: computed keys, kept errors, indices under way."""

    def __init__(self, controls: list[Any]) -> None:
        self.controls = controls
        self.ready: dict[int, Any] = {}  # index -> (CUDA event, device): its supplied control is written
        self.keys: list[Optional[bytes]] = [None] * len(controls)
        self.errors: dict[int, BaseException] = {}
        self.busy: set[int] = set()  # being computed by some thread
        self.cond = threading.Condition()
        self.computed = 0
        self.thread: Optional[threading.Thread] = None
        self.side: Any = None  # the CUDA side stream of the keys' thread, made once
        self.stop = False

    def key(self, i: int) -> bytes:
        with self.cond:
            while True:
                found = self.keys[i]
                if found is not None:
                    return found
                if i in self.errors:
                    raise self.errors[i]
                if self.controls[i] is UNKNOWN:
                    raise ControlUnknownError(f"chunk {i}'s control is not known (a live session supplies "
                                              "each control as its chunk starts)")
                if i not in self.busy:
                    self.busy.add(i)
                    break
                self.cond.wait()
        return self._compute(i, keep=(ValueError,))

    def _compute(self, i: int, keep: tuple[type, ...]) -> bytes:
        """Key ``i`` (claimed in ``busy``), published under the lock; a failure of a ``keep``
        type is kept for ``i`` (raised to whoever asks for it), any failure is re-raised."""
        try:
            _wait_ready(self.ready.get(i))
            key = chunk_action_key(i, self.controls[i])
        except BaseException as exc:
            with self.cond:
                self.busy.discard(i)
                if isinstance(exc, keep):
                    self.errors[i] = exc
                self.cond.notify_all()
            raise
        with self.cond:
            self.keys[i] = key
            self.computed += 1
            self.busy.discard(i)
            self.cond.notify_all()
        return key

    def claim_next(self) -> Optional[int]:
        """The first index nobody computed or claimed (claimed now), None when none is left."""
        with self.cond:
            if self.stop:
                return None
            for i, key in enumerate(self.keys):
                if key is None and i not in self.errors and i not in self.busy and self.controls[i] is not UNKNOWN:
                    self.busy.add(i)
                    return i
            if self.thread is threading.current_thread():
                self.thread = None  # decided under the lock: a key supplied from now on starts a new thread
            return None

    def supply(self, i: int, control: Any) -> None:
        """Chunk ``i``'s control is ``control`` from now on; a key of another control is dropped
        (after a computation of it under way has ended)."""
        with self.cond:
            if self.controls[i] is control:  # already its control: a key under way for it stands
                return
            while i in self.busy:
                self.cond.wait()
            if self.controls[i] is control:
                return
            self.controls[i] = control
            self.ready.pop(i, None)
            if self.keys[i] is not None:
                self.keys[i] = None
                self.computed -= 1
            self.errors.pop(i, None)
            self.ready_event(i, control)
            self.cond.notify_all()

    def ready_event(self, i: int, control: Any) -> None:
        """For a CUDA control: an event on the supplying thread's current stream, which whoever
        keys it waits for first (it may be a thread whose stream did not produce it)."""
        if getattr(getattr(control, "device", None), "type", None) == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(control.device))
            self.ready[i] = (event, control.device)

    def run(self, stream: Any, first: int) -> None:
        """The background thread: key ``first`` (claimed for it when it was started), then every
        key left, in order, on ``stream`` (CUDA) if any."""
        i: Optional[int] = first
        with _on_stream(stream):
            while i is not None:
                try:
                    self._compute(i, keep=(Exception,))  # kept: the asking thread never waits in vain
                except Exception as exc:  # kept for index i: its ingest raises it
                    if not isinstance(exc, ValueError):
                        log.warning("computing chunk %d's action key failed: %s", i, exc)
                i = self.claim_next()


class LazyActionKeys(Sequence):
    """The action keys of ``controls`` (a control per chunk, None for none), computed on demand;
    see the module docstring. A slice is a view that shares the computed keys."""

    def __init__(self, controls: Sequence[Any], *, _keys: Optional[_Keys] = None,
                 _range: Optional[range] = None) -> None:
        self._keys = _keys if _keys is not None else _Keys(list(controls))
        self._range = _range if _range is not None else range(len(self._keys.controls))

    def __len__(self) -> int:
        return len(self._range)

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> "LazyActionKeys": ...

    def __getitem__(self, i: Union[int, slice]) -> Union[bytes, "LazyActionKeys"]:
        if isinstance(i, slice):
            return LazyActionKeys((), _keys=self._keys, _range=self._range[i])
        return self._keys.key(self._range[i])

    def __iter__(self) -> Iterator[bytes]:
        for j in self._range:
            yield self._keys.key(j)

    def __repr__(self) -> str:
        return f"LazyActionKeys({len(self)} chunks, {self.computed} computed)"

    @property
    def computed(self) -> int:
        """How many keys have been computed so far (by any thread, all views together)."""
        with self._keys.cond:
            return self._keys.computed

    @property
    def pending(self) -> int:
        """How many keys of known controls are neither computed nor failed (whole session)."""
        k = self._keys
        with k.cond:
            return sum(1 for i, key in enumerate(k.keys)
                       if key is None and i not in k.errors and k.controls[i] is not UNKNOWN)

    @property
    def background_thread(self) -> Optional[threading.Thread]:
        """The thread `compute_rest_in_background` started while it runs (None before, after it
        ends by itself, and when nothing was left to key): for a caller that waits for it."""
        with self._keys.cond:
            return self._keys.thread

    def known_prefix(self) -> int:
        """The number of leading chunks (of this view) whose control is known."""
        k = self._keys
        with k.cond:
            for n, j in enumerate(self._range):
                if k.controls[j] is UNKNOWN:
                    return n
            return len(self._range)

    def control(self, i: int) -> Any:
        """Chunk ``i``'s control as known now (`UNKNOWN` when it is not)."""
        k = self._keys
        with k.cond:
            return k.controls[self._range[i]]

    def supply(self, i: int, control: Any) -> None:
        """Chunk ``i`` runs with ``control``: its key is that control's (see `_Keys.supply`)."""
        self._keys.supply(self._range[i], control)

    def compute_rest_in_background(self) -> None:
        """Start the thread that keys every known index not computed yet (nothing when none is
        left, while one runs, or after `close`). Call it from the thread whose current CUDA
        stream produced the controls."""
        k = self._keys
        with k.cond:
            if k.stop or k.thread is not None:
                return
        if not self.pending:
            return
        if k.side is None:  # one side stream a session (supplied controls carry their own events)
            k.side = _side_stream([c for c in k.controls if c is not UNKNOWN])
        stream = k.side
        with k.cond:  # one thread at a time: the check, its first key's claim and the start under one hold
            if k.stop or k.thread is not None or (first := k.claim_next()) is None:
                return
            k.thread = thread = threading.Thread(target=k.run, args=(stream, first), name=THREAD_NAME, daemon=True)
            thread.start()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the background thread after the key under way and join it, at most ``timeout_s``;
        whether it ended. Keys asked for later are computed by the asking thread."""
        k = self._keys
        with k.cond:
            k.stop = True
            thread = k.thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()


def _side_stream(controls: list[Any]) -> Any:
    """A new CUDA stream on the first CUDA control's device, waiting on that device's current
    stream now (where the controls were produced); None when no control is a CUDA tensor."""
    device = next((c.device for c in controls
                   if hasattr(c, "detach") and getattr(getattr(c, "device", None), "type", None) == "cuda"), None)
    if device is None:
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _wait_ready(ready: Any) -> None:
    """The asking thread's current stream waits for a supplied CUDA control's event."""
    if ready is not None:
        event, device = ready
        torch.cuda.current_stream(device).wait_event(event)


def _on_stream(stream: Any) -> Any:
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)
