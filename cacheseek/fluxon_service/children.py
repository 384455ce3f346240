"""The child processes of a Fluxon service (etcd, master, owner): started with their output in a
log file each, watched while the service waits to be ready, stopped in order.

`FluxonService` owns one `Children`; it decides what runs, this module how. Each child gets its
own session (a Ctrl-C in the terminal reaches only the parent, which then stops the children in
order) and ``logs_dir/<name>.log`` (stdout and stderr, appended). Every wait is bounded: `wait_for`
by its timeout, `stop` by ``stop_timeout_s`` per child before SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cacheseek.fluxon.errors import FluxonServiceError

log = logging.getLogger(__name__)

__all__ = ["Children", "free_ports", "log_tail"]


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (bound on every interface, then released)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log (its last 64 KiB read), indented, ANSI colours removed."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"    (cannot read {path}: {exc})"
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Fluxon logs carry ANSI colours
    out = text.splitlines()[-lines:]
    return "\n".join("    " + line for line in out) or "    (empty)"


class Children:
    """Named child processes run in ``workdir`` with ``env`` added to this process's environment."""

    def __init__(self, workdir: Path, logs_dir: Path, env: dict[str, str], names: Sequence[str]) -> None:
        self.workdir, self.logs_dir, self.env = workdir, logs_dir, env
        self.names = tuple(names)  # the order of the log tails
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __bool__(self) -> bool:
        return bool(self.procs)

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def spawn(self, name: str, cmd: list[str]) -> None:
        logf = open(self.logs_dir / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                cwd=str(self.workdir), env={**os.environ, **self.env}, start_new_session=True)
        except OSError as exc:
            raise FluxonServiceError(f"cannot start fluxon {name} ({cmd[0]}): {exc}") from exc
        finally:
            logf.close()
        log.debug("fluxon service: started %s pid %d: %s", name, self.procs[name].pid, " ".join(cmd))

    def check(self, while_: str = "") -> None:
        """FluxonServiceError with the log tails when a child has exited."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                during = f" while waiting for {while_}" if while_ else ""
                raise FluxonServiceError(
                    f"fluxon {name} (pid {p.pid}) exited with status {p.returncode}{during}\n{self.log_tails()}")

    def wait_for(self, ready: Callable[[], bool], what: str, t0: float, timeout_s: float) -> None:
        """Poll ``ready`` until true; FluxonServiceError when a child exits or ``timeout_s`` after
        ``t0`` (monotonic) passes."""
        while True:
            self.check(what)
            if ready():
                return
            if time.monotonic() - t0 > timeout_s:
                raise FluxonServiceError(
                    f"fluxon service not ready after {timeout_s:.0f} s: still waiting for "
                    f"{what}\n{self.log_tails()}")
            time.sleep(0.05)

    def stop(self, order: Sequence[tuple[str, signal.Signals]], timeout_s: float) -> None:
        """Send each child its signal, in ``order``; SIGKILL one that outlives ``timeout_s``."""
        for name, sig in order:
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("fluxon %s (pid %d) ignored %s for %.0f s: killing it",
                            name, p.pid, signal.Signals(sig).name, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(timeout=timeout_s)
        self.procs.clear()

    def log_tails(self, lines: int = 15) -> str:
        parts = []
        for name in self.names:
            path = self.logs_dir / f"{name}.log"
            if path.exists():
                parts.append(f"  --- {path} (last {lines} lines) ---\n{log_tail(path, lines)}")
        return "\n".join(parts)
