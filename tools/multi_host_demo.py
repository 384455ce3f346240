#!/usr/bin/env python3
"""One CacheSeek cache over several emulated hosts: a Fluxon control plane on the first, an owner
joining it on each other, workers on their own host's owner (needs root).

    python tools/multi_host_demo.py [--hosts a,b] [--workers-per-host 1] [--store fluxon_plan|fluxon]
                                    [--dram 64MiB] [HYDRA_OVERRIDE ...]

Host ``a`` runs ``tools/fluxon_service.py start --listen 10.78.0.1`` (etcd, master, its owner),
host ``b`` ``start --join 10.78.0.1:2379`` (its owner); then the workers of ``tools/workers.py``
start at once, ``--workers-per-host`` on each host, and run ``workload=interactive``'s sessions
(session ``i`` on worker ``i % N``) on the one cache, with no snapshot exchange. The verdict is
the tool's: every session's frames equal its worker's cold run. It prints the chunks restored,
the bytes ``b`` received over its link, PASS or FAIL, and tears every host down.

`FluxonHosts` (a cluster on `EmulatedHosts`), `OnHosts` (where each worker runs) and `Peer` (a
`tools/fluxon_peer.py` on one host) are what tests/fluxon/test_cross_host.py and
experiments/multi_host use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))

from emulated_hosts import SHARED_MOUNT, EmulatedHosts, clean_env  # noqa: E402

__all__ = ["FluxonHosts", "OnHosts", "Peer"]

SERVICE = [sys.executable, str(TOOLS / "fluxon_service.py")]
SVC_DIR = "/tmp/fluxon-service"  # inside each host's own /tmp


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")


class Peer:
    """`tools/fluxon_peer.py` on one host; ``call(op, **fields)`` answers its JSON line, every
    answer waited for at most ``timeout_s``."""

    def __init__(self, hosts: EmulatedHosts, host: str, cluster: str, share: str, op_timeout_s: float,
                 timeout_s: float = 90.0) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.proc = hosts.popen(host, [sys.executable, str(TOOLS / "fluxon_peer.py"), "--cluster-name", cluster,
                                       "--share-mem-path", share, "--op-timeout", str(op_timeout_s)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=_env(), cwd=str(REPO))
        ready = self._line()
        if not ready.get("ready"):
            raise RuntimeError(f"peer on {host} did not attach: {ready}")
        self.hostname = ready["hostname"]

    def _line(self) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(self.timeout_s):
            raise TimeoutError(f"peer on {self.host}: no answer within {self.timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer on {self.host} exited with status {self.proc.wait(10)}")
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


class OnHosts:
    """A `workers.run_generation` launcher: worker ``k`` runs on host ``placement[k]``, in its
    namespaces; the work folder is under the hosts' shared folder (``SHARED_MOUNT`` inside them)."""

    def __init__(self, hosts: EmulatedHosts, placement: list[str]) -> None:
        self.hosts, self.placement = hosts, placement

    def argv(self, worker: int, cmd: list[str]) -> list[str]:
        return self.hosts.command(self.placement[worker], cmd, cwd=str(REPO))

    def path(self, path: Path) -> str:
        return f"{SHARED_MOUNT}/{Path(path).relative_to(self.hosts.shared_dir)}"

    def env(self, env: dict[str, str]) -> dict[str, str]:
        return clean_env(dict(env, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1"))


class FluxonHosts:
    """A Fluxon cluster over ``hosts``: the control plane and an owner on ``hosts.names[0]``, an
    owner on each other host, each with ``dram`` (checked against ``geometry``). The same
    ``cluster`` and ``share`` on every host: each host has its own /dev/shm."""

    def __init__(self, hosts: EmulatedHosts, *, dram: str = "64MiB", cluster: str = "cacheseek",
                 share: str = "/dev/shm/cacheseek-fluxon", geometry: str = "tiny", values: int = 8) -> None:
        self.hosts, self.dram, self.cluster, self.share = hosts, dram, cluster, share
        self.geometry, self.values = geometry, values
        self.control = hosts.names[0]
        self.etcd = f"{hosts.address(self.control)}:2379"
        self.running: set[str] = set()

    def info_path(self, host: str) -> Path:
        return Path(self.hosts.shared_dir) / f"service-{host}.json"

    def start(self) -> "FluxonHosts":
        try:
            for host in self.hosts.names:
                self.start_owner(host)
        except BaseException:
            self.close()
            raise
        return self

    def start_owner(self, host: str) -> dict[str, Any]:
        role = ["--listen", self.hosts.address(host)] if host == self.control else ["--join", self.etcd]
        cmd = [*SERVICE, "start", "--dir", SVC_DIR, "--dram", self.dram, "--cluster-name", self.cluster,
               "--share-mem-path", self.share, "--geometry", self.geometry, "--values", str(self.values),
               "--allow-host-network", "--fluxon-log", "warn", "--ready-timeout", "90",
               "--info-json", f"{SHARED_MOUNT}/service-{host}.json", *role]
        out = self.hosts.run(host, cmd, timeout=150, env=_env(), cwd=str(REPO))
        if out.returncode != 0:
            raise RuntimeError(f"fluxon service on {host} did not start: {out.stderr.strip() or out.stdout[-2000:]}")
        self.running.add(host)
        return json.loads(self.info_path(host).read_text())

    def stop_owner(self, host: str) -> None:
        self.hosts.run(host, [*SERVICE, "stop", "--dir", SVC_DIR], timeout=90, env=_env(), cwd=str(REPO))
        self.running.discard(host)

    def kill_owner(self, host: str) -> None:
        """SIGKILL the owner process of ``host`` (its service process then stops the rest)."""
        pid = json.loads(self.info_path(host).read_text())["pids"]["owner"]
        self.hosts.run(host, ["kill", "-KILL", str(pid)], timeout=10)

    def peer(self, host: str, op_timeout_s: float = 10.0) -> Peer:
        return Peer(self.hosts, host, self.cluster, self.share, op_timeout_s)

    def workers(self, placement: list[str], store: str, extra: list[str], *, tag: str = "workers",
                timeout_s: float = 400.0) -> dict[str, Any]:
        """`tools/workers.py`'s workers at once, worker ``k`` on host ``placement[k]``, all on this
        cluster with ``store``, running ``workload=interactive`` (``extra``: more overrides).
        The tool's summary (`workers.summarize`) with ``passed``, ``processes`` and ``failures``."""
        from workers import plan_size, run_generation, shares, store_overrides, summarize

        overrides = ["workload=interactive", *store_overrides(store, self.cluster, self.share, 20.0), *extra]
        n = plan_size(overrides)
        workdir = Path(self.hosts.shared_dir) / tag
        workdir.mkdir(mode=0o777, exist_ok=True)
        (share,) = shares(n, len(placement))
        processes, failures = run_generation(0, share, overrides, workdir, worker_timeout=timeout_s,
                                             launcher=OnHosts(self.hosts, placement))
        out = summarize(processes, n, None)
        out.update(processes=processes, failures=failures,
                   passed=not failures and out["mismatches"] == 0 and not out["errors"] and not out["missing_sessions"])
        return out

    def close(self) -> None:
        for host in reversed(sorted(self.running, key=self.hosts.names.index)):
            try:
                self.stop_owner(host)
            except (subprocess.SubprocessError, OSError):
                pass
        self.running.clear()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="a,b")
    p.add_argument("--workers-per-host", type=int, default=1)
    p.add_argument("--store", choices=("fluxon_plan", "fluxon"), default="fluxon_plan")
    p.add_argument("--dram", default="64MiB")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every worker (workload.sessions=8 ...)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))

    names = args.hosts.split(",")
    placement = [h for _ in range(args.workers_per_host) for h in names]
    with tempfile.TemporaryDirectory(prefix="cacheseek-hosts-") as shared:
        os.chmod(shared, 0o777)
        with EmulatedHosts(names, shared_dir=shared) as hosts:
            cluster = FluxonHosts(hosts, dram=args.dram)
            try:
                t0 = time.monotonic()
                cluster.start()
                print(f"hosts {', '.join(f'{n}={hosts.address(n)}' for n in names)}: control plane on {names[0]}, "
                      f"owners on all ({args.dram} each), ready in {time.monotonic() - t0:.1f} s", flush=True)
                rx0 = hosts.link_bytes(names[1])[0] if len(names) > 1 else 0
                out = cluster.workers(placement, args.store, list(args.overrides))
                rx = (hosts.link_bytes(names[1])[0] - rx0) if len(names) > 1 else 0
            finally:
                cluster.close()
    for f in out["failures"]:
        print(f"FAIL: {f}")
    print(f"{len(placement)} workers ({', '.join(f'w{k} on {h}' for k, h in enumerate(placement))}): "
          f"{out['all']['chunks_restored']} of {out['all']['chunks_total']} chunks restored, "
          f"{out['mismatches']} sessions differ from a cold run")
    if len(names) > 1:
        print(f"host {names[1]} received {rx / 2**20:.2f} MiB over its link while the workers ran")
    print(f"{'PASS' if out['passed'] else 'FAIL'}: workers on {', '.join(names)} on one cache (store={args.store})")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
