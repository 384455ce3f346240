"""Bounded calls: every call runs on its own daemon thread, waited for a bounded time.

A call into native code or onto a stalled medium (a hung disk, an NFS server gone, a FIFO where a
file should be) cannot be interrupted from Python, and a Fluxon call issued after its owner died
was seen to return only after ~450 s. So no caller waits on such a call directly:
`BoundedCalls.run` starts ``fn`` on a daemon thread (process exit is never held up by one) and
waits at most ``timeout_s``. A call that overruns raises `StoreTimeoutError` naming the call and
the config field of its bound, and keeps running in the background; if it returns later,
``on_late(value, error)`` gets its outcome (to abort a plan reserved after its caller gave up,
or remove a file written after its write was reported failed), else the value is dropped. While
``max_stuck`` such calls are outstanding, new calls fail at once instead of piling up threads. A
thread costs ~0.1 ms a call.

States: ``inflight`` (waited for), ``stuck`` (abandoned, still running). `mark_closed` refuses
every later call but ``close``; `drain` and `wait_idle` wait (bounded) for the calls in flight,
`wait_quiet` for the stuck ones too (an owner that must not release a resource under any call:
a LocalDisk root's lock). An owner may share ``lock``, so that its own state and these counts
change together.

The mechanism of every bounded backend: Fluxon's client (`cacheseek.fluxon.calls.FluxonCalls`,
its policy), the native Plan client, and `KeyValueTier`'s backends that ask for it (LocalDisk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from cacheseek.errors import ConfigError, StoreClosedError, StoreTimeoutError

__all__ = ["BoundedCalls", "MAX_STUCK_CALLS"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LateHandler = Callable[[Any, Optional[BaseException]], None]

MAX_STUCK_CALLS = 4


class BoundedCalls:
    """Time-bounded calls of one client. ``name``: how messages name the client; ``field``: the
    config field of ``timeout_s``; ``hint``: what a timeout probably means."""

    def __init__(self, timeout_s: float, *, name: str, field: str, hint: str = "",
                 max_stuck: int = MAX_STUCK_CALLS) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(field, f"must be a number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.name = name
        self.field = field
        self.hint = hint
        self.max_stuck = max_stuck
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self.inflight = 0
        self.stuck = 0
        self.closed = False

    # -- policy (a subclass varies these) ---------------------------------------------------------
    def describe(self, op: str, key: Optional[str]) -> str:
        return f"{self.name} {op}" + (f" of key {key!r}" if key is not None else "")

    def refusal(self, what: str, op: str) -> Optional[BaseException]:
        """Why a call must not be issued now (the caller holds ``lock``), or None."""
        if self.closed and op != "close":
            return StoreClosedError(f"{what}: {self.name} is closed")
        if self.stuck >= self.max_stuck:
            return StoreTimeoutError(f"{what} not issued: {self.stuck} earlier calls are still stuck{self.hint}")
        return None

    def wrap(self, what: str, exc: BaseException) -> BaseException:
        """The error the caller gets for ``fn``'s exception (as it is, here)."""
        return exc

    def timed_out(self, what: str, timeout: float, field: str, ptr_note: bool) -> StoreTimeoutError:
        note = " Keep the source memory valid: the call may still read it." if ptr_note else ""
        return StoreTimeoutError(f"{what} did not complete within {timeout:g} s ({field}){self.hint}; if it is "
                                 f"only slow, raise {field}. The call goes on in the background.{note}")

    # -- mechanism --------------------------------------------------------------------------------
    def run(self, op: str, fn: Callable[[], T], *, key: Optional[str] = None, timeout_s: Optional[float] = None,
            field: Optional[str] = None, on_late: Optional[LateHandler] = None, ptr_note: bool = False) -> T:
        """``fn()`` on a daemon thread, waited for at most ``timeout_s`` (default: the client's bound,
        named by ``field``). ``ptr_note``: the call reads caller memory (the timeout says so)."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        field = field or self.field
        what = self.describe(op, key)
        with self.lock:
            refused = self.refusal(what, op)
            if refused is not None:
                raise refused
            self.inflight += 1
        box: dict[str, Any] = {}
        done = threading.Event()

        def runner() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = self.wrap(what, exc)
            with self.lock:
                done.set()
                late = box.get("abandoned", False)
                if not late:
                    self.inflight -= 1
                    self._idle.notify_all()
            if not late:
                return
            outcome = (box.pop("value", None), box.pop("error", None))  # nothing kept past here
            try:
                if on_late is not None:
                    on_late(*outcome)
            except Exception:  # noqa: BLE001 - nobody is left to raise it to
                log.warning("%s: cleaning up after a late call failed", what, exc_info=True)
            finally:
                with self.lock:  # stuck until its clean-up is done too (`wait_quiet`)
                    self.stuck -= 1
                    self._idle.notify_all()

        threading.Thread(target=runner, name=f"{self.name}-{op}", daemon=True).start()
        if not done.wait(timeout):
            with self.lock:
                if not done.is_set():
                    box["abandoned"] = True
                    self.inflight -= 1
                    self.stuck += 1
                    self._idle.notify_all()
                    raise self.timed_out(what, timeout, field, ptr_note)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def mark_closed(self) -> bool:
        """Refuse every later call but ``close``; False when already closed. Caller holds ``lock``."""
        if self.closed:
            return False
        self.closed = True
        return True

    def _wait(self, busy: Callable[[], int], timeout: float) -> tuple[int, int]:
        """Wait at most ``timeout`` until ``busy()`` (read under ``lock``) is 0; ``(stuck, inflight)`` then."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while busy() > 0 and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.01, deadline - time.monotonic()))
            return self.stuck, self.inflight

    def drain(self, timeout: float) -> tuple[int, int]:
        """Wait at most ``timeout`` for the calls in flight; ``(stuck, inflight)`` after it."""
        return self._wait(lambda: self.inflight, timeout)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is being waited for (stuck calls aside); False past ``timeout_s``."""
        return self.drain(timeout_s)[1] == 0

    def wait_quiet(self, timeout_s: float) -> int:
        """Wait at most ``timeout_s`` until no call runs at all, stuck ones included; the number
        still running after it (0: none)."""
        return sum(self._wait(lambda: self.inflight + self.stuck, timeout_s))
