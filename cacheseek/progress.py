"""Progress bars for steps that take more than a couple of seconds (the gate's requests, the
stress sessions, the workers), drawn with tqdm on stderr.

A bar shows only on a terminal (tqdm's ``disable=None``) and is removed when it closes
(``leave=False``), so logs, pipes and the tests see nothing of it and the report that follows
stays as it is. ``ticking`` keeps a bar's clock moving while one long step (a worker process)
runs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

__all__ = ["bar", "ticking"]


def bar(total: int, desc: str, unit: str = "step") -> Any:
    """A tqdm bar of ``total`` steps on stderr; a silent one when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None, file=sys.stderr,
                dynamic_ncols=True)


@contextmanager
def ticking(progress: Any, every_s: float = 0.5) -> Iterator[Any]:
    """Refresh ``progress`` every ``every_s`` seconds while the block runs (elapsed time moves)."""
    if getattr(progress, "disable", True):
        yield progress
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            progress.refresh()

    t = threading.Thread(target=tick, name="progress-tick", daemon=True)
    t.start()
    try:
        yield progress
    finally:
        stop.set()
        t.join()
