"""How long opening a LocalDisk root takes, and how much memory, with 100k and 1M committed chunks.

A root is its own index (one record file per committed chunk beside its values), so opening one
lists it: the store sweeps interrupted writes and counts its usage (one listing), and the first
reconcile asks for the values no record names (`orphans`), the periodic usage scan lists it again,
and a first lookup reads one record. This script builds roots of N committed chunks straight on
disk (each: its real sealed record and ``--values`` value files named as a chunk's values are; the
values' bytes do not matter to any of these steps), then, in a fresh process per N, times:

- ``open``: `LocalDiskTierStore(root)` (probe, lock, sweep, usage seeded);
- ``first lookup``: `records.find` of one chunk's key (what a session's first probe reads);
- ``usage scan``: a forced `usage()` rescan;  ``orphan scan``: `orphans()` (the reconcile's listing);

and, as the baseline in the same run, one bare listing of the same tree (``os.scandir`` and an
``lstat`` per file, nothing kept): the floor any open that counts usage must pay. Memory: the
process's resident set before the open and its peak after these steps (VmHWM), per file.
The page cache is warm (the tree was just built or listed): a cold disk adds its metadata reads.

    python experiments/root_open/measure.py [--chunks 100000,1000000] [--values 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import env_info, git_state, write_json  # noqa: E402


def build(root: Path, chunks: int, values: int) -> float:
    """A root of ``chunks`` committed chunks, laid out as the store lays them out; seconds taken.
    Chunk 0's record is a real sealed record (the first lookup reads it); every other file is a
    hard link to a template of its kind (a record, a value), one syscall a file: no step timed
    here reads another file's bytes, and the listing sees the names, sizes and dates it would."""
    from cacheseek.kv.locators import blob_keys, kv_locator, latent_locator
    from cacheseek.kv.records import ChunkRecord, encode_record, record_name
    from cacheseek.stores.disk_names import place
    from cacheseek.stores.localdisk import LocalDiskTierStore

    LocalDiskTierStore(str(root)).close()  # the root, its lock, as the store makes them
    t0 = time.perf_counter()
    templates = root.parent / f".templates-{root.name}"
    templates.mkdir(exist_ok=True)
    root_hash = hashlib.sha256(b"root").digest()
    made: set[str] = set()
    links = {"rec": 0, "val": 0}
    for i in range(chunks):
        key = hashlib.sha256(i.to_bytes(8, "little")).digest()
        names = [latent_locator(key), *blob_keys(kv_locator(key), max(1, values // 2))][:values]
        if i == 0:
            rec = ChunkRecord(node_key=key, parent_key=root_hash, root_hash=root_hash, depth=0,
                              n_layers=max(1, values // 2), nbytes=1024, latent_nbytes=256,
                              digests={n: "0123456789abcdef" for n in names[1:]})
            (templates / "rec").write_bytes(encode_record(rec))
            (templates / "val").write_bytes(b"v" * 64)
        for name, kind in [(record_name(key), "rec"), *((n, "val") for n in names)]:
            shard, fname = place(name)
            if shard not in made:
                (root / shard).mkdir(mode=0o700, exist_ok=True)
                made.add(shard)
            if i == 0:
                shutil.copyfile(templates / kind, root / shard / fname)
                continue
            links[kind] += 1
            template = templates / f"{kind}{links[kind] // 60_000}"  # ext4 allows 65,000 links a file
            if not template.exists():
                shutil.copyfile(templates / kind, template)
            os.link(template, root / shard / fname)
        if i and i % 100_000 == 0:
            print(f"  built {i:,} of {chunks:,} chunks ({time.perf_counter() - t0:.0f} s)", flush=True)
    return time.perf_counter() - t0


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(root: str) -> dict:
    """The timed steps, in this (fresh) process."""
    from cacheseek.stores.localdisk import LocalDiskTierStore

    t0 = time.perf_counter()
    files = 0
    with os.scandir(root) as it:
        shards = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    for s in shards:
        with os.scandir(s) as it:
            for e in it:
                e.stat(follow_symlinks=False)
                files += 1
    listing = time.perf_counter() - t0
    rss0 = _status("VmRSS")
    out = {"files": files, "bare_listing_s": listing}
    t0 = time.perf_counter()
    store = LocalDiskTierStore(root)
    out["open_s"] = time.perf_counter() - t0
    try:
        key = hashlib.sha256((0).to_bytes(8, "little")).digest()
        t0 = time.perf_counter()
        found = store.records.find([key])
        out["first_lookup_s"] = time.perf_counter() - t0
        assert found[0] is not None, "the first chunk's record was not found"
        store._scanned_at = float("-inf")
        t0 = time.perf_counter()
        store.usage()
        out["usage_scan_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        orphans = store.orphans()
        out["orphan_scan_s"] = time.perf_counter() - t0
        out["orphans"] = len(orphans)
    finally:
        store.close()
    out["rss_before_bytes"] = rss0
    out["peak_rss_bytes"] = _status("VmHWM")
    out["bytes_per_file"] = round((out["peak_rss_bytes"] - rss0) / max(1, files), 1)
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per step against the chunks in the root (log-log), the targets marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["chunks"] for r in rows]
    for key, label in (("open_s", "open"), ("usage_scan_s", "usage scan"), ("orphan_scan_s", "orphan scan"),
                       ("bare_listing_s", "bare listing (baseline)")):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.scatter([100_000, 1_000_000], [5, 60], marker="x", color="red", zorder=3, label="targets (open)")
    ax.set(xscale="log", yscale="log", xlabel="committed chunks in the root", ylabel="seconds",
           title=f"LocalDisk root open ({rows[0]['values_per_chunk']} values + a record per chunk)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="100000,1000000")
    p.add_argument("--values", type=int, default=2, help="value files per chunk beside its record")
    p.add_argument("--dir", default=None, help="where the roots go (removed after); default a temp folder")
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    base = Path(tempfile.mkdtemp(prefix="cs-root-open-", dir=args.dir))
    rows = []
    try:
        for n in (int(x) for x in args.chunks.split(",")):
            root = base / f"kv{n}"
            print(f"building a root of {n:,} chunks ({args.values} values each + a record)...", flush=True)
            built = build(root, n, args.values)
            done = subprocess.run([sys.executable, __file__, "--child", str(root)], capture_output=True,
                                  text=True, check=True)
            row = {"chunks": n, "values_per_chunk": args.values, "build_s": round(built, 1),
                   **json.loads(done.stdout.strip().splitlines()[-1])}
            row["open_vs_listing"] = round(row["open_s"] / row["bare_listing_s"], 2)
            rows.append(row)
            print(f"  {n:>9,} chunks ({row['files']:,} files): open {row['open_s']:.2f} s "
                  f"({row['open_vs_listing']}x a bare listing, {row['bare_listing_s']:.2f} s), first lookup "
                  f"{1e3 * row['first_lookup_s']:.2f} ms, usage scan {row['usage_scan_s']:.2f} s, orphan scan "
                  f"{row['orphan_scan_s']:.2f} s, peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB "
                  f"({row['bytes_per_file']} B per file)", flush=True)
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    write_json(Path(args.out), {"env": env_info(), "git": git_state(), "rows": rows})
    lines = ["| chunks | files | open s | bare listing s | open/listing | first lookup ms | usage scan s | "
             "orphan scan s | peak RSS MiB | B/file |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['chunks']:,} | {r['files']:,} | {r['open_s']:.2f} | {r['bare_listing_s']:.2f} | "
                     f"{r['open_vs_listing']} | {1e3 * r['first_lookup_s']:.2f} | {r['usage_scan_s']:.2f} | "
                     f"{r['orphan_scan_s']:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} | {r['bytes_per_file']} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, Path(args.out).with_suffix(".png"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
