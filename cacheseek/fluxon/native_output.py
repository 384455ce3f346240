"""Native output of fluxon-py sent to the log instead of the terminal.

While a client attaches or closes, fluxon-py's native code prints its config and banners
straight to file descriptors 1 and 2, past Python's ``sys.stdout``. `native_output_to_log` points
both descriptors at a temporary file for the duration of a ``with`` block, restores them, and logs
every non-empty line (ANSI colours stripped) as ``fluxon-py: <line>`` at INFO: the run's log file
keeps it, the terminal stays quiet. What the native threads print later, outside a block, is
kept to errors by FLUXON_LOG (`cacheseek.fluxon.client.FluxonClient`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Optional

__all__ = ["native_output_to_log"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def native_output_to_log(logger: Optional[logging.Logger] = None) -> Iterator[None]:
    """Send what is written to fds 1 and 2 inside the block to ``logger`` (this module's log)."""
    out = logger or log
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            for line in sink.read().decode("utf-8", errors="replace").splitlines():
                if line.strip():
                    out.info("fluxon-py: %s", _ANSI.sub("", line))
