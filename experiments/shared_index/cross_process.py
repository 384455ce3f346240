"""A chunk restored from a record another process wrote, against the same process's restore.

Two worker processes share one LocalDisk root (one GPU, as a service runs one worker per GPU and
restarts them). The writer runs A (P+X cold: every chunk written, its record last), then B twice in
the same process (its own trie: the same-process restore). It exits. A fresh reader process, with
an empty trie, runs B twice: the first finds every chunk by key in the root's records (adopted,
then restored from the page cache), the second from its own trie. Every B's frame hashes must
equal A's. Printed: the restore's seconds and GiB/s (the manager's ``restore_seconds`` over the
bytes restored) and the session's wall, each against the writer's same-process restore measured in
the same run.

    python experiments/shared_index/cross_process.py [--device cuda] [--geometry lingbot_480p]
        [--chunks 3] [--root DIR] [--out DIR] [HYDRA_OVERRIDE ...]
"""

from __future__ import annotations

import argparse
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

from benchlib import GiB, env_info, git_state, write_json  # noqa: E402

REPO = HERE.parent.parent


def _stack(args: argparse.Namespace):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR
    from cacheseek.orchestrator import build_stack, instantiate
    from cacheseek.registry import import_backends

    import_backends()  # every backend's schema in Hydra's ConfigStore
    overrides = ["+store=localdisk", f"store.root={args.root}", f"runtime.device={args.device}",
                 f"runtime.geometry={args.geometry}", f"workload.total_chunks={args.chunks}",
                 f"workload.prefix_chunks={max(1, args.chunks - 1)}",
                 "runtime.handout=false",  # the KV restore path (a handed-out hit restores no KV)
                 *args.overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    gate = instantiate(cfg.workload)
    return build_stack(cfg, run_dir=Path(args.out) / f"run-{args.role}", workload=gate), gate.P + gate.X


def _session(stack, actions) -> dict:
    before = stack.metrics.as_dict()
    binding, hashes, wall = stack.run_session(actions)
    after = stack.metrics.as_dict()
    return {"hit_depth": binding.last_fast_forward, "wall_s": wall, "bytes_restored": binding.bytes_restored,
            "restore_s": after["restore_seconds"] - before["restore_seconds"],
            "adopted": after["index_adopted"] - before["index_adopted"],
            "frame_hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes]}


def worker(args: argparse.Namespace) -> None:
    stack, actions = _stack(args)
    out: dict = {"role": args.role, "pid": os.getpid(), "sessions": {}}
    try:
        if args.role == "writer":
            out["sessions"]["A"] = _session(stack, actions)
        for name in ("B1", "B2"):
            out["sessions"][name] = _session(stack, actions)
    finally:
        stack.close()
    Path(args.out, f"{args.role}.json").write_text(json.dumps(out, indent=2))


def _spawn(args: argparse.Namespace, role: str) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--root", args.root, "--out", args.out,
           "--device", args.device, "--geometry", args.geometry, "--chunks", str(args.chunks), *args.overrides]
    print(f"[{time.strftime('%H:%M:%S')}] {role}: starting a fresh process", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, timeout=args.timeout, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{role} exited with {done.returncode}")
    result = json.loads(Path(args.out, f"{role}.json").read_text())
    print(f"[{time.strftime('%H:%M:%S')}] {role}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--geometry", default="lingbot_480p")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--root", default=None, help="the shared LocalDisk root (default: a new temp folder)")
    p.add_argument("--out", default=str(HERE / "results" / "cross_process"))
    p.add_argument("--timeout", type=float, default=480.0, help="bound of each worker process, seconds")
    p.add_argument("--role", choices=("writer", "reader"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.role:
        worker(args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    made = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="cs-xproc-")
    try:
        w = _spawn(args, "writer")
        r = _spawn(args, "reader")
    finally:
        if made:
            shutil.rmtree(args.root, ignore_errors=True)
    a = w["sessions"]["A"]
    rows = [("writer", "B1", "same process, its own trie"), ("writer", "B2", "same process, again"),
            ("reader", "B1", "fresh process: found by key in the records"), ("reader", "B2", "fresh process, its own trie now")]
    base = w["sessions"]["B2"]["restore_s"] or float("nan")
    table, ok = [], True
    for who, name, what in rows:
        s = (w if who == "writer" else r)["sessions"][name]
        same = s["frame_hashes"] == a["frame_hashes"] and s["hit_depth"] == args.chunks
        ok = ok and same and s["bytes_restored"] > 0  # a hit that restored no KV measured nothing
        gibs = s["bytes_restored"] / GiB / s["restore_s"] if s["restore_s"] else None
        table.append({"process": who, "session": name, "what": what, "hit_depth": s["hit_depth"],
                      "adopted": s["adopted"], "restore_s": round(s["restore_s"], 4),
                      "restore_gib_s": None if gibs is None else round(gibs, 2),
                      "vs_same_process": round(s["restore_s"] / base, 3), "wall_s": round(s["wall_s"], 3),
                      "frames_equal_A": same})
    print(f"\n{'process':8} {'session':7} {'K':>2} {'adopted':>7} {'restore s':>9} {'GiB/s':>6} {'vs same':>7}  what")
    for t in table:
        print(f"{t['process']:8} {t['session']:7} {t['hit_depth']:>2} {t['adopted']:>7} {t['restore_s']:>9.4f} "
              f"{t['restore_gib_s'] or 0:>6.2f} {t['vs_same_process']:>6.3f}x  {t['what']}")
    print(f"\n{'PASS' if ok else 'FAIL'}: every B equals A's frames, hits all {args.chunks} chunks and restores their KV")
    results = {"experiment": "shared_index/cross_process", "env": env_info(), **git_state(), "device": args.device,
               "geometry": args.geometry, "chunks": args.chunks, "A_wall_s": a["wall_s"],
               "chunk_bytes_restored": a["bytes_restored"], "rows": table, "passed": ok}
    write_json(Path(args.out) / "results.json", results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
