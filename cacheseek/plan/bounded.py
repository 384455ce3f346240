"""`BoundedCalls`: blocking calls into a native client, each waited for at most a time bound.

A call into native code cannot be interrupted from Python, and a Fluxon call issued after its
owner died was seen to return only after ~450 s. So each call runs on its own daemon thread
(process exit is never held up by one) and the caller waits at most ``timeout_s``: past it,
`StoreTimeoutError` names the call, the config field of the bound and the fix. The call goes on
in the background; if it returns later, ``on_late(value, error)`` gets its outcome (to abort a
plan reserved after its caller gave up, say). Once ``max_stuck`` calls are outstanding, new calls
fail at once instead of piling up threads. A thread costs ~0.1 ms a call: a restore makes six.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from cacheseek.errors import ConfigError, StoreTimeoutError

__all__ = ["BoundedCalls"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LateHandler = Callable[[Any, Optional[BaseException]], None]


class BoundedCalls:
    """Time-bounded calls for one client. ``name``: how errors name the client; ``field``: the
    config field of ``timeout_s``; ``hint``: what a timeout probably means."""

    def __init__(self, name: str, timeout_s: float, field: str, *, hint: str = "", max_stuck: int = 4) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(field, f"must be a number of seconds > 0, got {timeout_s!r}")
        self.name = name
        self.timeout_s = float(timeout_s)
        self.field = field
        self.hint = hint
        self.max_stuck = max_stuck
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0  # calls being waited for
        self._stuck = 0  # calls given up on and not returned yet

    @property
    def stuck(self) -> int:
        return self._stuck

    def run(self, op: str, fn: Callable[[], T], *, timeout_s: Optional[float] = None,
            field: Optional[str] = None, on_late: Optional[LateHandler] = None) -> T:
        """``fn()``, waited for at most ``timeout_s`` (default: the client's bound, named by
        ``field``). Its exception is raised as is."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        field = field or self.field
        what = f"{self.name} {op}"
        with self._lock:
            if self._stuck >= self.max_stuck:
                raise StoreTimeoutError(f"{what} not issued: {self._stuck} earlier calls are still stuck{self.hint}")
            self._inflight += 1
        box: dict[str, Any] = {}
        done = threading.Event()

        def runner() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                with self._lock:
                    done.set()
                    late = box.get("abandoned", False)
                    if late:
                        self._stuck -= 1
                    else:
                        self._inflight -= 1
                    self._idle.notify_all()
            if late and on_late is not None:
                try:
                    on_late(box.get("value"), box.get("error"))
                except Exception:  # noqa: BLE001 - nobody is left to raise it to
                    log.warning("%s: cleaning up after a late %s failed", self.name, op, exc_info=True)

        threading.Thread(target=runner, name=f"{self.name}-{op}", daemon=True).start()
        if not done.wait(timeout):
            with self._lock:
                if not done.is_set():
                    box["abandoned"] = True
                    self._inflight -= 1
                    self._stuck += 1
                    self._idle.notify_all()
                    raise StoreTimeoutError(
                        f"{what} did not complete within {timeout:g} s ({field}){self.hint}; if it is only "
                        f"slow, raise {field}. The call goes on in the background.")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is being waited for (stuck calls aside); False past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True
