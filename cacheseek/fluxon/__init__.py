"""Real Fluxon (the public fluxon-py 0.2.4 package): a local service and a bounded-time client.

One role a module:

- the service: `service.FluxonService` starts and stops a single-node service (etcd, KV master,
  owner) under one folder, used by ``tools/fluxon_service.py`` and the ``fluxon`` test fixture;
  `config` (defaults, the master's and owner's configs), `etcd` (its binary, command line and
  health), `netns` (the private network namespace it needs);
- the client: `client.FluxonClient` attaches to a running service, every call bounded in time;
  `owner` (finding the serving owner), `loader` (importing fluxon-py), `native_store` and
  `native_output` (fluxon-py's native client and what it prints), `calls` (bounded calls),
  `results` (Results to errors), `values` (the value format, `ValueView`), `held_views` (views
  handed out, removes they hide), `segment` (the owner's segment as mapped here), `key_index`;
- `errors`: the errors of both.

Importing this package costs nothing: fluxon-py (and numpy) are imported inside functions.
"""

from cacheseek.fluxon.client import FluxonClient
from cacheseek.fluxon.errors import (
    FluxonImportError,
    FluxonServiceError,
    FluxonUnavailableError,
    FluxonValueTooLargeError,
)
from cacheseek.fluxon.loader import fluxon_runtime_info
from cacheseek.fluxon.netns import private_netns_problem
from cacheseek.fluxon.segment import SegmentMapping
from cacheseek.fluxon.service import FluxonService
from cacheseek.fluxon.values import ValueView

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
