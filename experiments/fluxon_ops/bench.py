#!/usr/bin/env python3
"""Ops/s and GiB/s of fluxon-py 0.2.4 puts and gets per payload size, on a real local service.

Starts its own single-node service (`FluxonService`, 1 GiB segment), attaches one client and
times, for each payload size:

  put_blocking_bytes   store.put_blocking(key, {"payload": bytes})          (fluxon-py, bytes field)
  put_payload_from_ptr store.put_payload_from_ptr_blocking(key, ptr, n)     (fluxon-py, bytes field)
  put_dlpack_from_ptr  store.put_blocking(key, {FIELD: uint8 array at ptr}) (fluxon-py, DLPack field)
  client_put_from_ptr  FluxonClient.put_from_ptr (the DLPack put + bounded thread + etcd key index)
  get_bytes            store.get_blocking + access() of a bytes field       (Fluxon copies into bytes)
  get_dlpack_access    store.get_blocking + access() + np.from_dlpack       (zero-copy view, no copy)
  get_dlpack_memcpy    the same + one memcpy of the view into a preallocated buffer
  client_read_memcpy   FluxonClient.read(key) + the same memcpy (bounded thread, holder released)

Each case runs until ``--iters`` ops or ``--case-seconds`` have passed (at least 3 ops). Puts
write fresh keys (at most half the segment per case; removed after the case, then a pause while
Fluxon frees the space asynchronously); gets rotate over 4 values written beforehand. Must run inside a private network namespace:

    PYTHONPATH=. tools/netns-run.sh python experiments/fluxon_ops/bench.py

Writes results.json, results.md and fluxon_ops.png into --out (default: beside this script).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
RUN_SIZES = [int(x) for x in os.environ.get("BENCH_SIZES", "").split(",") if x] or SIZES
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import benchlib  # noqa: E402


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--case-seconds", type=float, default=1.2)
    ap.add_argument("--warmup-s", type=float, default=40.0,
                    help="measure once the service is this old (in some runs 0.2.4 puts were ~5-10x "
                         "slower for the first minute); 4 KiB puts are timed meanwhile")
    ap.add_argument("--dram", default="1GiB")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out/results.json")
    args = ap.parse_args()
    if args.replot:
        data = json.loads((Path(args.out) / "results.json").read_text())
        _plot(data["results"], Path(args.out) / "fluxon_ops.png", data["meta"])
        return 0

    import numpy as np

    from cacheseek.fluxon.client import VALUE_FIELD, FluxonClient, fluxon_runtime_info
    from cacheseek.fluxon.values import writable_u8
    from cacheseek.fluxon_service.service import FluxonService

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fluxon-bench-"))
    t_start = time.monotonic()
    results = []
    with FluxonService(workdir, dram=args.dram, cluster_name=f"bench{os.getpid()}",
                       share_mem_path=f"/dev/shm/cacheseek-bench-{os.getpid()}") as svc:
        print(f"service ready in {svc.ready_seconds:.1f} s ({args.dram} segment)", flush=True)
        t_service = time.monotonic() - svc.ready_seconds
        client = FluxonClient(svc.cluster_name, svc.share_mem_path, op_timeout_s=60, attach_timeout_s=60)
        store = client._store  # the fluxon-py client itself, for the raw cases

        def ok(res):
            if not res.is_ok():
                raise RuntimeError(f"fluxon error: {res.unwrap_error()}")
            return res.unwrap()

        warmup = []  # (service age at window end, puts, p50 ms) of 4 KiB put+remove pairs
        small = b"w" * 4096
        n = 0
        while time.monotonic() - t_service < args.warmup_s:
            lat, w0 = [], time.monotonic()
            while time.monotonic() - w0 < 5.0:
                t = time.perf_counter()
                ok(store.put_blocking(f"warm/{n}", {"payload": small}))
                lat.append(time.perf_counter() - t)
                ok(store.remove(f"warm/{n}"))
                n += 1
            age = time.monotonic() - t_service
            warmup.append({"service_age_s": round(age, 1), "puts": len(lat),
                           "p50_ms": statistics.median(lat) * 1e3})
            print(f"warm-up: service age {age:5.1f} s, 4 KiB put p50 {warmup[-1]['p50_ms']:6.1f} ms "
                  f"({len(lat)} puts in 5 s)", flush=True)

        seg = client.segment_bytes
        for size in RUN_SIZES:
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            src_bytes = src.tobytes()
            dst = np.empty(size, dtype=np.uint8)
            ptr = int(src.ctypes.data)
            slot = 1 << (size + 256 - 1).bit_length()  # values take power-of-two slots
            max_puts = max(3, min(args.iters, (seg // 2) // slot))
            # values the gets read: 4 with a bytes field, 4 with a DLPack field
            bkeys = [f"bench/get-bytes/{size}/{i}" for i in range(4)]
            keys = [f"bench/get-dlpack/{size}/{i}" for i in range(4)]
            for k in bkeys:
                ok(store.put_blocking(k, {"payload": src_bytes}))
            for k in keys:
                client.put_from_ptr(k, ptr, size)

            def put_blocking_bytes(key, i):
                ok(store.put_blocking(key, {"payload": src_bytes}))

            def put_payload_from_ptr(key, i):
                ok(store.put_payload_from_ptr_blocking(key, ptr, size))

            def put_dlpack_from_ptr(key, i):
                ok(store.put_blocking(key, {VALUE_FIELD: writable_u8(ptr, size)}))

            def client_put_from_ptr(key, i):
                client.put_from_ptr(key, ptr, size)

            def get_bytes(key, i):
                holder = ok(store.get_blocking(bkeys[i % 4]))
                fields = ok(holder.access())
                assert len(fields["payload"]) == size

            def get_dlpack_access(key, i):
                holder = ok(store.get_blocking(keys[i % 4]))
                fields = ok(holder.access())
                arr = np.from_dlpack(fields[VALUE_FIELD])
                assert arr.nbytes == size
                del arr, fields, holder

            def get_dlpack_memcpy(key, i):
                holder = ok(store.get_blocking(keys[i % 4]))
                fields = ok(holder.access())
                arr = np.from_dlpack(fields[VALUE_FIELD])
                np.copyto(dst, arr)
                del arr, fields, holder

            def client_read_memcpy(key, i):
                with client.read(keys[i % 4]) as view:
                    np.copyto(dst, view.array)

            cases = [put_blocking_bytes, put_payload_from_ptr, put_dlpack_from_ptr, client_put_from_ptr,
                     get_bytes, get_dlpack_access, get_dlpack_memcpy, client_read_memcpy]
            for fn in cases:
                is_put = fn.__name__.startswith("put") or fn.__name__.startswith("client_put")
                limit = max_puts if is_put else args.iters
                written = []
                fn(f"bench/warm/{fn.__name__}/{size}", 0)  # warm up
                written.append(f"bench/warm/{fn.__name__}/{size}")
                lat = []
                t0 = time.perf_counter()
                i = 0
                while i < limit and (i < 3 or time.perf_counter() - t0 < args.case_seconds):
                    key = f"bench/{fn.__name__}/{size}/{i}"  # puts write fresh keys
                    t = time.perf_counter()
                    fn(key, i)
                    lat.append(time.perf_counter() - t)
                    if is_put:
                        written.append(key)
                    i += 1
                total = time.perf_counter() - t0
                if fn is get_dlpack_memcpy:
                    assert np.array_equal(dst, src)
                for k in written:
                    client.remove(k)
                if is_put and size >= 1 << 20:
                    time.sleep(1.5)  # removal frees the space asynchronously
                row = {
                    "op": fn.__name__, "size_bytes": size, "ops": len(lat), "seconds": total,
                    "ops_per_s": len(lat) / total, "gib_per_s": len(lat) * size / total / 2**30,
                    "p50_ms": statistics.median(lat) * 1e3,
                    "p90_ms": sorted(lat)[max(0, int(len(lat) * 0.9) - 1)] * 1e3,
                    "min_ms": min(lat) * 1e3,
                }
                results.append(row)
                print(f"{_label(size):>7}  {row['op']:<22} {row['ops']:4d} ops  {row['ops_per_s']:8.1f} ops/s"
                      f"  {row['gib_per_s']:7.3f} GiB/s  p50 {row['p50_ms']:7.2f} ms  p90 {row['p90_ms']:7.2f} ms"
                      f"  min {row['min_ms']:6.2f} ms", flush=True)
            for k in keys + bkeys:
                client.remove(k)
            time.sleep(1.0)
        info = fluxon_runtime_info()
        client.close()
    meta = {
        "command": "PYTHONPATH=. tools/netns-run.sh python experiments/fluxon_ops/bench.py",
        "machine": {"cpus": os.cpu_count(), "cpu_model": benchlib.cpu_model(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                    "kernel": platform.release()},
        "versions": {"python": sys.version.split()[0], "fluxon_py": info["fluxon_py_version"],
                     "fluxon_pyo3_sha256": next(iter(info["extensions"].values()), None),
                     "numpy": np.__version__},
        "segment": args.dram, "iters_max": args.iters, "case_seconds": args.case_seconds,
        "wall_seconds": time.monotonic() - t_start, "warmup_s": args.warmup_s,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "warmup": warmup, "results": results},
                                                 indent=2) + "\n")
    lines = ["| size | op | ops | ops/s | GiB/s | p50 ms | p90 ms | min ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {_label(r['size_bytes'])} | {r['op']} | {r['ops']} | {r['ops_per_s']:.1f} | "
                     f"{r['gib_per_s']:.3f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['min_ms']:.2f} |")
    lines += ["", "Warm-up (4 KiB put, p50 per 5 s window, by service age):", "",
              "| service age s | puts | p50 ms |", "| --- | --- | --- |"]
    lines += [f"| {w['service_age_s']} | {w['puts']} | {w['p50_ms']:.1f} |" for w in warmup]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(results, out / "fluxon_ops.png", meta)
    print(f"wrote {out}/results.json, results.md, fluxon_ops.png in {meta['wall_seconds']:.0f} s", flush=True)
    return 0


def _plot(results, path: Path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for op in ops:
        rows = [r for r in results if r["op"] == op]
        xs = [r["size_bytes"] for r in rows]
        style = "--" if op.startswith("client") else "-"
        marker = "o" if "put" in op else "s"
        axes[0].plot(xs, [r["gib_per_s"] for r in rows], style, marker=marker, label=op)
        axes[1].plot(xs, [r["ops_per_s"] for r in rows], style, marker=marker, label=op)
    for ax, ylabel in zip(axes, ("GiB/s", "ops/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(SIZES, [_label(s) for s in SIZES])
        ax.set_xlabel("payload size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"fluxon-py {meta['versions']['fluxon_py']} single-node service, "
                 f"{meta['machine']['cpus']}-core CPU VM, {meta['segment']} segment (circles: put, squares: get;"
                 " dashed: through FluxonClient)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
