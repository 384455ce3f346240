#!/usr/bin/env python3
"""Start a single-node Fluxon service (etcd + KV master + owner) for CacheSeek, in the foreground.

    python tools/fluxon_service.py start --dram 1GiB --dir /tmp/fx

prints how to attach (cluster name, segment path, the Hydra overrides of a CacheSeek run), then
stays in the foreground until Ctrl-C or SIGTERM and stops everything cleanly (the segment folder
under /dev/shm is removed; logs stay under --dir/logs).

On a shared machine (this project's CPU machines and CI) the Fluxon master and owner advertise a
non-loopback address, so run the service AND every client inside one private network namespace:

    ../shared/tools/netns-run.sh bash -c '
        python tools/fluxon_service.py start --dram 256MiB --dir /tmp/fx --info-json /tmp/fx/info.json &
        while [ ! -s /tmp/fx/info.json ]; do sleep 0.2; done
        python -m cacheseek +store=fluxon_bytes ...
        kill %1; wait'

The tool refuses to start outside such a namespace unless --allow-host-network is given (for a
real deployment on a machine of your own). Needs fluxon-py 0.2.4 and an etcd binary:
``bash tools/install_fluxon_deps.sh``. Needs ``cacheseek`` importable (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluxon_service.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start the service and stay in the foreground")
    s.add_argument("--dram", default="256MiB", help="segment size (binary units, 16 MiB granule); default 256MiB")
    s.add_argument("--dir", required=True, help="work folder: configs, logs, etcd data")
    s.add_argument("--cluster-name", default=None, help="default: cacheseek")
    s.add_argument("--share-mem-path", default=None, help="segment folder root; default /dev/shm/cacheseek-fluxon")
    s.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the owner (default 60)")
    s.add_argument("--info-json", default=None, help="write the attach info as JSON to this file once ready")
    s.add_argument("--allow-host-network", action="store_true",
                   help="start even outside a private network namespace (your own machine only)")
    s.add_argument("--fluxon-log", default="info", help="FLUXON_LOG level of the master and owner")
    s.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from cacheseek.errors import CacheSeekError
        from cacheseek.fluxon.service import (
            DEFAULT_CLUSTER_NAME,
            DEFAULT_SHARE_MEM_PATH,
            FluxonService,
            format_size,
        )
    except ImportError as exc:
        print(f"error: cannot import cacheseek ({exc}); install the project first: "
              "python -m pip install -e .  (from the repository root)", file=sys.stderr)
        return 2

    import os

    if args.info_json and os.path.exists(args.info_json):
        os.unlink(args.info_json)  # a stale file must not look like a ready service
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        svc = FluxonService(
            args.dir, dram=args.dram,
            cluster_name=args.cluster_name or DEFAULT_CLUSTER_NAME,
            share_mem_path=args.share_mem_path or DEFAULT_SHARE_MEM_PATH,
            ready_timeout_s=args.ready_timeout, require_private_netns=not args.allow_host_network,
            fluxon_log=args.fluxon_log)
        svc.start()
    except CacheSeekError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        info = svc.attach_info()
        overrides = " ".join(info["hydra_overrides"])
        plan_overrides = " ".join(info["plan_hydra_overrides"])
        print(f"""
Fluxon service ready in {svc.ready_seconds:.1f} s
  cluster name    {info['cluster_name']}
  segment         {format_size(info['segment_bytes'])} at {info['segment_dir']}/mmap.file (ready flag: shared.json)
  share_mem_path  {info['share_mem_path']}
  etcd            {', '.join(info['etcd_endpoints'])} (loopback)
  pids            {info['pids']}
  logs            {info['logs_dir']} and {info['fluxon_kv_logs_dir']}

Attach from a process in the same network namespace:
  python -m cacheseek {overrides}
  python -m cacheseek {plan_overrides}
  python -m cacheseek.workers --cluster-name {info['cluster_name']} --share-mem-path {info['share_mem_path']}
  FluxonBytesStore(cluster_name={info['cluster_name']!r}, share_mem_path={info['share_mem_path']!r})
  FluxonClient({info['cluster_name']!r}, {info['share_mem_path']!r})

Ctrl-C or SIGTERM stops the service.""", flush=True)
        if args.info_json:
            tmp = f"{args.info_json}.tmp"
            with open(tmp, "w") as f:
                json.dump(info, f, indent=2)
            os.replace(tmp, args.info_json)
        while not stop.wait(0.5):
            try:
                svc.check()
            except CacheSeekError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
        print("stopping the Fluxon service ...", flush=True)
        return 0
    finally:
        t0 = time.monotonic()
        svc.stop()
        if args.info_json and os.path.exists(args.info_json):
            os.unlink(args.info_json)
        print(f"stopped in {time.monotonic() - t0:.1f} s; segment folder removed; logs kept in "
              f"{svc.logs_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
