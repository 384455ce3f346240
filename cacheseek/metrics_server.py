"""`MetricsServer`: the Prometheus endpoint of one process, ``http://127.0.0.1:PORT/metrics``.

Off unless asked for (``metrics.port=`` in the CLI and tools/workers.py, `serve_metrics` for a
TeleFuser service). It binds loopback only (``metrics.host``, 127.0.0.1 by default; another
address is refused): a Prometheus on the same host scrapes it directly, one elsewhere through
an agent on this host (a Prometheus agent or Grafana Alloy scraping loopback and
remote-writing). Port 0 lets the OS pick a free port; the bound one is `port` (logged, printed
by the CLI, in results.json as ``metrics_endpoint``).

Several worker processes: one endpoint per process, one port each (tools/workers.py gives worker
k ``metrics.port=P+k``, or port 0 to each and reports the ports it got). Prometheus scrapes each
as its own target; counters add up across targets (``sum``), the store's gauges of a shared
store do not (``max``: each worker sees the same store).

The server runs prometheus-client's WSGI server on a daemon thread with a private
`CollectorRegistry` holding one `CacheCollector`: nothing is registered globally, so any number
of servers (tests, several caches in one process) coexist. `close` stops it and frees the port.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import threading
import time
from typing import Any, Optional

import attrs
from prometheus_client import CollectorRegistry, start_http_server

from cacheseek.errors import ConfigError
from cacheseek.metrics import CacheMetrics
from cacheseek.prometheus import CacheCollector

log = logging.getLogger(__name__)

__all__ = ["MetricsConfig", "MetricsServer", "serve_metrics"]


def _port(_inst: Any, _attr: Any, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535):
        raise ConfigError("metrics.port", f"must be a TCP port in 0..65535 (0: the OS picks one) or null (off), "
                          f"got {value!r}", "metrics.port=0")


def _host(_inst: Any, _attr: Any, value: str) -> None:
    if not is_loopback(value):
        raise ConfigError("metrics.host", f"{value!r} is not a loopback address: the endpoint serves this host "
                          "only", "metrics.host=127.0.0.1 (scrape from elsewhere through an agent on this host)")


def _hold(_inst: Any, _attr: Any, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError("metrics.hold_s", f"must be seconds >= 0, got {value!r}", "metrics.hold_s=0")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.frozen(slots=True)
class MetricsConfig:
    """``metrics``: ``port`` (None: no endpoint; 0: the OS picks), ``host`` (a loopback
    address), ``hold_s`` (the CLI keeps serving that long after its report, for a last scrape;
    SIGTERM or Ctrl-C ends the wait early)."""

    port: Optional[int] = attrs.field(default=None, validator=_port)
    host: str = attrs.field(default="127.0.0.1", validator=_host)
    hold_s: float = attrs.field(default=0.0, validator=_hold)

    @classmethod
    def from_conf(cls, node: Any) -> "MetricsConfig":
        if node is None:
            return cls()
        get = node.get if hasattr(node, "get") else lambda k, d=None: getattr(node, k, d)
        return cls(port=get("port", None), host=str(get("host", "127.0.0.1")), hold_s=get("hold_s", 0.0))

    def with_port_offset(self, offset: int) -> "MetricsConfig":
        """Worker ``offset``'s config: port P+offset (0 stays 0: the OS picks for each)."""
        return self if not self.port else attrs.evolve(self, port=self.port + offset)


class MetricsServer:
    """The endpoint over ``metrics`` (see the module docstring). `start` binds and serves."""

    def __init__(self, metrics: CacheMetrics, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = MetricsConfig(port=port, host=host)
        self.metrics = metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CacheCollector(metrics))
        self._httpd: Any = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MetricsServer":
        """Bind and serve on a daemon thread; a port in use is a `ConfigError` naming
        ``metrics.port`` (fix: another port, or 0)."""
        try:
            self._httpd, self._thread = start_http_server(self.config.port, addr=self.config.host,
                                                          registry=self.registry)
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror or exc}"
            raise ConfigError("metrics.port", f"{self.config.host}:{self.config.port} {why}",
                              "metrics.port=0 (the OS picks a free port) or another port") from exc
        log.info("metrics: serving %s", self.url)
        return self

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1]) if self._httpd is not None else int(self.config.port or 0)

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/metrics"

    def hold(self, seconds: float) -> None:
        """Keep serving for ``seconds`` (a last scrape after the run); SIGTERM or SIGINT ends the
        wait early (from the main thread; elsewhere it just waits)."""
        if seconds <= 0:
            return
        done = threading.Event()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: done.set())
        try:
            log.info("metrics: holding %s for %.0f s", self.url, seconds)
            deadline = time.monotonic() + seconds
            while not done.is_set() and time.monotonic() < deadline:
                done.wait(min(0.2, max(0.0, deadline - time.monotonic())))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> "MetricsServer":
        return self.start() if self._httpd is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def serve_metrics(metrics: Any, *, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``metrics`` (a `CacheMetrics`, or a manager: its ``metrics``) on ``host:port`` and
    return the started server (``server.url``; ``server.close()`` to stop)."""
    target = metrics if isinstance(metrics, CacheMetrics) else metrics.metrics
    return MetricsServer(target, host=host, port=port).start()
