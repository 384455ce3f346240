"""The A/B/C/D gate and the per-depth ring check on TeleFuser's real LingBot-World-fast loop, for
every store and ring mode, recorded with the TeleFuser that ran (version, layout, source).

    python experiments/telefuser_real/run_matrix.py                      # installed TeleFuser
    python experiments/telefuser_real/run_matrix.py --telefuser-src /tmp/tf_hooked \\
        --telefuser-commit bb98a6b --tag hooked                          # a TeleFuser checkout
    python experiments/telefuser_real/run_matrix.py --telefuser-src /tmp/tf_main \\
        --telefuser-commit 5a12f03 --tag main                            # TeleFuser main (layout=auto)
    python experiments/telefuser_real/run_matrix.py --device cuda --tag h200

Writes results_<tag>.json and results_<tag>.md here (or in --out). Not a timing benchmark: the
wall seconds of the tiny model are shown for orientation only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

RINGS = {"full": (-1, 0), "rolling_7_3": (7, 3), "rolling_6_0": (6, 0), "rolling_5_1": (5, 1)}
STORES = {"memory": [], "localdisk": ["+store=localdisk"],
          "fluxon_plan": ["+store=fluxon_plan", "store.segment_bytes=67108864"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--telefuser-src", help="a folder holding a TeleFuser `telefuser` package, imported first")
    ap.add_argument("--telefuser-commit", default="", help="the TeleFuser commit of --telefuser-src, for the record")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--rings", default=",".join(RINGS))
    ap.add_argument("--tag", default="released")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--note", default="", help="a line for the record (e.g. extra packages the checkout needed)")
    args = ap.parse_args(argv)
    if args.telefuser_src:
        sys.path.insert(0, str(Path(args.telefuser_src).resolve()))

    import torch

    from benchlib import env_info
    from cacheseek.cli import run
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from cacheseek.cli import CONF_DIR

    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: a second OpenMP thread costs more than it gives
    rows, runtime_info = [], None
    combos = [(s, r) for s in args.stores.split(",") for r in args.rings.split(",")]
    for i, (store, ring) in enumerate(combos, 1):
        L, S = RINGS[ring]
        overrides = ["runtime=telefuser", f"runtime.device={args.device}", f"runtime.local_attn_size={L}",
                     f"runtime.sink_size={S}", "workload.total_chunks=4", "workload.prefix_chunks=2",
                     *STORES[store]]
        with tempfile.TemporaryDirectory() as tmp:
            if store == "localdisk":
                overrides.append(f"store.root={tmp}/kv")
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            t0 = time.perf_counter()
            res = run(cfg, Path(tmp) / "run")
            wall = time.perf_counter() - t0
        runtime_info = res["runtime"]
        reqs = {r["name"]: r for r in res["requests"]}
        ring_ok = sum(r["verdict"] == "ok" for r in res["ring_check"])
        rows.append({"store": store, "ring": ring, "L": L, "S": S,
                     "hit_depths": [reqs[x]["hit_depth"] for x in "ABCD"],
                     "frames_B_eq_A": res["frame_hashes"]["B"] == res["frame_hashes"]["A"],
                     "frames_C_eq_D": res["frame_hashes"]["C"] == res["frame_hashes"]["D"],
                     "ring_check": f"{ring_ok}/{len(res['ring_check'])}",
                     "hook_failures": res["metrics"]["hook_failures"],
                     "passed": res["passed"], "wall_s": round(wall, 2)})
        print(f"[{i}/{len(combos)}] {store:12s} {ring:12s} hits {rows[-1]['hit_depths']} "
              f"ring {rows[-1]['ring_check']} {'PASS' if res['passed'] else 'FAIL'} ({wall:.1f} s)", flush=True)
    out = {"telefuser": runtime_info, "telefuser_commit": args.telefuser_commit,
           "command": " ".join(["python", "experiments/telefuser_real/run_matrix.py", *(argv or sys.argv[1:])]),
           "cacheseek_commit": _git_head(), "env": env_info(), "rows": rows,
           "all_passed": all(r["passed"] for r in rows), "note": args.note,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"results_{args.tag}.json").write_text(json.dumps(out, indent=2, default=str))
    (Path(args.out) / f"results_{args.tag}.md").write_text(_markdown(out))
    print(f"{'PASS' if out['all_passed'] else 'FAIL'}: {len(rows)} combinations on {runtime_info}")
    return out


def _markdown(out: dict) -> str:
    tf = out["telefuser"] or {}
    lines = [f"# Gate on TeleFuser's real LingBot-World-fast loop ({tf.get('layout')} layout)", "",
             f"- TeleFuser: {tf.get('telefuser')} at `{tf.get('telefuser_path')}`"
             + (f", commit {out['telefuser_commit']}" if out["telefuser_commit"] else ""),
             f"- model: tiny random-weight DiT {tf.get('model')}, device {tf.get('device')}",
             f"- CacheSeek commit: {out['cacheseek_commit']}; {out['date']}",
             f"- python {out['env'].get('python')}, torch {out['env'].get('torch')}, {out['env'].get('cpus')} CPUs",
             f"- command: `{out['command']}`",
             *([f"- note: {out['note']}"] if out.get("note") else []), "",
             "| store | ring (L, S) | hit K A/B/C/D | B frames == A | C frames == D | ring check | hook failures | verdict | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        lines.append(f"| {r['store']} | {r['ring']} ({r['L']}, {r['S']}) | {'/'.join(map(str, r['hit_depths']))} | "
                     f"{r['frames_B_eq_A']} | {r['frames_C_eq_D']} | {r['ring_check']} | {r['hook_failures']} | "
                     f"{'PASS' if r['passed'] else 'FAIL'} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def _git_head() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
