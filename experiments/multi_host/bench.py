#!/usr/bin/env python3
"""Cross-host restore over Fluxon: one and three chunks, first read and replica read, against the
writer's own restore, with the link's raw TCP speed measured in the same run (needs root).

Two emulated hosts (tools/emulated_hosts.py: namespaces on a bridge, own /dev/shm and /tmp each):
``a`` runs the control plane and an owner, ``b`` an owner; both owners sized by the rule the
service checks (10 x the largest slot) plus room for b's replicas. ``a`` writes every chunk (each
KV value and the latent one Fluxon value, as `FluxonTensorTier` keys them); then per chunk count
(1, 3), on fresh chunks each time:

  writer     a restores chunks it wrote (each value local or remote, as placement fell)
  first      b restores chunks a wrote, never read on b (the cross-host first read)
  replica    b restores the same chunks again (each value now in b's segment: the same-host case)

A restore gets every value of the chunk and copies it out of the segment into a private buffer
(`tools/fluxon_peer.py`), checked bit-exact afterwards. Each value's received bytes on the
reader's link say whether it crossed it (placement, issue 25 item 3). ``tcp`` sends 256 MiB
(tiny: 16 MiB) over the same link with plain sockets.

Geometries: tiny (as is), and lingbot_480p scaled down to ``--layers-480p`` layers per chunk (default 1: two
45.7 MiB KV values in 64 MiB slots and the latent), since a whole 480p chunk is 3.57 GiB.

    python experiments/multi_host/bench.py [--reps 2]    # as root; about 3-5 min on 2 cores

Writes results.json, results.md and multi_host.png beside this script.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(HERE.parent)]

from benchlib import env_info, median, write_json  # noqa: E402
from emulated_hosts import EmulatedHosts  # noqa: E402
from fluxon_peer import digest, payload  # noqa: E402
from multi_host_demo import FluxonHosts  # noqa: E402

MiB = 1 << 20


def chunk_values(geometry: str, layers: int) -> list[int]:
    from cacheseek.runtime.geometry import get_geometry

    g = get_geometry(geometry)
    return [g.kv_nbytes_per_chunk()] * (2 * min(layers, g.n_layers)) + [g.latent_nbytes()]


def restore(peer, chunks: list[list[tuple[str, str, int]]]) -> dict:
    t0 = time.perf_counter()
    values = [dict(peer.call("get", key=key), key=key, want=want, size=size)
              for chunk in chunks for key, want, size in chunk]
    wall = time.perf_counter() - t0
    bad = [v["key"] for v in values if v.get("digest") != v["want"]]
    if bad:
        raise RuntimeError(f"{peer.host}: {len(bad)} values missing or not bit-exact: {bad[:3]} {values[0]}")
    nbytes = sum(v["size"] for v in values)
    remote = [v for v in values if v["rx"] >= v["size"] // 4 and v["size"] >= 64 << 10]
    return {"wall_s": wall, "bytes": nbytes, "values": len(values), "remote_values": len(remote),
            "value_s": [[v["size"], v["s"], v["rx"]] for v in values]}


def run_geometry(cluster, hosts, geometry: str, layers: int, reps: int) -> dict:
    sizes = chunk_values(geometry, layers)
    a, b = cluster.peer("a", 60.0), cluster.peer("b", 60.0)
    try:
        seed = iter(range(10**6))
        fresh = iter(range(10**6))

        def write_chunks(n: int) -> list[list[tuple[str, str, int]]]:
            chunks = []
            for _ in range(n):
                c = next(fresh)
                chunk = []
                for i, size in enumerate(sizes):
                    key, s = f"{geometry}/c{c}/v{i}", next(seed)
                    out = a.call("put", key=key, seed=s, size=size)
                    if "error" in out:
                        raise RuntimeError(f"put {key}: {out['error']}")
                    chunk.append((key, digest(payload(s, size)), size))
                chunks.append(chunk)
            return chunks

        tcp_bytes = (256 if geometry != "tiny" else 16) * MiB
        rows = []
        for rep in range(reps):
            port = a.call("tcp_serve", size=tcp_bytes)["port"]
            tcp = b.call("tcp_recv", host=hosts.address("a"), port=port)
            rows.append({"rep": rep, "case": "tcp", "chunks": 0, "wall_s": tcp["s"], "bytes": tcp["bytes"]})
            for n in (1, 3):
                mine = write_chunks(n)
                rows.append(dict(restore(a, mine), rep=rep, case="writer", chunks=n))
                theirs = write_chunks(n)
                rows.append(dict(restore(b, theirs), rep=rep, case="first", chunks=n))
                rows.append(dict(restore(b, theirs), rep=rep, case="replica", chunks=n))
                for chunk in mine + theirs:  # room for the next rep
                    for key, _, _ in chunk:
                        a.call("remove", key=key)
                time.sleep(1.0)
        return {"geometry": geometry, "layers": min(layers, 10**6), "value_bytes": sizes, "rows": rows}
    finally:
        a.close()
        b.close()


def summarize(result: dict) -> list[dict]:
    rows = result["rows"]
    tcp = median([r["bytes"] / r["wall_s"] for r in rows if r["case"] == "tcp"])
    out = [{"geometry": result["geometry"], "case": "tcp", "chunks": 0, "MiB": rows[0]["bytes"] / MiB,
            "wall_s": median([r["wall_s"] for r in rows if r["case"] == "tcp"]), "GiB_s": tcp / 2**30,
            "vs_replica": None, "vs_tcp": 1.0, "remote": ""}]
    for n in (1, 3):
        rep = median([r["wall_s"] for r in rows if r["case"] == "replica" and r["chunks"] == n])
        for case in ("writer", "first", "replica"):
            sel = [r for r in rows if r["case"] == case and r["chunks"] == n]
            wall = median([r["wall_s"] for r in sel])
            nbytes = sel[0]["bytes"]
            big = max(result["value_bytes"]) >= 64 << 10  # smaller ones drown in the RPC bytes
            out.append({"geometry": result["geometry"], "case": case, "chunks": n, "MiB": nbytes / MiB,
                        "wall_s": wall, "GiB_s": nbytes / wall / 2**30, "vs_replica": wall / rep,
                        "vs_tcp": wall / (nbytes / tcp) if big else None,
                        "remote": f"{sum(r['remote_values'] for r in sel)}/{sum(r['values'] for r in sel)}"
                        if big else "n/a (values < 64 KiB)"})
    return out


def per_value(result: dict) -> dict:
    """Seconds per get of the largest value, by whether it crossed the link."""
    big = max(result["value_bytes"])
    local, remote = [], []
    for r in result["rows"]:
        for size, s, rx in r.get("value_s", []):
            if size == big:
                (remote if rx >= size // 4 and size >= 64 << 10 else local).append(s)
    return {"value_bytes": big, "local_s": median(local), "remote_s": median(remote),
            "local_n": len(local), "remote_n": len(remote)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_md(path: Path, data: dict) -> None:
    m = data["meta"]
    lines = [f"# Cross-host restore over Fluxon (2 emulated hosts)", "",
             f"commit {m['commit']}, fluxon-py {m['fluxon_py']}, python {m['env']['python']}, "
             f"{m['env']['cpus']} CPUs, {m['env']['platform']}, {m['env']['time']}; owners {m['dram']} each, "
             f"{m['reps']} reps (medians). 480p scaled down: {m['layers_480p']} layer(s) per chunk.", "",
             "| geometry | case | chunks | KiB | wall s | MiB/s | x same-host (replica) | x raw TCP | values over the link |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["summary"]:
        vr = "" if r["vs_replica"] is None else f"{r['vs_replica']:.2f}"
        vt = "" if r["vs_tcp"] is None else f"{r['vs_tcp']:.1f}"
        lines.append(f"| {r['geometry']} | {r['case']} | {r['chunks']} | {r['MiB'] * 1024:.1f} | {r['wall_s']:.3f} | "
                     f"{r['GiB_s'] * 1024:.2f} | {vr} | {vt} | {r['remote']} |")
    lines += ["", "Per get of the largest value (seconds, median):", ""]
    for g, pv in data["per_value"].items():
        lines.append(f"- {g}: {pv['value_bytes']} B, local {pv['local_s']:.3f} s (n={pv['local_n']}), "
                     f"over the link {pv['remote_s']:.3f} s (n={pv['remote_n']})")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geos = [g for g in data["per_value"]]
    fig, axes = plt.subplots(1, len(geos), figsize=(6 * len(geos), 4))
    for ax, g in zip(axes if len(geos) > 1 else [axes], geos):
        rows = [r for r in data["summary"] if r["geometry"] == g]
        labels = [f"{r['case']}\n{r['chunks']} ch" if r["chunks"] else "raw TCP" for r in rows]
        ax.bar(labels, [r["wall_s"] for r in rows], color=["grey"] + ["C0", "C3", "C2"] * 2)
        ax.set_ylabel("wall s (restore: values copied out)")
        ax.set_title(f"{g}: a writes, b reads (2 emulated hosts)")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"commit {data['meta']['commit']}, fluxon-py {data['meta']['fluxon_py']}, "
                 f"{data['meta']['env']['cpus']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--layers-480p", type=int, default=1)
    p.add_argument("--dram", default="2GiB", help="each owner (480p: 640 MiB per 8 values it keeps)")
    p.add_argument("--values", type=int, default=24, help="480p values one owner keeps (the dram check)")
    p.add_argument("--out", default=str(HERE))
    p.add_argument("--render", action="store_true", help="only rewrite results.md and the plot from results.json")
    args = p.parse_args()
    out = Path(args.out)
    if args.render:
        data = json.loads((out / "results.json").read_text())
        data["summary"] = [s for r in data["results"] for s in summarize(r)]
        write_json(out / "results.json", data)
        write_md(out / "results.md", data)
        plot(out / "multi_host.png", data)
        print((out / "results.md").read_text())
        return 0
    import importlib.metadata as md

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cacheseek-hosts-") as shared:
        os.chmod(shared, 0o777)
        with EmulatedHosts(["a", "b"], shared_dir=shared, shm_size="3g") as hosts:
            cluster = FluxonHosts(hosts, dram=args.dram, geometry="lingbot_480p", values=args.values)
            try:
                cluster.start()
                results = [run_geometry(cluster, hosts, "tiny", 2, args.reps),
                           run_geometry(cluster, hosts, "lingbot_480p", args.layers_480p, args.reps)]
            finally:
                cluster.close()
    data = {"meta": {"commit": commit(), "fluxon_py": md.version("fluxon-py"), "env": env_info(), "dram": args.dram,
                     "reps": args.reps, "layers_480p": args.layers_480p, "wall_s": time.monotonic() - t0},
            "results": results, "summary": [s for r in results for s in summarize(r)],
            "per_value": {r["geometry"]: per_value(r) for r in results}}
    write_json(out / "results.json", data)
    write_md(out / "results.md", data)
    plot(out / "multi_host.png", data)
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
