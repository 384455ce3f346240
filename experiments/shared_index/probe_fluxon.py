#!/usr/bin/env python3
"""The cost of a shared-index probe on Fluxon: the next 8 chunk keys in the cluster's etcd
(`EtcdRecords`, one transaction) against one fluxon-py ``is_exist`` per key, in the same run.

Starts its own single-node service (`FluxonService`: etcd, master, owner; 32 MiB segment) and
attaches one `FluxonClient`. Then, ``--reps`` times each (after ``--warmup`` untimed calls):

  records_find_8_hit        ``records.find`` of 8 keys whose records exist (tiny geometry: 2
                            layers, 4 value checksums in each record), decoded and checked
  records_find_8_hit_480p   the same with 480p-sized records (40 layers: 80 value checksums each)
  records_find_8_miss       ``records.find`` of 8 keys without records
  records_find_1_hit/miss   one key (a live session asks for one chunk at a time)
  records_publish           ``records.publish`` of a new record (create-if-absent: one transaction)
  records_retract           ``records.retract`` (one delete)
  etcdkv_8_gets             the alternative not taken: fluxon-py's own etcd client
                            (``fluxon_pyo3.EtcdKvClient``: get, put, delete, get_prefix; no
                            transaction, no deadline), one ``get`` per key of the 8 hit keys
  is_exist_8_serial         the baseline: ``FluxonClient.exists`` of 8 value keys one after another
                            (4 of them stored, 4 not), as a probe without records would cost
  is_exist_8_threads        the same 8 calls on 8 threads at once

It prints p50/p99 (ms) per case and the ratio of each 8-key probe to the baseline, and writes
``probe_fluxon.json`` beside this script (``--out``): the figures, the machine (CPU, cores, load
average before and after: the numbers are wall times on a shared machine), the versions and the
git commit. Run it inside a private network namespace (the master and owner advertise a
non-loopback address):

    tools/netns-run.sh env PYTHONPATH=. python experiments/shared_index/probe_fluxon.py [--reps 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import benchlib  # noqa: E402  (puts the repository on sys.path)

TARGET_MS = 2.0  # issue 31: a batched probe of the next 8 keys in at most 2 ms on loopback Fluxon


def pct(seconds: list[float], q: float) -> float:
    xs = sorted(seconds)
    return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]


def chain(seed: bytes, n: int) -> list[bytes]:
    keys, key = [], hashlib.sha256(seed).digest()
    for i in range(n):
        key = hashlib.sha256(key + b"action%d" % i).digest()
        keys.append(key)
    return keys


def records_of(keys: list[bytes], n_layers: int) -> list[Any]:
    from cacheseek.kv.locators import kv_locator, layer_keys
    from cacheseek.kv.records import ChunkRecord

    out, parent = [], hashlib.sha256(b"root").digest()
    for depth, key in enumerate(keys):
        loc = kv_locator(key)
        digests = {k: hashlib.sha256(k.encode()).hexdigest()[:16] for i in range(n_layers) for k in layer_keys(loc, i)}
        out.append(ChunkRecord(node_key=key, parent_key=parent, root_hash=hashlib.sha256(b"ns").digest(), depth=depth,
                               n_layers=n_layers, nbytes=n_layers * 2 * 47_923_200, latent_nbytes=4096,
                               storage_format="cacheseek.tier.objects.v1", digests=digests))
        parent = key
    return out


def measure(name: str, fn: Callable[[], Any], reps: int, warmup: int, progress: Any) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    seconds = benchlib.timed(fn, reps)
    row = {"case": name, "reps": reps, "p50_ms": round(pct(seconds, 0.50), 4), "p99_ms": round(pct(seconds, 0.99), 4),
           "mean_ms": round(1e3 * sum(seconds) / len(seconds), 4), "min_ms": round(1e3 * min(seconds), 4)}
    progress.step(f"{name:26s} p50 {row['p50_ms']:9.3f} ms  p99 {row['p99_ms']:9.3f} ms")
    return row


def versions(etcd_bin: str) -> dict[str, str]:
    out = {}
    for pkg in ("fluxon-py", "grpcio", "etcd3", "protobuf"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "missing"
    try:
        text = subprocess.run([etcd_bin, "--version"], capture_output=True, text=True, timeout=30).stdout
        out["etcd"] = text.splitlines()[0].split(":", 1)[1].strip() if text else "?"
    except (OSError, IndexError, subprocess.SubprocessError):
        out["etcd"] = "?"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=1000, help="timed calls per records case")
    ap.add_argument("--baseline-reps", type=int, default=40, help="timed calls per is_exist case")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "probe_fluxon.json"))
    args = ap.parse_args()

    from cacheseek.fluxon.client import FluxonClient
    from cacheseek.fluxon.etcd import resolve_etcd_binary
    from cacheseek.fluxon_service.service import FluxonService

    load_before = os.getloadavg()
    progress = benchlib.Progress(12, "probe_fluxon")
    name = f"probe{os.getpid()}"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="probe-fluxon-") as tmp:
        svc = FluxonService(Path(tmp) / "svc", dram="32MiB", cluster_name=name,
                            share_mem_path=f"/dev/shm/{name}", fluxon_log="error")
        svc.start()
        progress.note(f"service ready in {svc.ready_seconds:.1f} s (etcd {svc.etcd_endpoint})")
        client = FluxonClient(name, svc.share_mem_path, op_timeout_s=10.0, key_index=False)
        records = client.records
        try:
            tiny = records_of(chain(b"tiny", 8), 2)
            big = records_of(chain(b"480p", 8), 40)
            for r in tiny + big:
                assert records.publish(r)
            miss = chain(b"absent", 8)
            assert all(records.find([r.node_key for r in tiny])) and not any(records.find(miss))
            values = [f"probe-value-{i}" for i in range(8)]
            for v in values[:4]:
                client.put_bytes(v, b"x" * 4096)
            fresh = iter(chain(b"publish", args.reps + args.warmup))
            published: list[bytes] = []

            def publish() -> None:
                rec = records_of([next(fresh)], 2)[0]
                records.publish(rec)
                published.append(rec.node_key)

            def retract() -> None:
                records.retract(published.pop())

            def exists_threads() -> None:
                threads = [threading.Thread(target=client.exists, args=(v,)) for v in values]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            r, w = args.reps, args.warmup
            rows.append(measure("records_find_8_hit", lambda: records.find([x.node_key for x in tiny]), r, w, progress))
            rows.append(measure("records_find_8_hit_480p", lambda: records.find([x.node_key for x in big]), r, w,
                                progress))
            rows.append(measure("records_find_8_miss", lambda: records.find(miss), r, w, progress))
            rows.append(measure("records_find_1_hit", lambda: records.find([tiny[0].node_key]), r, w, progress))
            rows.append(measure("records_find_1_miss", lambda: records.find(miss[:1]), r, w, progress))
            rows.append(measure("records_publish", publish, r, w, progress))
            rows.append(measure("records_retract", retract, r, 0, progress))
            from fluxon_py.tool import import_fluxon_pyo3_local

            etcdkv = import_fluxon_pyo3_local().EtcdKvClient(list(client.etcd_endpoints))
            tiny_keys = [records.key(x.name).decode() for x in tiny]
            assert all(etcdkv.get(k) for k in tiny_keys)
            rows.append(measure("etcdkv_8_gets", lambda: [etcdkv.get(k) for k in tiny_keys], r, w, progress))
            b, bw = args.baseline_reps, 3
            rows.append(measure("is_exist_8_serial", lambda: [client.exists(v) for v in values], b, bw, progress))
            rows.append(measure("is_exist_8_threads", exists_threads, b, bw, progress))
            stats = records.stats.as_dict()
            for rec in tiny + big:
                records.retract(rec.node_key)
            for key in published:
                records.retract(key)
            for v in values[:4]:
                client.remove(v)
            progress.step("cleaned up")
        finally:
            client.close()
            svc.stop()
            progress.step("service stopped")
        etcd_version = versions(resolve_etcd_binary())
    load_after = os.getloadavg()
    by = {row["case"]: row for row in rows}
    base = by["is_exist_8_serial"]
    for row in rows:
        row["p50_vs_is_exist_8_serial"] = round(row["p50_ms"] / base["p50_ms"], 5)
    verdict = {case: {"p50_ms": by[case]["p50_ms"], "p99_ms": by[case]["p99_ms"], "target_ms": TARGET_MS,
                      "p50_within_target": by[case]["p50_ms"] <= TARGET_MS}
               for case in ("records_find_8_hit", "records_find_8_hit_480p", "records_find_8_miss")}
    result = {
        "what": "a batched probe of the next 8 chunk keys on loopback Fluxon: EtcdRecords (the cluster's etcd, "
                "one transaction) against one fluxon-py is_exist per key, same run",
        "command": "tools/netns-run.sh env PYTHONPATH=. python experiments/shared_index/probe_fluxon.py "
                   + " ".join(sys.argv[1:]),
        "rows": rows, "target": verdict, "record_stats": stats,
        "machine": {"cpu": benchlib.cpu_model(), "cores": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in load_after], "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": etcd_version, **benchlib.git_state(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    benchlib.write_json(Path(args.out), result)
    print(f"\n{'case':26s} {'p50 ms':>9s} {'p99 ms':>9s} {'x is_exist_8':>13s}")
    for row in rows:
        print(f"{row['case']:26s} {row['p50_ms']:9.3f} {row['p99_ms']:9.3f} {row['p50_vs_is_exist_8_serial']:13.5f}")
    for case, v in verdict.items():
        print(f"{case}: p50 {v['p50_ms']:.3f} ms {'<=' if v['p50_within_target'] else '>'} {TARGET_MS} ms target")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} cores); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
