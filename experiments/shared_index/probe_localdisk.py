"""The cost of a batched probe of a LocalDisk root's chunk records: the next 8 keys, hit and miss.

A lookup that runs off the local trie asks the store for the session's next node keys
(`SharedIndex`, a window of 8). On LocalDisk each record is a small file (`DiskRecords`): a probe
opens and reads up to 8 of them through the root's descriptor and checks each one (its checksum,
its key). The baseline in the same run is the cheapest possible existence check of the same 8
keys' first values (an ``lstat`` each): what the probe costs beyond knowing a file is there.
Records carry 480p geometry (80 value checksums each), as the real ones do.

    python experiments/shared_index/probe_localdisk.py [--reps 2000] [--root DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import env_info, git_state, write_json  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def main() -> int:
    from cacheseek.kv.locators import blob_keys, kv_locator
    from cacheseek.kv.records import ChunkRecord
    from cacheseek.stores.localdisk import LocalDiskTierStore

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--root", default=None)
    p.add_argument("--out", default=str(HERE / "probe_localdisk.json"))
    args = p.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="cs-probe-")) / "kv"
    store = LocalDiskTierStore(str(root), capacity_bytes=None)
    try:
        keys = [hashlib.sha256(b"node%d" % i).digest() for i in range(8)]
        absent = [hashlib.sha256(b"absent%d" % i).digest() for i in range(8)]
        parent = hashlib.sha256(b"root").digest()
        for depth, key in enumerate(keys):
            digests = {k: "0123456789abcdef" for k in blob_keys(kv_locator(key), 40)}
            store.records.publish(ChunkRecord(node_key=key, parent_key=parent, root_hash=parent, depth=depth,
                                              n_layers=40, nbytes=80 * 47_923_200, latent_nbytes=599_040,
                                              storage_format="cacheseek.tier.objects.v1", digests=digests))
            store.backend.write(blob_keys(kv_locator(key), 1)[0], b"v")  # a first value for the baseline
            parent = key
        paths = [store.disk.path_of(blob_keys(kv_locator(k), 1)[0]) for k in keys]
        cases = {
            "find 8 keys, all hit (480p records)": lambda: store.records.find(keys),
            "find 8 keys, all miss": lambda: store.records.find(absent),
            "find 1 key, hit": lambda: store.records.find(keys[:1]),
            "find 1 key, miss": lambda: store.records.find(absent[:1]),
            "baseline: lstat of 8 value files": lambda: [os.lstat(p) for p in paths],
        }
        assert all(r is not None for r in store.records.find(keys)) and not any(store.records.find(absent))
        rows = {}
        for name, fn in cases.items():
            for _ in range(50):
                fn()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rows[name] = {"p50_ms": _pct(times, 0.5), "p99_ms": _pct(times, 0.99),
                          "mean_ms": round(1e3 * statistics.fmean(times), 4)}
            print(f"{name:40} p50 {rows[name]['p50_ms']:7.3f} ms  p99 {rows[name]['p99_ms']:7.3f} ms", flush=True)
        base = rows["baseline: lstat of 8 value files"]["p50_ms"]
        hit = rows["find 8 keys, all hit (480p records)"]["p50_ms"]
        print(f"8-key probe (hit) / 8 lstat: {hit / base:.1f}x; target: at most 1 ms -> "
              f"{'met' if hit <= 1.0 else 'NOT met'}")
        record_bytes = os.path.getsize(store.disk.path_of(keys[0].hex() + ":rec"))
        write_json(Path(args.out), {"experiment": "shared_index/probe_localdisk", "env": env_info(), **git_state(),
                                    "reps": args.reps, "record_file_bytes": record_bytes, "rows": rows,
                                    "target_ms": 1.0, "met": hit <= 1.0})
    finally:
        store.close()
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
