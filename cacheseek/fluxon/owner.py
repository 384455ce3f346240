"""Finding the owner that serves a cluster: its ``shared.json``, checked before Fluxon is touched.

A serving owner writes ``<share_mem_path>/<cluster>/shared.json`` beside its segment (the
cluster name, the segment length, the etcd endpoints). fluxon-py 0.2.4's ``new_store`` blocks
forever without an owner, so a client reads this file first: no file, an unreadable one, one of
another cluster, or one whose etcd refuses connections (the service that wrote it is gone) is
`FluxonUnavailableError` with the command that starts a service.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cacheseek.fluxon.errors import FluxonUnavailableError
from cacheseek.fluxon.etcd import live_endpoints

__all__ = ["SHARED_JSON", "owner_info"]

SHARED_JSON = "shared.json"


def owner_info(segment_dir: Path, cluster_name: str, share_mem_path: str) -> dict[str, Any]:
    """The ``shared.json`` of the owner serving ``cluster_name``; raises `FluxonUnavailableError`."""
    path = segment_dir / SHARED_JSON
    hint = (f"start one with: python tools/fluxon_service.py start --cluster-name {cluster_name} "
            f"--share-mem-path {share_mem_path} (inside the same network namespace)")
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise FluxonUnavailableError(
            f"no Fluxon owner serves cluster {cluster_name!r}: {path} does not exist; {hint}") from None
    except (OSError, ValueError) as exc:
        raise FluxonUnavailableError(f"cannot read the owner's {path}: {exc}; {hint}") from None
    if info.get("cluster_name") not in (None, cluster_name):
        raise FluxonUnavailableError(
            f"{path} belongs to cluster {info.get('cluster_name')!r}, not {cluster_name!r}")
    endpoints = [e for e in info.get("etcd_addresses") or [] if isinstance(e, str)]
    if endpoints and not live_endpoints(endpoints, 1.0):
        raise FluxonUnavailableError(
            f"{path} is stale: the service that wrote it is gone (its etcd {', '.join(endpoints)} "
            f"refuses connections); {hint}")
    return info
