"""A write-back worker: one daemon thread that runs a store's queued writes in order, fed by a
bounded queue.

``submit`` blocks while ``depth`` jobs wait (backpressure, not unbounded memory). ``stop`` asks
the thread to finish the jobs already queued and exit, bounded in time: it answers whether the
thread has stopped, so that a store never tears its backend down under a live writer.

Lifecycle::

    WriteBackWorker(run, depth=..., name=...) --> running: each submitted job is run(job), in order
    stop(wait_s) --> True once every queued job has run and the thread exited; False when the
        queue stayed full or the thread is still running after ``wait_s`` (it goes on)

``run`` owns its failures: an exception that escapes it ends the thread.

`PendingWrites`: the writes a store has begun and not finished, counted in its stats under the
store's lock, and the optional worker that runs them; ``flush`` waits for them, bounded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import StoreTimeoutError
from cacheseek.stores.flush import wait_drained

__all__ = ["WriteBackWorker", "PendingWrites"]

_STOP = None  # the job that ends the thread


class WriteBackWorker:
    """Runs ``run(job)`` for every submitted job on one thread named ``{name}-write-back``."""

    def __init__(self, run: Callable[[Any], None], *, depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError("queue_depth must be >= 1")
        self._run = run
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._drain, name=f"{name}-write-back", daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        """Queue ``job`` (not None), blocking while the queue is full."""
        if job is _STOP:
            raise ValueError("a write-back job cannot be None")
        self._queue.put(job)

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                self._run(job)
            finally:
                self._queue.task_done()

    def stop(self, *, wait_s: float) -> bool:
        """Ask the thread to stop after the queued jobs; True once it has (see the module
        docstring). Waits at most about ``wait_s`` to queue the request and as long again for
        the thread to exit."""
        try:
            self._queue.put(_STOP, timeout=max(wait_s, 0.001))
        except queue.Full:
            return False
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    @property
    def thread_name(self) -> str:
        """The thread's name, ``{name}-write-back`` (how it shows in a stack dump)."""
        return self._thread.name

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the thread to exit (after `stop`), at most ``timeout`` seconds."""
        self._thread.join(timeout=timeout)


class PendingWrites:
    """``stats.pending_writes`` of a store, guarded by its ``lock``; with ``write_back`` a
    `WriteBackWorker` runs each job (``run(job)``), else it runs in the caller's thread."""

    def __init__(self, lock: threading.Lock, stats: Any, run: Callable[[Any], None], *, write_back: bool,
                 depth: int, name: str) -> None:
        self.stats = stats
        self.name = name
        self.idle = threading.Condition(lock)  # notified when a pending write completes
        self._run = run
        self.worker = WriteBackWorker(run, depth=depth, name=name) if write_back else None

    def submit(self, job: Any) -> None:
        """Run ``job`` now, or queue it on the write-back thread."""
        if self.worker is None:
            self._run(job)
        else:
            self.worker.submit(job)

    def done(self) -> None:
        """With the lock held: one pending write completed (succeeded or failed)."""
        self.stats.pending_writes -= 1
        self.idle.notify_all()

    def flush(self, bound_s: float) -> None:
        """Wait until every pending write has completed, at most ``bound_s``; `StoreTimeoutError`
        past it, naming how many are still pending (they go on; a later flush may succeed)."""
        with self.idle:
            wait_drained(self.idle, lambda: self.stats.pending_writes, bound_s,
                         lambda n: StoreTimeoutError(f"{self.name}: {n} writes still pending after {bound_s} s "
                                                     "(a stuck backend?)"))

    def stop(self, wait_s: float) -> bool:
        """Stop the write-back thread (`WriteBackWorker.stop`); True when there is none."""
        return self.worker is None or self.worker.stop(wait_s=wait_s)
