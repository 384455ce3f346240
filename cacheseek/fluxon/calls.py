"""`BoundedCalls`: every call into Fluxon runs on its own daemon thread, waited for a bounded time.

A put issued after the service stopped was seen to return only after ~450 s, so no caller waits
on fluxon-py directly. `run(op, key, fn)` starts ``fn`` on a daemon thread and waits at most
``timeout`` (``op_timeout_s`` unless given). A call that overruns raises `StoreTimeoutError`
naming the op and key and keeps running in the background (its thread is a daemon; process exit
is not held up); when it finally returns, its value is dropped at once. While ``MAX_STUCK_CALLS``
such calls are outstanding, new calls fail at once. A raw exception from fluxon-py becomes
`StoreError`; CacheSeek's own errors and `Miss` pass through unchanged.

States: ``inflight`` (waited for), ``stuck`` (abandoned, still running). `mark_closed` refuses
every later call but ``close``; `drain` waits (bounded) for the calls in flight to finish.
The owner shares ``lock``, so that its own state and these counts change together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from cacheseek.errors import CacheSeekError, StoreClosedError, StoreError, StoreTimeoutError
from cacheseek.fluxon.results import Miss

__all__ = ["BoundedCalls", "MAX_STUCK_CALLS"]

T = TypeVar("T")

MAX_STUCK_CALLS = 4


class BoundedCalls:
    """Bounded calls of one Fluxon client (``owner``: its instance key) to one cluster."""

    def __init__(self, op_timeout_s: float, *, owner: str, cluster_name: str, share_mem_path: str) -> None:
        self.op_timeout_s = float(op_timeout_s)
        self._owner = owner
        self._cluster_name = cluster_name
        self._share_mem_path = share_mem_path
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self.inflight = 0
        self.stuck = 0
        self.closed = False

    def mark_closed(self) -> bool:
        """Refuse every later call but ``close``; False when already closed. Caller holds ``lock``."""
        if self.closed:
            return False
        self.closed = True
        return True

    def drain(self, timeout: float) -> tuple[int, int]:
        """Wait at most ``timeout`` for the calls in flight; ``(stuck, inflight)`` after it."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.inflight > 0 and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.01, deadline - time.monotonic()))
            return self.stuck, self.inflight

    def run(self, op: str, key: Optional[str], fn: Callable[[], T], timeout: Optional[float] = None,
            *, ptr_note: bool = False) -> T:
        """Run ``fn`` on a daemon thread; wait at most ``timeout`` (default op_timeout_s).
        ``ptr_note``: the call reads caller memory (say so in the timeout's message)."""
        timeout = self.op_timeout_s if timeout is None else timeout
        what = f"fluxon {op}" + (f" of key {key!r}" if key is not None else "")
        with self.lock:
            if self.closed and op != "close":
                raise StoreClosedError(f"{what}: the Fluxon client {self._owner} is closed")
            if self.stuck >= MAX_STUCK_CALLS:
                raise StoreTimeoutError(
                    f"{what} not issued: {self.stuck} earlier Fluxon calls are still stuck (the service "
                    f"of cluster {self._cluster_name!r} is probably gone)")
            self.inflight += 1
        box: dict[str, Any] = {}
        done = threading.Event()

        def runner() -> None:
            try:
                box["value"] = fn()
            except (CacheSeekError, Miss) as exc:
                box["error"] = exc
            except Exception as exc:  # noqa: BLE001 - a raw error from fluxon-py or its etcd client
                err = StoreError(f"{what} raised {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                box["error"] = err
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                with self.lock:
                    done.set()
                    if box.get("abandoned"):
                        self.stuck -= 1
                        box.clear()  # drop a late holder or value at once
                    else:
                        self.inflight -= 1
                        self._idle.notify_all()

        threading.Thread(target=runner, name=f"fluxon-{op}", daemon=True).start()
        if not done.wait(timeout):
            with self.lock:
                if not done.is_set():
                    box["abandoned"] = True
                    self.inflight -= 1
                    self.stuck += 1
                    self._idle.notify_all()
                    note = (" Keep the source memory valid: the call may still read it." if ptr_note else "")
                    raise StoreTimeoutError(
                        f"{what} did not complete within {timeout:.1f} s (cluster {self._cluster_name!r} "
                        f"at {self._share_mem_path}); the service may be stopped or overloaded. The call "
                        f"goes on in the background.{note}")
        if "error" in box:
            raise box["error"]
        return box["value"]
