"""Whether this process runs in a private network namespace, as the local Fluxon service needs.

The Fluxon master and owner listen on every interface and advertise the machine's non-loopback
address, so on a shared machine the service and its clients run in a namespace of their own
(``tools/netns-run.sh`` makes one with only ``lo`` and a veth pair ``fx0``/``fx1``).
`private_netns_problem` says why the current namespace is not such a one, or None.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any, Optional

__all__ = ["private_netns_problem", "NETNS_INTERFACES", "NETNS_HINT"]

NETNS_INTERFACES = frozenset({"lo", "fx0", "fx1"})  # what tools/netns-run.sh creates
NETNS_HINT = "run it inside a private network namespace: tools/netns-run.sh CMD..."


def _netns_interfaces(proc_net_dev: str = "/proc/self/net/dev") -> list[str]:
    """Interface names of this process's network namespace (/sys/class/net shows the namespace
    that mounted sysfs instead, so it cannot tell)."""
    with open(proc_net_dev) as f:
        return sorted(line.split(":", 1)[0].strip() for line in f if ":" in line)


def _netns_links() -> Optional[list[dict[str, Any]]]:
    """``ip -j link show`` of this namespace, or None when ``ip`` is unavailable."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        out = subprocess.run([ip, "-j", "link", "show"], capture_output=True, timeout=5, check=True)
        return json.loads(out.stdout.decode() or "[]")
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def private_netns_problem(
    interfaces: Optional[list[str]] = None, links: Optional[list[dict[str, Any]]] = None
) -> Optional[str]:
    """None when this process runs in a private network namespace like netns-run.sh makes (only
    ``lo`` and the veth pair ``fx0``/``fx1`` peered with each other); otherwise why not.
    ``interfaces`` and ``links`` (``ip -j link`` records) are read from the system when None."""
    if interfaces is None:
        try:
            interfaces = _netns_interfaces()
        except OSError as exc:
            return f"cannot list this namespace's network interfaces: {exc}"
    names = sorted(interfaces)
    extra = [n for n in names if n not in NETNS_INTERFACES]
    if extra:
        return (f"network interfaces {', '.join(extra)} are visible, so this is not a private "
                f"namespace (expected only lo, fx0, fx1); {NETNS_HINT}")
    if "fx0" not in names or "fx1" not in names:
        return (f"no veth pair fx0/fx1 (interfaces: {', '.join(names) or 'none'}): the Fluxon "
                f"master needs a non-loopback address; {NETNS_HINT}")
    if links is None:
        links = _netns_links()
    if links is not None:
        by_name = {rec.get("ifname"): rec for rec in links}
        for a, b in (("fx0", "fx1"), ("fx1", "fx0")):
            rec = by_name.get(a) or {}
            if rec.get("link") != b or "link_netnsid" in rec:
                return f"{a} is not peered with {b} inside this namespace; {NETNS_HINT}"
    return None
