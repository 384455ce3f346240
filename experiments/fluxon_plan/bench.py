#!/usr/bin/env python3
"""Copies, GiB/s and ops/s of the Plan path over the public Fluxon client, next to the embedded one.

Runs the Plan calls of both clients through the same transfer runtime (the host runtime's
memmove: on this CPU machine it stands in for the D2H of a write and the H2D of a read):

  put   local_fast_put_start(keys, n) -> decode the table -> one copy batch from the source
        ("device") buffers into the plan's values -> local_fast_put_commit -> check every code
  get   get_start(keys, [1]*k) -> get_transfer -> decode -> one copy batch from the values into
        the destination buffers -> release_views

Clients (``--clients``):
  embedded      EmbeddedPlanClient (an in-process segment): put = 1 copy (the caller's, straight
                into the segment); get = 1 copy (the caller's, straight from the segment)
  public_io4    FluxonPublicPlanClient, 4 Fluxon calls in flight: put = 2 copies (the caller's
                into staging + fluxon-py's staging -> segment, inside the commit); get = 1 copy (the
                caller's, from a zero-copy view into the owner's segment)
  public_io1    the same, one Fluxon call at a time

Each plan holds ``--values`` values of one size (a chunk's K/V values are one size); each case
runs ``--reps`` plans after one untimed warm-up plan, reps interleaved across clients. Put keys
are fresh per rep and removed afterwards (untimed; Fluxon frees removed space asynchronously, so
a put that meets a full segment is retried after a pause, untimed; a rep whose values Fluxon
evicted before the read, its own eviction under pressure, is redone and counted). It starts its
own service (``--dram``, default 2 GiB) and warms it up first (``--warmup-s``: a young service
answers puts slowly). Run from the repository root inside a private network namespace:

    tools/netns-run.sh python experiments/fluxon_plan/bench.py

Writes results.json and fluxon_plan.png beside this script (``--out``); ``--replot`` redraws
the plot from results.json.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import Progress, env_info, gib_s, median, write_json  # noqa: E402

MiB = 1 << 20
SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
COPIES = {
    "embedded": {"put": 1, "get": 1, "put_note": "caller D2H into the segment",
                 "get_note": "caller H2D from the segment"},
    "public": {"put": 2, "get": 1, "put_note": "caller D2H into staging + fluxon-py staging -> segment (in commit)",
               "get_note": "caller H2D from a zero-copy view into the owner's segment"},
}


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


class Case:
    def __init__(self, name: str, client: Any, runtime: Any, fluxon: Any) -> None:
        self.name, self.client, self.runtime, self.fluxon = name, client, runtime, fluxon

    def arena(self):
        fn = getattr(self.client, "table_arena", None)
        return fn() if callable(fn) else None


def _buffers(n_values: int, size: int, fill: int) -> list[Any]:
    bufs = [(ctypes.c_char * size)() for _ in range(n_values)]
    for b in bufs:
        ctypes.memset(ctypes.addressof(b), fill, size)
    return bufs


def _put_plan(case: Case, keys: list[str], size: int, srcs: list[int]) -> dict[str, float]:
    from cacheseek.errors import StoreFullError
    from cacheseek.plan.table import decode_plan_table
    from cacheseek.transfer.batch import CopyBatch, Direction
    from cacheseek.transfer.memory import MemoryRange

    c, rt = case.client, case.runtime
    for attempt in range(20):
        t0 = time.perf_counter()
        plan, table = c.local_fast_put_start(keys, size)
        dsts = decode_plan_table(table, len(keys), arena=case.arena())
        t1 = time.perf_counter()
        rt.copy_batch(CopyBatch.of(dsts, srcs, [size] * len(keys), Direction.D2H),
                      device_ranges=[MemoryRange(p, size) for p in srcs])
        t2 = time.perf_counter()
        result = c.local_fast_put_commit(plan).result(timeout=120)
        t3 = time.perf_counter()
        if result.ok:
            return {"start": t1 - t0, "copy": t2 - t1, "commit": t3 - t2, "total": t3 - t0}
        for k in keys:
            c.remove(k)
        if not all(code in (0, 6000) for code in result.key_codes):
            raise RuntimeError(f"commit failed: {result}")
        time.sleep(1.0)  # Fluxon frees removed space asynchronously: retry, untimed
    raise StoreFullError(f"{case.name}: store stayed full for {len(keys)} values of {size} B")


def _get_plan(case: Case, keys: list[str], size: int, dsts: list[int]) -> Optional[dict[str, float]]:
    from cacheseek.plan.table import decode_plan_table
    from cacheseek.transfer.batch import CopyBatch, Direction
    from cacheseek.transfer.memory import MemoryRange

    c, rt = case.client, case.runtime
    t0 = time.perf_counter()
    plan = c.get_start(keys, [1] * len(keys))
    t1 = time.perf_counter()
    table, n = c.get_transfer(plan)
    if n != len(keys):  # Fluxon evicted some under pressure
        c.release_views(plan)
        return None
    srcs = decode_plan_table(table, n, arena=case.arena())
    rt.copy_batch(CopyBatch.of(dsts, srcs, [size] * n, Direction.H2D),
                  device_ranges=[MemoryRange(p, size) for p in dsts])
    t2 = time.perf_counter()
    c.release_views(plan)
    t3 = time.perf_counter()
    return {"start": t1 - t0, "copy": t2 - t1, "release": t3 - t2, "total": t3 - t0}


def run_size(cases: list[Case], size: int, n_values: int, reps: int) -> list[dict[str, Any]]:
    """Every client at one value size; reps interleaved across clients (client A rep 1, client B
    rep 1, ...) so that drift in the service's speed (it speeds up over its first minutes, and
    other tenants come and go) weighs on every client alike."""
    srcs_buf = _buffers(n_values, size, 0x5A)
    dsts_buf = _buffers(n_values, size, 0)
    srcs = [ctypes.addressof(b) for b in srcs_buf]
    dsts = [ctypes.addressof(b) for b in dsts_buf]
    puts: dict[str, list] = {c.name: [] for c in cases}
    gets: dict[str, list] = {c.name: [] for c in cases}
    evicted = {c.name: 0 for c in cases}
    for rep in range(reps + 1):  # rep 0: untimed warm-up
        for case in cases:
            for attempt in range(4):
                keys = [f"bench/{case.name}/{size}/{rep}/{attempt}/{i}" for i in range(n_values)]
                p = _put_plan(case, keys, size, srcs)
                g = _get_plan(case, keys, size, dsts)
                for k in keys:
                    case.client.remove(k)
                if case.name != "embedded" and size * n_values >= 64 * MiB:
                    time.sleep(1.5)  # untimed: let Fluxon reclaim the removed values' space
                if g is not None:
                    break
                evicted[case.name] += 1  # Fluxon evicted a value just written: redo the rep
            else:
                raise RuntimeError(f"{case.name}: values evicted before they were read, 4 times")
            if ctypes.string_at(dsts[-1], 64) != b"\x5a" * 64:
                raise RuntimeError(f"{case.name}: read back wrong bytes")
            ctypes.memset(dsts[-1], 0, size)
            if rep:
                puts[case.name].append(p)
                gets[case.name].append(g)
    nbytes = size * n_values

    def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
        total = median([r["total"] for r in rows])
        out = {k: median([r[k] for r in rows]) for k in rows[0]}
        out.update(gib_s=gib_s(nbytes, total), values_per_s=n_values / total, plans_per_s=1 / total,
                   all_total_s=[round(r["total"], 5) for r in rows])
        return out

    out = []
    for case in cases:
        kind = "embedded" if case.name == "embedded" else "public"
        out.append({"client": case.name, "size": size, "values": n_values, "reps": reps,
                    "evicted_reps_redone": evicted[case.name],
                    "put": summary(puts[case.name]), "get": summary(gets[case.name]), "copies": COPIES[kind]})
    return out


def memmove_gib_s(size: int = 16 * MiB, reps: int = 30) -> float:
    a, b = _buffers(1, size, 1)[0], _buffers(1, size, 0)[0]
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(ctypes.addressof(b), ctypes.addressof(a), size)
        ts.append(time.perf_counter() - t0)
    return gib_s(size, median(ts))


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["cases"]
    clients = list(dict.fromkeys(r["client"] for r in rows))
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(clients)
    for ax, (op, metric, title) in zip(axes, [("put", "gib_s", "put GiB/s"), ("get", "gib_s", "get GiB/s"),
                                              ("put", "values_per_s", "values/s (put solid, get hatched)")]):
        for j, client in enumerate(clients):
            by = {r["size"]: r for r in rows if r["client"] == client}
            xs = [i + j * width for i in range(len(sizes))]
            ys = [by[s][op][metric] if s in by else 0 for s in sizes]
            bars = ax.bar(xs, ys, width, label=client)
            if metric == "values_per_s":
                ax.bar([x + width / 2.5 for x in xs], [by[s]["get"][metric] if s in by else 0 for s in sizes],
                       width / 5, color=bars.patches[0].get_facecolor(), hatch="//", alpha=0.6)
        ax.set_xticks([i + width * (len(clients) - 1) / 2 for i in range(len(sizes))])
        ax.set_xticklabels([_label(s) for s in sizes])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Plan path: embedded vs public fluxon-py {results['env'].get('fluxon_py', '?')} "
                 f"(CPU, {results['env'].get('cpus')} cores, host memmove stands in for D2H/H2D)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="value sizes in bytes")
    ap.add_argument("--values", type=int, default=8, help="values per plan")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--clients", default="embedded,public_io4,public_io1")
    ap.add_argument("--dram", default="2GiB")
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--replot", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.replot:
        import json

        plot(json.loads((out / "results.json").read_text()), out / "fluxon_plan.png")
        return 0
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("FLUXON_LOG", "warn")
    from cacheseek.fluxon.client import FluxonClient, fluxon_runtime_info
    from cacheseek.fluxon_service.service import FluxonService
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
    from cacheseek.transfer.host_transfer import HostTransferRuntime
    from cacheseek.transfer.memory import HostMapping

    sizes = [int(s) for s in args.sizes.split(",")]
    clients = args.clients.split(",")
    prog = Progress(len(sizes) * len(clients) + 2, "fluxon_plan")
    work = Path(tempfile.mkdtemp(prefix="fluxon-plan-bench-"))
    svc = FluxonService(work / "svc", dram=args.dram, cluster_name=f"planbench{os.getpid()}",
                        share_mem_path=f"/dev/shm/cacheseek-planbench-{os.getpid()}")
    svc.start()
    recorded = dict(vars(args), out=os.path.relpath(out.resolve(), HERE.parents[1]))  # repo-relative
    results: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "args": recorded, "cases": []}
    try:
        fx = FluxonClient(svc.cluster_name, svc.share_mem_path, "planbench", op_timeout_s=60.0,
                          attach_timeout_s=90.0, key_index=False)
        info = fluxon_runtime_info()
        results["env"] = dict(env_info(), fluxon_py=info["fluxon_py_version"], fluxon_pyo3=info["extensions"],
                              segment_bytes=svc.dram_bytes, loadavg_at_start=os.getloadavg())
        prog.step(f"service up ({svc.dram_bytes >> 20} MiB segment), client attached")
        t_end = time.monotonic() + args.warmup_s
        src = (ctypes.c_char * 4096)()
        n = 0
        while time.monotonic() < t_end:
            fx.put_from_ptr(f"warm/{n % 16}", ctypes.addressof(src), 4096)
            n += 1
        for i in range(min(n, 16)):
            fx.remove(f"warm/{i}")
        results["memmove_gib_s"] = memmove_gib_s()
        prog.step(f"warm-up: {n} small puts in {args.warmup_s:.0f} s; one 16 MiB memmove: "
                  f"{results['memmove_gib_s']:.1f} GiB/s")
        staging = args.values * max(sizes) + MiB
        cases: list[Case] = []
        try:
            for name in clients:
                if name == "embedded":
                    client: Any = EmbeddedPlanClient(segment_bytes=2 * staging, prefault_threads=1)
                else:
                    io = int(name.rsplit("io", 1)[1])
                    client = FluxonPublicPlanClient(client=fx, staging_bytes=staging, io_threads=io)
                runtime = HostTransferRuntime()
                cases.append(Case(name, client, runtime, fx))
                runtime.register([HostMapping(m.ptr, m.length, m.generation, m.writable)
                                  for m in client.wait_local_segments_ready()])
            for size in sizes:
                for row in run_size(cases, size, args.values, args.reps):
                    results["cases"].append(row)
                    prog.step(f"{row['client']:<11} {_label(size):>7} x{args.values}: "
                              f"put {row['put']['gib_s']:.3f} GiB/s "
                              f"({row['put']['values_per_s']:.0f} values/s; start {row['put']['start'] * 1e3:.1f} ms, "
                              f"copy {row['put']['copy'] * 1e3:.1f} ms, commit {row['put']['commit'] * 1e3:.1f} ms) | "
                              f"get {row['get']['gib_s']:.3f} GiB/s ({row['get']['values_per_s']:.0f} values/s; "
                              f"start {row['get']['start'] * 1e3:.1f} ms, copy {row['get']['copy'] * 1e3:.1f} ms)")
                write_json(out / "results.json", results)
        finally:
            for case in cases:
                case.runtime.close()
                case.client.close()
        fx.close()
    finally:
        svc.stop()
    results["env"]["loadavg_at_end"] = os.getloadavg()
    results["memmove_gib_s_at_end"] = memmove_gib_s()
    write_json(out / "results.json", results)
    plot(results, out / "fluxon_plan.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
