"""What a local Fluxon service is configured with: the defaults clients attach with, and the
master's and owner's configs as handed to Fluxon (0.2.4 rejects unknown keys).

The owner's segment is ``<share_mem_path>/<cluster_name>/mmap.file``, ``dram`` bytes aligned down
to Fluxon's 16 MiB granule (``SEGMENT_ALIGN``). The master and owner find each other through the
one etcd (``etcd_endpoints``: 127.0.0.1 on one host, the control plane's address across hosts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CLUSTER_NAME", "DEFAULT_SHARE_MEM_PATH", "SEGMENT_ALIGN", "master_config", "owner_config"]

SEGMENT_ALIGN = 16 * 1024 * 1024  # Fluxon aligns the owner's dram contribution down to this
DEFAULT_CLUSTER_NAME = "cacheseek"
DEFAULT_SHARE_MEM_PATH = "/dev/shm/cacheseek-fluxon"


def master_config(cluster_name: str, port: int, etcd_endpoints: list[str], log_dir: Path) -> dict[str, Any]:
    """The KV master's config (``master.yaml``)."""
    return {
        "instance_key": f"{cluster_name}-master",
        "cluster_name": cluster_name,
        "port": port,
        "etcd_endpoints": etcd_endpoints,
        "log_dir": str(log_dir),
        # required by 0.2.4 even though nothing listens there (loopback, discard port)
        "monitoring": {"prometheus_base_url": "http://127.0.0.1:9/api/v1"},
    }


def owner_config(cluster_name: str, dram_bytes: int, etcd_endpoints: list[str], share_mem_path: str,
                 large_dir: Path, p2p_port: int, instance_key: str = "") -> dict[str, Any]:
    """The owner's config (``owner.yaml``): it contributes ``dram_bytes`` of ``share_mem_path``;
    Fluxon writes the owner's and every client's log under ``large_dir``. Owners of one cluster
    on several hosts each need their own ``instance_key`` (default ``<cluster>-owner``)."""
    return {
        "instance_key": instance_key or f"{cluster_name}-owner",
        "contribute_to_cluster_pool_size": {"dram": dram_bytes, "vram": {}},
        "fluxonkv_spec": {
            "etcd_addresses": etcd_endpoints,
            "cluster_name": cluster_name,
            "share_mem_path": share_mem_path,
            "sub_cluster": "default",
            "large_file_paths": [str(large_dir)],
            "p2p_listen_port": p2p_port,
        },
    }
