#!/usr/bin/env python3
"""N emulated hosts on one machine: network namespaces joined by a bridge (needs root).

Each host is a set of namespaces held by one process (PID 1 of its own PID namespace):

- network: ``lo`` and ``eth0``, one end of a veth pair, with 10.78.0.<i+1>/24 assigned inside it;
- UTS: its own hostname (the host's name);
- mount: its own /tmp and /dev/shm (tmpfs), so Fluxon's same-machine shortcuts (the segment
  under /dev/shm, the IPC files under /tmp) cannot reach another host's; ``shared_dir``, if
  given, is bound at /tmp/shared in every host (how a test hands files between hosts);
- PID and IPC: killing its PID 1 ends every process started in it.

The veths' other ends sit on a bridge ``csbr0`` inside a namespace of its own that has no address
and no other link: nothing of the caller's namespace is touched, and no packet leaves. `close`
kills every holder; the namespaces, veths and tmpfs mounts vanish with them. The holders also
die with the process that made them (parent-death signal), so a crashed test leaves nothing.

    with EmulatedHosts(["a", "b"], shared_dir=tmp) as hosts:
        hosts.run("b", ["hostname"])            # -> "b"
        hosts.address("a")                      # -> "10.78.0.1"
        hosts.popen("a", [...]); hosts.link_bytes("b") -> (rx, tx) of b's eth0

CLI: ``python tools/emulated_hosts.py --hosts a,b -- CMD`` runs CMD on each host in turn (a
check that the hosts exist); ``tools/multi_host_demo.py`` runs one Fluxon cache over them.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["EmulatedHosts", "EmulatedHostsError", "SUBNET", "SHARED_MOUNT", "clean_env"]

SUBNET = "10.78.0"
SHARED_MOUNT = "/tmp/shared"
BRIDGE = "csbr0"
_UNSHARE = ["unshare", "--net", "--uts", "--mount", "--ipc", "--pid", "--fork", "--mount-proc",
            "--kill-child=SIGKILL", "--"]
# $1 hostname, $2 /tmp size, $3 /dev/shm size, $4 shared_dir ("": none), $5 where it is bound,
# $6... folders under /tmp or /dev/shm that stay visible at their own path (the caller's Python)
_HOST_SETUP = r"""
set -e
ip link set lo up
hostname "$1"
tmp_size=$2 shm_size=$3 shared=$4 shared_at=$5
shift 5
[ -n "$shared" ] && exec 3<"$shared"
fd=4; for dir in "$@"; do eval "exec $fd<\"\$dir\""; fd=$((fd + 1)); done
mount -t tmpfs -o "size=$tmp_size,mode=1777" cs-tmp /tmp
mount -t tmpfs -o "size=$shm_size,mode=1777" cs-shm /dev/shm
if [ -n "$shared" ]; then mkdir -p "$shared_at"; mount --no-canonicalize --bind /proc/self/fd/3 "$shared_at"; exec 3<&-; fi
fd=4; for dir in "$@"; do mkdir -p "$dir"; mount --no-canonicalize --bind /proc/self/fd/$fd "$dir"; eval "exec $fd<&-"; fd=$((fd + 1)); done
echo ready
exec sleep infinity
"""
_BRIDGE_SETUP = f"""
set -e
ip link set lo up
ip link add {BRIDGE} type bridge
ip link set {BRIDGE} up
echo ready
exec sleep infinity
"""


def _kept_folders() -> list[str]:
    """The folders of this Python (its venv and base install) and of the repository that lie
    under /tmp or /dev/shm, which a host's own tmpfs would hide: bound back at their own paths so
    that ``sys.executable`` runs inside a host (a clone under /tmp, as CI's may be)."""
    hidden = (Path("/tmp"), Path("/dev/shm"))
    found = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, Path(__file__).resolve().parents[1])}
    found = {p for p in found if any(p != h and p.is_relative_to(h) for h in hidden)}
    kept = sorted(str(p) for p in found if not any(q != p and p.is_relative_to(q) for q in found))
    return kept[:6]  # descriptors 4-9 carry them through the tmpfs mount


def clean_env(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``env`` (default os.environ) without the LD_LIBRARY_PATH entry fluxon-py's loader adds to
    this process (its bundled libmount and libselinux break ``mount``, ``ip`` and ``nsenter``)."""
    out = dict(os.environ if env is None else env)
    kept = [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and "fluxon_pyo3.libs" not in p]
    if kept:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    else:
        out.pop("LD_LIBRARY_PATH", None)
    return out


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EmulatedHostsError(RuntimeError):
    pass


class _Holder:
    """One process holding a set of namespaces: ``pid`` is its PID 1, seen from here."""

    def __init__(self, label: str, script: str, args: Sequence[str], timeout_s: float) -> None:
        self.label = label
        self.proc = subprocess.Popen([*_UNSHARE, "bash", "-c", script, "emulated-host", label, *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=clean_env(), preexec_fn=_die_with_parent)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            self.proc.kill()
            err = self.proc.communicate(timeout=timeout_s)[1].strip()
            raise EmulatedHostsError(f"cannot set up {label}: {err or 'the namespace setup failed'} (needs root "
                                     "and a kernel with veth and bridge)")
        deadline = time.monotonic() + timeout_s
        while True:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            if kids:
                self.pid = int(kids[0])
                return
            if time.monotonic() > deadline:
                raise EmulatedHostsError(f"{label}: no namespace holder after {timeout_s:.0f} s")
            time.sleep(0.01)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # PID 1: its whole PID namespace goes with it
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


class EmulatedHosts:
    """``names`` hosts (at most 250), each with ``tmp_size`` of /tmp and ``shm_size`` of /dev/shm
    (tmpfs limits, taken from RAM only as used). Lifecycle: ``start()`` -> hosts exist ->
    ``close()`` (idempotent; also on a failed start); the context manager does both."""

    def __init__(self, names: Sequence[str], *, shm_size: str = "1g", tmp_size: str = "512m",
                 shared_dir: Optional[os.PathLike[str]] = None, timeout_s: float = 20.0) -> None:
        if not names or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"hosts: give 1 to 250 distinct names, got {list(names)!r}")
        for n in names:
            if not n.replace("-", "").isalnum():
                raise ValueError(f"hosts: {n!r} is not a hostname (letters, digits, '-')")
        self.names = list(names)
        self.shm_size, self.tmp_size = shm_size, tmp_size
        self.shared_dir = Path(shared_dir).absolute() if shared_dir else None
        self.timeout_s = timeout_s
        self._bridge: Optional[_Holder] = None
        self._hosts: dict[str, _Holder] = {}

    def __enter__(self) -> "EmulatedHosts":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def holder_pid(self, name: Optional[str] = None) -> Optional[int]:
        """The pid of the process that holds host ``name``'s namespaces (None: the bridge's), or
        None when it is not started: every namespace goes when `close` ends its holder."""
        holder = self._bridge if name is None else self._hosts.get(name)
        return holder.pid if holder is not None else None

    def start(self) -> "EmulatedHosts":
        for tool in ("unshare", "nsenter", "ip"):
            if shutil.which(tool) is None:
                raise EmulatedHostsError(f"'{tool}' not found on PATH (fix: apt-get install util-linux iproute2)")
        if os.geteuid() != 0:
            raise EmulatedHostsError("emulated hosts need root (network, mount and PID namespaces)")
        try:
            self._bridge = _Holder("bridge", _BRIDGE_SETUP, [], self.timeout_s)
            shared = str(self.shared_dir) if self.shared_dir else ""
            for i, name in enumerate(self.names):
                holder = _Holder(name, _HOST_SETUP, [self.tmp_size, self.shm_size, shared, SHARED_MOUNT,
                                                     *_kept_folders()], self.timeout_s)
                self._hosts[name] = holder
                tmp_if = f"csh{i}"
                self._ip(self._bridge, "link", "add", f"csv{i}", "type", "veth", "peer", "name", tmp_if)
                self._ip(self._bridge, "link", "set", f"csv{i}", "master", BRIDGE, "up")
                self._ip(self._bridge, "link", "set", tmp_if, "netns", str(holder.pid))
                self._ip(holder, "link", "set", tmp_if, "name", "eth0")
                self._ip(holder, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                self._ip(holder, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for holder in list(self._hosts.values()) + ([self._bridge] if self._bridge else []):
            holder.kill()
        self._hosts.clear()
        self._bridge = None

    def command(self, name: str, argv: Sequence[str], cwd: Optional[str] = None) -> list[str]:
        """``argv`` as run on host ``name`` (in its namespaces, in ``cwd``, default this folder)."""
        holder = self._hosts.get(name)
        if holder is None:
            raise EmulatedHostsError(f"no running host {name!r} (hosts: {', '.join(self._hosts) or 'none'})")
        return ["nsenter", "--target", str(holder.pid), "--net", "--uts", "--mount", "--ipc", "--pid",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        kw["env"] = clean_env(kw.get("env"))
        return subprocess.Popen(self.command(name, argv, kw.pop("cwd", None)), **kw)

    def run(self, name: str, argv: Sequence[str], timeout: float = 60.0, **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw["env"] = clean_env(kw.get("env"))
        return subprocess.run(self.command(name, argv, kw.pop("cwd", None)), timeout=timeout, **kw)

    def link_bytes(self, name: str) -> tuple[int, int]:
        """(received, sent) bytes of host ``name``'s eth0, from its /proc/net/dev."""
        out = self.run(name, ["cat", "/proc/net/dev"], timeout=10).stdout
        for line in out.splitlines():
            if line.strip().startswith("eth0:"):
                fields = line.split(":", 1)[1].split()
                return int(fields[0]), int(fields[8])
        raise EmulatedHostsError(f"host {name}: no eth0 in /proc/net/dev")

    def _ip(self, holder: _Holder, *args: str) -> None:
        cmd = ["nsenter", "--target", str(holder.pid), "--net", "--", "ip", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=clean_env())
        if out.returncode != 0:
            raise EmulatedHostsError(f"{holder.label}: ip {' '.join(args)} failed: {out.stderr.strip()}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="a,b", help="comma-separated host names (default a,b)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...], run on each host in turn")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        command = ["sh", "-c", "echo $(hostname): $(ip -4 -o addr show eth0 | awk '{print $4}')"]
    status = 0
    try:
        with EmulatedHosts(args.hosts.split(",")) as hosts:
            for name in hosts.names:
                status = max(status, subprocess.call(hosts.command(name, command), env=clean_env()))
    except (EmulatedHostsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
