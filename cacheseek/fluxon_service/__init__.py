"""Starting and stopping a Fluxon service from this process (the launcher; the client is `cacheseek.fluxon`).

`service.FluxonService` runs a single-node service (etcd, KV master, owner) under one folder, or
an owner joining another host's control plane; ``tools/fluxon_service.py``, ``tools/workers.py``,
the ``fluxon`` test fixture and the experiments start theirs with it. `children` (the child
processes, their logs, the ordered stop), `netns` (the private network namespace it needs),
`owner_sizing` (the ``dram`` an owner needs for a geometry). Nothing in the client imports it.
"""

from cacheseek.fluxon_service.netns import private_netns_problem
from cacheseek.fluxon_service.service import FluxonService

__all__ = ["FluxonService", "private_netns_problem"]
