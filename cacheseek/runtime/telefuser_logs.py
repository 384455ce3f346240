"""TeleFuser's log lines go to the run's log, not into the report.

TeleFuser logs with loguru and sets loguru up when ``telefuser.utils.logging`` is first imported:
it removes every loguru sink, adds one on stdout (written by a background thread, so its lines
land anywhere in the report, piped or not) and prints a coloured banner to stderr.
`route_telefuser_logs` does that import itself with ``sys.stderr`` caught (the banner, ANSI codes
stripped, goes to the log at INFO), then replaces loguru's sinks with one that hands each record,
synchronously, to the standard `logging` logger of the same name (``telefuser.pipelines....``).
Hydra's handlers then write it to the run folder's ``cacheseek.log``, and a warning or an error
also to stderr, as CacheSeek's own lines are. The sink takes records at the level the
``telefuser`` logger has when it is routed (INFO by default; ``hydra.verbose=telefuser`` for
DEBUG), so TeleFuser's debug calls stay cheap.

Loguru's logger is one per process: any other loguru user in the process is routed the same way
(CacheSeek has none). Routing is done once; a second call does nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re

__all__ = ["route_telefuser_logs"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_routed = False


class _ToLogging(logging.Handler):
    """Loguru sink: a loguru record becomes a `logging` record of the logger of the same name,
    filtered by that logger's level (``Logger.handle`` alone would skip the level check)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(record.name)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_telefuser_logs() -> None:
    """Import TeleFuser's logging with its banner caught, and send loguru's records to `logging`.

    Raises ImportError when TeleFuser is not installed (the caller names the extra to install)."""
    global _routed
    if _routed:
        return
    banner = io.StringIO()
    with contextlib.redirect_stderr(banner):
        import telefuser.utils.logging  # noqa: F401  (configures loguru: stdout sink, banner)
    from loguru import logger

    logger.remove()  # TeleFuser's stdout sink (waits for its queue to drain)
    level = logging.getLogger("telefuser").getEffectiveLevel()
    logger.add(_ToLogging(), level=level, format="{message}", colorize=False, enqueue=False,
               backtrace=False, diagnose=False)
    _routed = True
    for line in _ANSI.sub("", banner.getvalue()).splitlines():
        if line.strip(" ─"):
            log.info("telefuser: %s", line.strip())
