#!/usr/bin/env python3
"""A Fluxon service (etcd + KV master + owner) for CacheSeek, on one host or several: start, stop, run.

    python tools/fluxon_service.py start [--dram 1GiB] [--dir DIR]   # returns once it serves
    python tools/fluxon_service.py start --listen ADDR ...           # control plane + owner, host 1
    python tools/fluxon_service.py start --join ADDR:2379 ...        # an owner on each other host
    python tools/fluxon_service.py stop [--dir DIR]
    python tools/fluxon_service.py run [--dram 1GiB] [--dir DIR] -- CMD [ARGS...]
    python tools/fluxon_service.py start --foreground ...            # stays until Ctrl-C

``start`` starts the service in the background (a process of its own, its log in
``DIR/logs/service.log``), waits until the owner serves, then prints how to attach (the Hydra
overrides of a CacheSeek run) and how to stop it, and returns. ``stop`` stops the service started
from ``DIR`` (SIGTERM to it; it stops the owner, master and etcd in order, removes the segment
folder under /dev/shm and etcd's data, and keeps the logs under ``DIR/logs``). ``run`` starts the
service, runs CMD, stops the service and exits with CMD's status: one command, one namespace.
The defaults (cluster ``cacheseek`` at ``/dev/shm/cacheseek-fluxon``, ``--dir
/tmp/cacheseek-fluxon``) are what ``+store=fluxon`` and ``+store=fluxon_plan store.client=fluxon``
attach to without further overrides.

Several hosts: ``--listen ADDR`` (an address of this host the others reach) starts etcd on
``ADDR:--etcd-port`` (default 2379), the master and this host's owner; ``--join ADDR:2379`` on
every other host starts only an owner of the same ``--cluster-name``. Workers attach to their own
host's owner (same overrides as one host). ``--geometry`` (default tiny) and ``--values`` (default 8)
check the owner's ``--dram`` first: 10 x the largest value's power-of-two slot per 8 such values
it keeps, placed and replicas (480p: 64 MiB slots, 640 MiB per 8 values), or values vanish. README "One cache over several
machines" says what runs where and what a crash costs.

The Fluxon master and owner advertise a non-loopback address, so on a shared machine the service
and every client run inside one private network namespace; the tool refuses to start outside one
unless --allow-host-network is given (a machine of your own). On this project's machines, as root:

    tools/netns-run.sh bash                     # a shell in a private namespace
    python tools/fluxon_service.py start --dram 1GiB
    python -m cacheseek +store=fluxon
    python tools/fluxon_service.py stop
    exit

or in one line: ``tools/netns-run.sh python tools/fluxon_service.py run -- python -m
cacheseek +store=fluxon``. Needs fluxon-py 0.2.4 and an etcd server (``pip install -e
'.[fluxon]'`` and ``bash tools/install_fluxon_deps.sh``) and ``cacheseek`` importable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

DEFAULT_DIR = "/tmp/cacheseek-fluxon"
PID_FILE, INFO_FILE, LOG_FILE = "service.pid", "service.json", "logs/service.log"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluxon_service.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    sub = p.add_subparsers(dest="cmd", required=True)

    def service_options(s: argparse.ArgumentParser) -> None:
        s.add_argument("--dram", default="256MiB", help="segment size (binary units, 16 MiB granule); default 256MiB")
        s.add_argument("--dir", default=DEFAULT_DIR, help=f"work folder: configs, logs, etcd data (default {DEFAULT_DIR})")
        s.add_argument("--cluster-name", default=None, help="default: cacheseek")
        s.add_argument("--share-mem-path", default=None, help="segment folder root; default /dev/shm/cacheseek-fluxon")
        s.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the owner (default 60)")
        s.add_argument("--allow-host-network", action="store_true",
                       help="start even outside a private network namespace (your own machine only)")
        s.add_argument("--fluxon-log", default="info", help="FLUXON_LOG level of the master and owner")
        s.add_argument("--listen", default=None, metavar="ADDR",
                       help="control plane of several hosts: etcd also on ADDR (this host's address)")
        s.add_argument("--join", default=None, metavar="ADDR:PORT",
                       help="join the control plane whose etcd is ADDR:PORT: start only this host's owner")
        s.add_argument("--etcd-port", type=int, default=0, help="with --listen: etcd's client port (default 2379)")
        s.add_argument("--master-port", type=int, default=0, help="with --listen: the master's port (default: free)")
        s.add_argument("--p2p-port", type=int, default=0, help="the owner's P2P port other hosts pull from (default: free)")
        s.add_argument("--geometry", default="tiny", help="the geometry the cache holds, for the dram check (default tiny)")
        s.add_argument("--values", type=int, default=8,
                       help="largest-slot values this owner keeps at once, placed and replicas (default 8)")
        s.add_argument("-v", "--verbose", action="store_true")

    s = sub.add_parser("start", help="start the service in the background; print how to attach and stop")
    service_options(s)
    s.add_argument("--foreground", action="store_true", help="stay in the foreground until Ctrl-C or SIGTERM")
    s.add_argument("--info-json", default=None, help="also write the attach info as JSON to this file once ready")
    s = sub.add_parser("stop", help="stop the service started from --dir")
    s.add_argument("--dir", default=DEFAULT_DIR, help=f"the folder it was started with (default {DEFAULT_DIR})")
    s.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop (default 60)")
    s = sub.add_parser("run", help="start the service, run a command, stop the service")
    service_options(s)
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return p


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def _config_error(exc: Any) -> str:
    """A ConfigError of the service as the option that caused it: ``--dram: ...``."""
    field = exc.field.removeprefix("--")
    flag = {"listen_host": "listen"}.get(field, field).replace("_", "-")
    return f"--{flag}: {exc.problem}" + (f" (fix: {exc.fix})" if exc.fix else "")


def _import_service() -> Any:
    try:
        from cacheseek.fluxon_service import service
    except ImportError as exc:
        raise SystemExit(_error(f"cannot import cacheseek ({exc}) (fix: python -m pip install -e . from "
                                "the repository root)"))
    return service


def _started(args: argparse.Namespace) -> tuple[Any, Optional[int]]:
    """A started service, or None and the exit code of the one error line saying why not."""
    from cacheseek.errors import CacheSeekError, ConfigError

    try:
        svc = _new_service(args)
        svc.start()
    except ConfigError as exc:
        return None, _error(_config_error(exc))
    except CacheSeekError as exc:
        return None, _error(str(exc))
    return svc, None


def geometry_sizing(name: str, values: int, itemsize: int = 2) -> Any:
    """The dram rule for ``values`` of the geometry's largest value (a KV value or the latent)."""
    from cacheseek.fluxon_service.owner_sizing import OwnerSizing
    from cacheseek.runtime.geometry import get_geometry

    g = get_geometry(name)
    largest = max(g.kv_nbytes_per_chunk(itemsize), g.latent_nbytes(itemsize))
    return OwnerSizing(largest, values, f"geometry {g.name}, {itemsize}-byte elements")


def _new_service(args: argparse.Namespace) -> Any:
    service = _import_service()
    sizing = geometry_sizing(args.geometry, args.values)
    return service.FluxonService(
        args.dir, dram=args.dram, listen_host=args.listen, join=args.join, etcd_port=args.etcd_port,
        master_port=args.master_port, p2p_port=args.p2p_port, sizing=sizing,
        cluster_name=args.cluster_name or service.DEFAULT_CLUSTER_NAME,
        share_mem_path=args.share_mem_path or service.DEFAULT_SHARE_MEM_PATH,
        ready_timeout_s=args.ready_timeout, require_private_netns=not args.allow_host_network,
        fluxon_log=args.fluxon_log)


def _problem(args: argparse.Namespace) -> Optional[str]:
    """What keeps the service from starting, found before anything is started."""
    service = _import_service()
    from cacheseek.errors import ConfigError
    from cacheseek.sizes import parse_size

    try:
        _new_service(args)  # every argument checked (sizes, roles, the dram rule); nothing started
    except ConfigError as exc:
        return _config_error(exc)
    problem = service.fluxon_py_problem()
    if problem:
        return problem
    try:
        service.resolve_etcd_binary()
    except service.FluxonServiceError as exc:
        return str(exc)
    if not args.allow_host_network:
        problem = service.private_netns_problem()
        if problem:
            return f"refusing to start Fluxon outside a private network namespace: {problem}"
    return None


def _attach_text(info: dict[str, Any], ready: str, stop_how: str) -> str:
    service = _import_service()
    role = {"single": "one host", "control": "control plane + owner", "owner": "owner"}[info['role']]
    join = (f"\n  other hosts     python tools/fluxon_service.py start --join {info['etcd_endpoints'][0]} "
            f"--cluster-name {info['cluster_name']} --allow-host-network" if info['role'] == "control" else "")
    return f"""Fluxon service ready ({ready}): {role} on {info['hostname']}
  cluster name    {info['cluster_name']}
  segment         {service.format_size(info['segment_bytes'])} at {info['segment_dir']}/mmap.file
  share_mem_path  {info['share_mem_path']}
  etcd            {', '.join(info['etcd_endpoints'])}
  owner p2p port  {info['owner_p2p_port']}{join}
  logs            {info['logs_dir']}

Attach from this network namespace:
  python -m cacheseek {' '.join(info['hydra_overrides'])}
  python -m cacheseek {' '.join(info['plan_hydra_overrides'])}
  python tools/workers.py --cluster-name {info['cluster_name']} --share-mem-path {info['share_mem_path']}
Stop it: {stop_how}"""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


# -- start --foreground: the service process itself ----------------------------------------------


def foreground(args: argparse.Namespace) -> int:
    from cacheseek.errors import CacheSeekError, ConfigError

    work = Path(args.dir).expanduser().absolute()
    info_paths = [work / INFO_FILE] + ([Path(args.info_json)] if args.info_json else [])
    for p in info_paths:
        p.unlink(missing_ok=True)  # a stale file must not look like a ready service
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    svc, failed = _started(args)
    if failed is not None:
        return failed
    try:
        info = svc.attach_info()
        info["service_pid"] = os.getpid()
        for p in info_paths:
            _write_json(p, info)
        print(_attach_text(info, f"in {svc.ready_seconds or 0.0:.1f} s, pid {os.getpid()}", "Ctrl-C or SIGTERM"),
              flush=True)
        while not stop.wait(0.5):
            try:
                svc.check()
            except CacheSeekError as exc:
                return _error(str(exc))
        print("stopping the Fluxon service ...", flush=True)
        return 0
    finally:
        t0 = time.monotonic()
        svc.stop()
        for p in info_paths:
            p.unlink(missing_ok=True)
        print(f"stopped in {time.monotonic() - t0:.1f} s; segment folder removed; logs kept in "
              f"{svc.logs_dir}", flush=True)


# -- start (background), stop ---------------------------------------------------------------------


def _running_pid(work: Path) -> Optional[int]:
    """The pid in ``work/service.pid`` when that process is alive and is this tool; else None."""
    try:
        pid = int((work / PID_FILE).read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return pid if "fluxon_service.py" in cmdline and str(work) in cmdline else None


def start(args: argparse.Namespace) -> int:
    work = Path(args.dir).expanduser().absolute()
    pid = _running_pid(work)
    if pid is not None:
        return _error(f"--dir: a service started from {work} is running (pid {pid}) "
                      f"(fix: python tools/fluxon_service.py stop --dir {work}, or another --dir)")
    problem = _problem(args)
    if problem:
        return _error(problem)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / INFO_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "start", "--foreground", "--dir", str(work),
           "--dram", str(args.dram), "--ready-timeout", str(args.ready_timeout), "--fluxon-log", args.fluxon_log]
    for flag, value in (("--cluster-name", args.cluster_name), ("--share-mem-path", args.share_mem_path),
                        ("--info-json", args.info_json), ("--listen", args.listen), ("--join", args.join),
                        ("--etcd-port", args.etcd_port), ("--master-port", args.master_port),
                        ("--p2p-port", args.p2p_port),
                        ("--geometry", args.geometry), ("--values", args.values)):
        if value:
            cmd += [flag, str(value)]
    if args.allow_host_network:
        cmd.append("--allow-host-network")
    with open(work / LOG_FILE, "ab") as log:
        # its own session: closing this terminal or Ctrl-C here does not reach it; `stop` does
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (work / PID_FILE).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + args.ready_timeout + 15
    while True:
        if (work / INFO_FILE).is_file():
            info = json.loads((work / INFO_FILE).read_text())
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
            (work / PID_FILE).unlink(missing_ok=True)
            tail = (work / LOG_FILE).read_text(errors="replace").strip().splitlines()
            why = next((ln for ln in reversed(tail) if ln.startswith("error:")), tail[-1] if tail else "no output")
            return _error(f"the Fluxon service did not start: {why.removeprefix('error: ')} "
                          f"(log: {work / LOG_FILE})")
        time.sleep(0.1)
    stop_how = "python tools/fluxon_service.py stop" + ("" if str(work) == DEFAULT_DIR else f" --dir {work}")
    print(_attach_text(info, f"in the background, pid {proc.pid}", stop_how), flush=True)
    print("It runs in the background in this network namespace; stop it before you leave it.")
    return 0


def stop(args: argparse.Namespace) -> int:
    work = Path(args.dir).expanduser().absolute()
    pid = _running_pid(work)
    if pid is None:
        (work / PID_FILE).unlink(missing_ok=True)
        print(f"no Fluxon service started from {work} is running")
        return 0
    os.kill(pid, signal.SIGTERM)
    t0 = time.monotonic()
    while Path(f"/proc/{pid}").exists() and time.monotonic() - t0 < args.timeout:
        try:  # reap it if it is our child (it is not, after `start` returned): harmless otherwise
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        state = _proc_state(pid)
        if state in (None, "Z"):
            break
        time.sleep(0.1)
    else:
        if Path(f"/proc/{pid}").exists():
            return _error(f"the Fluxon service (pid {pid}) did not stop within {args.timeout:.0f} s "
                          f"(log: {work / LOG_FILE})")
    (work / PID_FILE).unlink(missing_ok=True)
    print(f"stopped the Fluxon service (pid {pid}) in {time.monotonic() - t0:.1f} s; segment folder "
          f"removed; logs kept in {work / 'logs'}")
    return 0


def _proc_state(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# -- run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from cacheseek.errors import CacheSeekError, ConfigError

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _error("run: no command given (fix: python tools/fluxon_service.py run -- python -m "
                      "cacheseek +store=fluxon)")
    problem = _problem(args)
    if problem:
        return _error(problem)
    svc, failed = _started(args)
    if failed is not None:
        return failed
    try:
        info = svc.attach_info()
        print(f"Fluxon service ready in {svc.ready_seconds:.1f} s: cluster {info['cluster_name']} at "
              f"{info['share_mem_path']}, {_import_service().format_size(info['segment_bytes'])}; "
              f"running: {' '.join(command)}", flush=True)
        try:
            rc = subprocess.call(command)
        except OSError as exc:
            return _error(f"run: cannot start {command[0]!r}: {exc.strerror or exc}")
        except KeyboardInterrupt:
            rc = 130
        return rc
    finally:
        svc.stop()
        print(f"Fluxon service stopped; logs kept in {svc.logs_dir}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "stop":
        return stop(args)
    if args.cmd == "run":
        return run(args)
    return foreground(args) if args.foreground else start(args)


if __name__ == "__main__":
    sys.exit(main())
