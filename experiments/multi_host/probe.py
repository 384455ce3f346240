#!/usr/bin/env python3
"""Two facts the multi-host mode relies on, measured on emulated hosts (needs root):

1. capacity: how many 45.7 MiB values (64 MiB slots, one 480p KV value each) an owner of
   ``10 x 64 MiB x k`` keeps: one host, ``--count`` values put one after the other, then which are
   still there (the rule `OwnerSizing` checks says 8 per step k);
2. faults: what a read on host ``a`` of values that host ``b`` wrote returns, and how long it
   takes, after ``b``'s owner is stopped (SIGTERM) or killed (SIGKILL); op_timeout 3 s.

    python experiments/multi_host/probe.py     # about 3 min; writes probe.json beside it
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(HERE.parent)]

from benchlib import env_info  # noqa: E402
from emulated_hosts import EmulatedHosts  # noqa: E402
from multi_host_demo import FluxonHosts  # noqa: E402

VALUE = 47_923_200  # one lingbot_480p KV value


def capacity(shared: str, steps: int, count: int) -> dict:
    dram = f"{640 * steps}MiB"
    with EmulatedHosts(["a"], shared_dir=shared, shm_size=f"{640 * steps + 64}m") as hosts:
        cluster = FluxonHosts(hosts, dram=dram, geometry="lingbot_480p", values=8 * steps)
        cluster.start()
        try:
            peer = cluster.peer("a", 30.0)
            puts = [peer.call("put", key=f"cap/{i}", seed=i, size=VALUE) for i in range(count)]
            time.sleep(3.0)
            kept = [i for i in range(count) if peer.call("get", key=f"cap/{i}").get("hit")]
            peer.close()
        finally:
            cluster.close()
    return {"dram": dram, "count": count, "put_errors": [p.get("error") for p in puts if "error" in p],
            "kept": kept, "kept_n": len(kept)}


def faults(shared: str, fault: str) -> dict:
    with EmulatedHosts(["a", "b"], shared_dir=shared) as hosts:
        cluster = FluxonHosts(hosts, dram="48MiB")
        cluster.start()
        try:
            a, b = cluster.peer("a", 3.0), cluster.peer("b", 3.0)
            for i in range(10):
                b.call("put", key=f"f/{i}", seed=i, size=256 << 10)
            b.close()
            t0 = time.monotonic()
            (cluster.stop_owner if fault == "stop" else cluster.kill_owner)("b")
            fault_s = time.monotonic() - t0
            reads = []
            for i in range(10):
                t = time.monotonic()
                got = a.call("get", key=f"f/{i}")
                reads.append({"s": round(time.monotonic() - t, 3), "hit": bool(got.get("hit")),
                              "error": (got.get("error") or "")[:120]})
            a.close()
        finally:
            cluster.close()
    return {"fault": fault, "fault_s": round(fault_s, 2), "reads": reads}


def main() -> int:
    out = {"env": env_info(), "capacity": [], "faults": []}
    with tempfile.TemporaryDirectory(prefix="cacheseek-probe-") as shared:
        os.chmod(shared, 0o777)
        for steps, count in ((1, 12), (2, 20)):
            out["capacity"].append(capacity(shared, steps, count))
            print(out["capacity"][-1], flush=True)
        for fault in ("stop", "kill"):
            out["faults"].append(faults(shared, fault))
            print(out["faults"][-1], flush=True)
    (HERE / "probe.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
