"""A Fluxon service (etcd + KV master + owner, or an owner joining one) that this process starts
and stops.

Three roles, one class:

- single host (default): etcd on 127.0.0.1, the master and one owner;
- control plane of several hosts (``listen_host=ADDR``): the same, etcd also on ``ADDR`` (fixed
  ``etcd_port``, default 2379) so that owners on other hosts can join;
- joining owner (``join="ADDR:PORT"``, that etcd): only an owner, registered with the control
  plane's master; workers on its host attach to it exactly as to a single-host service.

Across hosts each owner has its own ``share_mem_path`` segment and ``p2p_port`` (other owners pull
values from it over TCP), one cluster name, ``sub_cluster: default``. ``sizing`` (`OwnerSizing`)
refuses a ``dram`` too small for the geometry's values before anything starts.

`FluxonService` is what ``tools/fluxon_service.py`` runs and what the ``fluxon`` test fixture
uses. Everything lives under one work folder (``workdir``)::

    workdir/.lock                 one FluxonService per folder (flock)
    workdir/master.yaml           configs as handed to Fluxon (unknown keys are rejected by it)
    workdir/owner.yaml
    workdir/logs/etcd.log         stdout+stderr of each child
    workdir/logs/master.log
    workdir/logs/owner.log
    workdir/logs/master/          the master's own log_dir
    workdir/large/                the owner's large_file_paths; Fluxon writes the owner's and every
                                  client's log under large/<cluster>_cluster_kv_logs/
    workdir/etcd/                 etcd's data (wiped at start and at stop)

Outside it: the segment folder (below) and fluxon-py's local IPC files under
``/tmp/fluxon_ipc/<sha256(segment folder)[:20]>``; `stop` removes both (and ``/tmp/fluxon_ipc``
when nothing else is left in it).

The owner's shared-memory segment is ``<share_mem_path>/<cluster_name>/mmap.file``; it writes
``shared.json`` beside it once it serves, which is what `start` waits for. Clients attach with
``cluster_name`` and ``share_mem_path`` (`attach_info`).

Its parts live beside it: the configs handed to Fluxon (`cacheseek.fluxon.config`), the child
processes and their logs (`cacheseek.fluxon_service.children`), the etcd binary and health checks
(`cacheseek.fluxon.etcd`), the namespace check
(`cacheseek.fluxon_service.netns`), the segment folder (`cacheseek.fluxon_service.segment_folder`); this module re-exports what ``tools/fluxon_service.py`` reaches
through it.

Lifecycle::

    FluxonService(...)  --start()-->  running  --stop()-->  stopped (segment folder removed)
    start() failing stops whatever it had started and raises FluxonServiceError with log tails.
    stop() is idempotent; the context manager calls start() and stop().

Hazards (docs/design.md, "Fluxon"):
- The master and owner listen on every interface and advertise the machine's non-loopback
  address. On a shared machine run the service and its clients inside a private network
  namespace (``tools/netns-run.sh``); ``require_private_netns`` (default True) refuses
  to start elsewhere (across real hosts, where that address is the point, turn it off). etcd
  listens on 127.0.0.1, and on ``listen_host`` for a control plane.
- The master and owner bind a parent-death signal to the thread that started them: keep that
  thread (and process) alive for as long as the service should run.
- The idle master and owner each busy-poll about one core.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

from cacheseek.errors import ConfigError
from cacheseek.fluxon_service.children import Children, free_ports
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.fluxon.config import (DEFAULT_CLUSTER_NAME, DEFAULT_SHARE_MEM_PATH, SEGMENT_ALIGN, master_config,
                                     owner_config)
from cacheseek.fluxon.errors import FluxonServiceError
from cacheseek.fluxon.etcd import etcd_command, etcd_healthy, resolve_etcd_binary
from cacheseek.fluxon.loader import fluxon_py_problem
from cacheseek.fluxon_service.netns import private_netns_problem
from cacheseek.fluxon_service.owner_sizing import OwnerSizing
from cacheseek.fluxon_service.segment_folder import SegmentFolder
from cacheseek.sizes import format_size, parse_size

log = logging.getLogger(__name__)

# Besides FluxonService, the names tools/fluxon_service.py reaches through this module.
__all__ = ["FluxonService", "FluxonServiceError", "parse_size", "format_size", "private_netns_problem",
           "resolve_etcd_binary", "fluxon_py_problem", "local_service_problem", "SEGMENT_ALIGN", "DEFAULT_ETCD_PORT",
           "OwnerSizing", "DEFAULT_CLUSTER_NAME", "DEFAULT_SHARE_MEM_PATH"]


DEFAULT_ETCD_PORT = 2379  # the control plane's etcd across hosts (etcd's own default)


def local_service_problem() -> Optional[str]:
    """Why a real local Fluxon service cannot start here (no fluxon-py, no etcd binary, not
    inside a private network namespace), or None."""
    problem = fluxon_py_problem()
    if problem:
        return problem
    try:
        resolve_etcd_binary()
    except FluxonServiceError as exc:
        return str(exc)
    return private_netns_problem()


# -- the service --------------------------------------------------------------------------------


class FluxonService:
    """Starts etcd, a Fluxon KV master and one owner contributing ``dram`` bytes of /dev/shm.

    ``workdir``: the one folder for configs, logs and etcd data. ``cluster_name`` and
    ``share_mem_path`` are what clients attach with (defaults match `FluxonBytesStore`'s).
    ``client_instance_key``: the instance key prefix suggested to clients (`attach_info`).
    ``ready_timeout_s`` bounds `start`; ``stop_timeout_s`` bounds each child's clean exit before
    SIGKILL. ``fluxon_log``: FLUXON_LOG level of the master and owner (their logs only).
    ``listen_host``, ``join``, ``etcd_port``, ``master_port``, ``p2p_port`` (0: a free port) and
    ``sizing``: the multi-host roles (module docstring).
    """

    def __init__(
        self,
        workdir: Union[str, os.PathLike[str]],
        *,
        dram: Union[str, int] = "256MiB",
        cluster_name: str = DEFAULT_CLUSTER_NAME,
        share_mem_path: str = DEFAULT_SHARE_MEM_PATH,
        client_instance_key: str = "cacheseek-client",
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        require_private_netns: bool = True,
        etcd_bin: Optional[str] = None,
        fluxon_log: str = "info",
        listen_host: Optional[str] = None,
        join: Optional[str] = None,
        etcd_port: int = 0,
        master_port: int = 0,
        p2p_port: int = 0,
        sizing: Optional[OwnerSizing] = None,
    ) -> None:
        dram_bytes = parse_size(dram, "dram")
        aligned = dram_bytes - dram_bytes % SEGMENT_ALIGN
        if aligned < SEGMENT_ALIGN:
            raise ConfigError("dram", f"{dram!r} is below Fluxon's 16 MiB segment granule", "use at least 16MiB")
        if aligned != dram_bytes:
            log.info("fluxon service: dram %s aligned down to %s (16 MiB granule)", dram, format_size(aligned))
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", cluster_name or ""):
            raise ConfigError("cluster_name", f"{cluster_name!r} is not a plain name", "use letters, digits, '_', '-', '.'")
        if sizing is not None:
            sizing.check(aligned)
        if listen_host is not None and join is not None:
            raise ConfigError("join", "a control plane (listen_host) does not join another one",
                              "give listen_host on the control-plane host, join on the others")
        if join is not None:
            host, _, port = join.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("join", f"{join!r} is not host:port of the control plane's etcd",
                                  f"e.g. 10.0.0.1:{DEFAULT_ETCD_PORT}")
        if listen_host is not None:
            try:
                socket.inet_aton(listen_host)
            except OSError:
                raise ConfigError("listen_host", f"{listen_host!r} is not an IPv4 address",
                                  "give the address the other hosts reach this one at") from None
        self.endpoint = FluxonEndpoint(cluster_name, share_mem_path, client_instance_key, field_prefix="")
        self.workdir = Path(workdir).expanduser().absolute()
        self.dram_bytes = aligned
        self._segment = SegmentFolder(self.endpoint)
        self.ready_timeout_s = float(ready_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.require_private_netns = require_private_netns
        self._etcd_bin_arg = etcd_bin
        self.fluxon_log = fluxon_log
        self.logs_dir = self.workdir / "logs"
        self.listen_host, self.join = listen_host, join
        self._ports = (etcd_port or (DEFAULT_ETCD_PORT if listen_host else 0), master_port, p2p_port)
        self.etcd_port = self.etcd_peer_port = self.master_port = self.owner_port = 0
        self._children = Children(self.workdir, self.logs_dir, {"FLUXON_LOG": fluxon_log, "PYTHONUNBUFFERED": "1"},
                                  ("etcd", "master", "owner"))
        self._lock_fd: Optional[int] = None
        self._running = False
        self.ready_seconds: Optional[float] = None

    # -- what clients need ----------------------------------------------------------------------
    @property
    def cluster_name(self) -> str:
        return self.endpoint.cluster_name

    @property
    def share_mem_path(self) -> str:
        return self.endpoint.share_mem_path

    @property
    def instance_key(self) -> str:
        """The client instance key prefix to attach with (each client makes it unique)."""
        return self.endpoint.instance_key

    @property
    def segment_dir(self) -> Path:
        return self._segment.path

    @property
    def ipc_dir(self) -> Path:
        """Where fluxon-py 0.2.4 keeps the local IPC (iceoryx2) files of this segment."""
        return self._segment.ipc_dir

    @property
    def shared_json(self) -> Path:
        return self._segment.shared_json

    @property
    def etcd_endpoint(self) -> str:
        """``host:port`` of the etcd the owner (and master) register with."""
        if self.join:
            return self.join
        return f"{self.listen_host or '127.0.0.1'}:{self.etcd_port}" if self.etcd_port else ""

    @property
    def requested_ports(self) -> tuple[int, int, int]:
        """The etcd, master and p2p ports asked for at construction (0: picked free at start;
        etcd's is the default one when ``listen_host`` opens the cluster to other hosts)."""
        return self._ports

    @property
    def role(self) -> str:
        return "owner" if self.join else "control" if self.listen_host else "single"

    @property
    def running(self) -> bool:
        return self._running

    @property
    def pids(self) -> dict[str, int]:
        return self._children.pids

    def attach_info(self) -> dict[str, Any]:
        """Everything a client (or a CacheSeek run) needs to attach, JSON-serialisable."""
        return {
            "cluster_name": self.cluster_name,
            "share_mem_path": self.share_mem_path,
            "instance_key": self.instance_key,
            "segment_dir": str(self.segment_dir),
            "shared_json": str(self.shared_json),
            "segment_bytes": self.dram_bytes,
            "role": self.role,
            "hostname": socket.gethostname(),
            "etcd_endpoints": [self.etcd_endpoint] if self.etcd_endpoint else [],
            "master_port": self.master_port,
            "owner_p2p_port": self.owner_port,
            "workdir": str(self.workdir),
            "logs_dir": str(self.logs_dir),
            "fluxon_kv_logs_dir": str(self.workdir / "large" / f"{self.cluster_name}_cluster_kv_logs"),
            "pids": self.pids,
            "hydra_overrides": [
                "+store=fluxon",
                f"store.cluster_name={self.cluster_name}",
                f"store.share_mem_path={self.share_mem_path}",
            ],
            "plan_hydra_overrides": [  # the Plan tier (its client options start unset: `+` is accepted)
                "+store=fluxon_plan",
                "store.client=fluxon",
                f"+store.client_options.cluster_name={self.cluster_name}",
                f"+store.client_options.share_mem_path={self.share_mem_path}",
            ],
        }

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "FluxonService":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "FluxonService":
        """Start etcd, master and owner; return once the owner has written shared.json."""
        if self._running:
            return self
        if self.require_private_netns:
            problem = private_netns_problem()
            if problem:
                raise FluxonServiceError(
                    "refusing to start Fluxon outside a private network namespace (its master and "
                    f"owner advertise a non-loopback address): {problem}")
        problem = fluxon_py_problem()
        if problem:
            raise FluxonServiceError(f"cannot start Fluxon: {problem}")
        etcd_bin = resolve_etcd_binary(self._etcd_bin_arg)
        t0 = time.monotonic()
        self._prepare_dirs()
        try:
            self._segment.claim(self.dram_bytes)
            self._pick_ports()
            if self.join:
                if not etcd_healthy(self.join, 3.0):
                    raise FluxonServiceError(
                        f"the control plane's etcd at {self.join} does not answer from {socket.gethostname()}: "
                        "start the control plane first (fluxon_service.py start --listen ADDR) and check "
                        "that this host reaches ADDR")
            else:
                self._start_etcd(etcd_bin)
                self._children.wait_for(lambda: etcd_healthy(self.etcd_endpoint, 0.5), "etcd /health", t0, self.ready_timeout_s)
            self._write_configs()
            if not self.join:
                self._children.spawn("master", [sys.executable, "-m", "fluxon_py.runtime.start_master",
                                       "--config", str(self.workdir / "master.yaml"),
                                       "--workdir", str(self.workdir / "master")])
            self._children.spawn("owner", [sys.executable, "-m", "fluxon_py.runtime.start_owner_kvclient",
                                  "--config", str(self.workdir / "owner.yaml"),
                                  "--workdir", str(self.workdir / "owner")])
            self._children.wait_for(self.shared_json.is_file, f"the owner's {self.shared_json}", t0, self.ready_timeout_s)
        except BaseException:
            self._running = True  # so that stop() tears down what was started
            self.stop()
            raise
        self._running = True
        self.ready_seconds = time.monotonic() - t0
        log.info("fluxon service (%s) ready in %.1f s: cluster %r, segment %s at %s, etcd %s, logs %s",
                 self.role, self.ready_seconds, self.cluster_name, format_size(self.dram_bytes),
                 self.segment_dir, self.etcd_endpoint, self.logs_dir)
        return self

    def check(self) -> None:
        """Raise FluxonServiceError (with log tails) if a service process has exited."""
        self._children.check()

    def stop(self) -> None:
        """Stop owner (SIGTERM), master (SIGINT), etcd (SIGTERM); SIGKILL after stop_timeout_s;
        remove the segment folder and etcd's data. Idempotent."""
        if not self._running and not self._children and self._lock_fd is None:
            return
        self._children.stop((("owner", signal.SIGTERM), ("master", signal.SIGINT), ("etcd", signal.SIGTERM)),
                            self.stop_timeout_s)
        self._segment.remove()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._running = False
        log.info("fluxon service stopped (cluster %r); logs kept in %s", self.cluster_name, self.logs_dir)

    def log_tails(self, lines: int = 15) -> str:
        return self._children.log_tails(lines)

    # -- internals ------------------------------------------------------------------------------
    def _prepare_dirs(self) -> None:
        import fcntl

        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.workdir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise FluxonServiceError(f"{self.workdir} is in use by another running FluxonService; "
                                     "give each service its own folder") from None
        self._lock_fd = fd
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        for sub in ("logs", "logs/master", "master", "owner", "large"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        for name in ("etcd", "master", "owner"):
            (self.logs_dir / f"{name}.log").unlink(missing_ok=True)

    def _pick_ports(self) -> None:
        etcd, master, p2p = self._ports
        free = iter(free_ports(4))
        self.etcd_port = 0 if self.join else etcd or next(free)
        self.etcd_peer_port = 0 if self.join else next(free)
        self.master_port = 0 if self.join else master or next(free)
        self.owner_port = p2p or next(free)

    def _start_etcd(self, etcd_bin: str) -> None:
        data = self.workdir / "etcd" / "data"
        data.parent.mkdir(parents=True, exist_ok=True)
        self._children.spawn("etcd", etcd_command(etcd_bin, f"{self.cluster_name}-etcd", data, self.etcd_port,
                                         self.etcd_peer_port, self.listen_host or "127.0.0.1"))

    def _write_configs(self) -> None:
        import yaml  # PyYAML: a dependency of fluxon-py and of hydra-core

        etcd = [self.etcd_endpoint]
        key = f"{self.cluster_name}-owner-{socket.gethostname()}" if self.role != "single" else ""
        owner = owner_config(self.cluster_name, self.dram_bytes, etcd, self.share_mem_path,
                             self.workdir / "large", self.owner_port, key)
        (self.workdir / "owner.yaml").write_text(yaml.safe_dump(owner, sort_keys=False))
        if not self.join:
            master = master_config(self.cluster_name, self.master_port, etcd, self.logs_dir / "master")
            (self.workdir / "master.yaml").write_text(yaml.safe_dump(master, sort_keys=False))
