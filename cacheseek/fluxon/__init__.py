"""Real Fluxon (the public fluxon-py 0.2.4 package): a local service and a bounded-time client.

- `service.FluxonService`: starts and stops a single-node service (etcd, KV master, owner) under
  one folder; used by ``tools/fluxon_service.py`` and by the ``fluxon`` test fixture.
- `client.FluxonClient`: attaches to a running service; every call is bounded in time.

Importing this package costs nothing: fluxon-py (and numpy) are imported inside methods.
"""

from cacheseek.fluxon.client import (
    FluxonClient,
    FluxonImportError,
    FluxonUnavailableError,
    FluxonValueTooLargeError,
    SegmentMapping,
    ValueView,
    fluxon_runtime_info,
)
from cacheseek.fluxon.service import FluxonService, FluxonServiceError, private_netns_problem

__all__ = [
    "FluxonClient",
    "FluxonImportError",
    "FluxonService",
    "FluxonServiceError",
    "FluxonUnavailableError",
    "FluxonValueTooLargeError",
    "SegmentMapping",
    "ValueView",
    "fluxon_runtime_info",
    "private_netns_problem",
]
