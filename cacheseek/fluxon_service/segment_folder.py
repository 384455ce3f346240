"""`SegmentFolder`: the owner's segment folder ``<share_mem_path>/<cluster_name>`` (its
``mmap.file`` and ``shared.json``) and fluxon-py's local IPC files of it
(``/tmp/fluxon_ipc/<sha256(segment folder)[:20]>``), as one service claims and removes them.

Lifecycle::

    claim(dram_bytes)   a folder a live owner serves (its etcd answers) is refused; a stale one
                        (its service gone) is removed; the share root made if missing; its free
                        space checked against the segment; from here on the folder is this
                        service's
    remove()            the folder and the IPC files removed (and ``/tmp/fluxon_ipc``, the share
                        root this service made, when empty); only a folder this service claimed:
                        never another live service's
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.fluxon.errors import FluxonServiceError
from cacheseek.fluxon.etcd import live_endpoints
from cacheseek.fluxon.owner import SHARED_JSON
from cacheseek.sizes import format_size

__all__ = ["SegmentFolder"]

log = logging.getLogger("cacheseek.fluxon_service.service")


class SegmentFolder:
    """The segment folder of ``endpoint``'s cluster (see the module docstring)."""

    def __init__(self, endpoint: FluxonEndpoint) -> None:
        self.path = endpoint.segment_dir
        self._root = Path(endpoint.share_mem_path)
        self._cluster_name = endpoint.cluster_name
        self._owned = False  # set once this service may create the folder
        self._created_root = False

    @property
    def ipc_dir(self) -> Path:
        """Where fluxon-py 0.2.4 keeps the local IPC (iceoryx2) files of this segment."""
        digest = hashlib.sha256(str(self.path).encode()).hexdigest()[:20]
        return Path(tempfile.gettempdir()) / "fluxon_ipc" / digest

    @property
    def shared_json(self) -> Path:
        return self.path / SHARED_JSON

    def claim(self, dram_bytes: int) -> None:
        seg = self.path
        if seg.exists():
            info = None
            with contextlib.suppress(OSError, ValueError):
                info = json.loads((seg / SHARED_JSON).read_text())
            live = live_endpoints((info or {}).get("etcd_addresses"), 0.5)
            if live:
                raise FluxonServiceError(
                    f"a Fluxon owner already serves cluster {self._cluster_name!r} at {seg} (its etcd "
                    f"{live[0]} answers); stop it, or choose another cluster_name/share_mem_path")
            log.warning("fluxon service: removing the stale segment folder %s of a service that is gone", seg)
            shutil.rmtree(seg, ignore_errors=True)
        self._owned = True
        root = self._root
        if not root.exists():
            root.mkdir(parents=True)
            self._created_root = True
        free = shutil.disk_usage(root).free
        if free < dram_bytes:
            raise FluxonServiceError(
                f"{root} has {format_size(free)} free, less than the {format_size(dram_bytes)} "
                "segment asked for: lower dram or free shared memory")

    def remove(self) -> None:
        if not self._owned:  # never another live service's folder
            return
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.ipc_dir.parent)  # fluxon's shared /tmp/fluxon_ipc, only if empty
        if self._created_root:
            with contextlib.suppress(OSError):
                os.rmdir(self._root)  # only if empty
        self._owned = self._created_root = False
