"""Real Fluxon (the public fluxon-py 0.2.4 package): a bounded-time client of a running service.

One role a module: `client.FluxonClient` attaches to a running service, every call bounded in
time; `endpoint` (`FluxonEndpoint`: the cluster, its path and time bounds, what every Fluxon
constructor builds), `attach` (attaching), `owner` (finding the serving owner), `etcd` (its binary, command line and health),
`loader` (importing fluxon-py), `native_store` and `native_output` (fluxon-py's native client and
what it prints), `calls` (bounded calls), `results` (Results to errors), `values` (the value
format, `ValueView`), `held_views` (views handed out, removes they hide), `segment` (the owner's
segment as mapped here), `key_index`, `config` (the defaults clients attach with, and the
master's and owner's configs); `errors`. Starting a service is `cacheseek.fluxon_service`'s.

Importing this package costs nothing: fluxon-py (and numpy) are imported inside functions.
"""

from cacheseek.fluxon.client import FluxonClient
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.fluxon.errors import (FluxonImportError, FluxonServiceError, FluxonUnavailableError,
                                     FluxonValueTooLargeError)
from cacheseek.fluxon.loader import fluxon_runtime_info
from cacheseek.fluxon.segment import SegmentMapping
from cacheseek.fluxon.values import ValueView

__all__ = ["FluxonClient", "FluxonEndpoint", "FluxonImportError", "FluxonServiceError", "FluxonUnavailableError",
           "FluxonValueTooLargeError", "SegmentMapping", "ValueView", "fluxon_runtime_info"]
