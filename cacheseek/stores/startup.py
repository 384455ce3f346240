"""`SessionStarts`: the sessions starting now, which a store's background warm-up yields to.

A session's start-up (its binding made, the runtime allocating its ring and buffers, the first
hook) makes CUDA calls that wait for the driver's and the mmap locks while a segment piece is being
registered (`cudaHostRegister`, ~16 MiB a piece in a background warm-up). So a background warm-up
asks `wait_clear` between two pieces and pauses while any session is starting. Each start is
bounded: its token expires ``yield_s`` after it began, so a binding that is never used (or leaks
its token) cannot stall the warm-up for longer; and a warm-up yields at most ``total_s`` in all
(default ten starts' worth), so back-to-back session starts on a busy server cannot keep the
store cold for ever. `close` ends every wait at once (the store is being closed).

    starts = SessionStarts(yield_s=2.0)
    token = starts.begin()          a session is starting (counted); ``with starts.begin():`` too
    token.release()                 idempotent; ``NO_TOKEN.release()`` does nothing
    starts.wait_clear() -> float    blocks while an unexpired token is held; the seconds waited
    starts.close()                  no more waits: wait_clear returns at once, begin hands out NO_TOKEN
    combine(tokens)                 one token releasing several (a tiered store's levels)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Optional

log = logging.getLogger(__name__)

__all__ = ["SessionStarts", "StartToken", "NO_TOKEN", "combine"]


class StartToken:
    """One session's start: `release` (or leaving the ``with`` block) ends it, once."""

    __slots__ = ("_release",)

    def __init__(self, release: Any = None) -> None:
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "StartToken":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


NO_TOKEN = StartToken()  # what a store that is not warming hands out: nothing to release


def combine(tokens: Iterable[StartToken]) -> StartToken:
    """A token whose release releases each of ``tokens`` (all of them, even when one raises)."""
    held = [t for t in tokens if t is not NO_TOKEN]
    if not held:
        return NO_TOKEN

    def release_all() -> None:
        errors = []
        for t in held:
            try:
                t.release()
            except Exception as exc:  # noqa: BLE001 - the others are released first
                errors.append(exc)
        if errors:
            raise errors[0]

    return StartToken(release_all)


class SessionStarts:
    """The sessions starting now (see the module docstring); thread-safe."""

    def __init__(self, yield_s: float = 2.0, total_s: Optional[float] = None) -> None:
        self.yield_s = float(yield_s)
        self.total_s = 10 * self.yield_s if total_s is None else float(total_s)
        self.waited_s = 0.0  # in all, over every wait_clear
        self._closed = False
        self._clock = time.monotonic
        self._cond = threading.Condition()
        self._deadlines: dict[int, float] = {}  # token id -> when it expires
        self._ids = itertools.count()
        self.waiting = 0  # warm-up threads in wait_clear now (tests watch it)
        self.expired = 0

    def begin(self) -> StartToken:
        """Count one session start until the token is released or ``yield_s`` has passed
        (``yield_s <= 0``: yield to nothing)."""
        if self.yield_s <= 0 or self._closed:
            return NO_TOKEN
        with self._cond:
            ident = next(self._ids)
            self._deadlines[ident] = self._clock() + self.yield_s
        return StartToken(lambda: self._end(ident))

    @property
    def starting(self) -> int:
        """Unexpired starts held now."""
        with self._cond:
            self._drop_expired(self._clock())
            return len(self._deadlines)

    def _end(self, ident: int) -> None:
        with self._cond:
            self._deadlines.pop(ident, None)
            self._cond.notify_all()

    def _drop_expired(self, now: float) -> Optional[float]:
        """Under the lock: forget expired starts; the next deadline (None when none is held)."""
        for ident in [i for i, d in self._deadlines.items() if d <= now]:
            del self._deadlines[ident]
            self.expired += 1
            log.info("a session start held the warm-up for %.1f s without ending; the warm-up goes on",
                     self.yield_s)
        return min(self._deadlines.values(), default=None)

    def wait_clear(self) -> float:
        """Block while any unexpired start is held, until ``total_s`` of waiting in all or
        `close`; the seconds waited (0.0 when none was)."""
        with self._cond:
            t0 = self._clock()
            deadline = self._drop_expired(t0)
            if deadline is None or self._closed or self.waited_s >= self.total_s:
                return 0.0
            self.waiting += 1
            try:
                while deadline is not None and not self._closed:
                    budget = self.total_s - self.waited_s - (self._clock() - t0)
                    if budget <= 0:
                        log.info("the warm-up has yielded %.1f s to session starts in all; it goes on",
                                 self.total_s)
                        break
                    self._cond.wait(max(min(deadline - self._clock(), budget), 0.0))
                    deadline = self._drop_expired(self._clock())
            finally:
                self.waiting -= 1
            waited = self._clock() - t0
            self.waited_s += waited
            return waited

    def close(self) -> None:
        """End every wait now and take no more starts (idempotent)."""
        with self._cond:
            self._closed = True
            self._deadlines.clear()
            self._cond.notify_all()
