"""Compare runs of the H200 benchmarks of two trees (a base and a head, measured in one device call
by run_ab.sh): every figure side by side with head/base, a table, results.json and a plot.

    python experiments/refactor_ab/compare.py BASE_RESULTS HEAD_RESULTS OUT_DIR [--label-base X --label-head Y]

BASE_RESULTS and HEAD_RESULTS are folders with transfer/, hbm_tier/, e2e/ and registration/
results.json (as their ``bench_*.py`` write them), or several such folders joined by commas: the
repeated runs of one side, compared by their medians, each side's spread (max/min) beside them. A
figure whose ratio leaves [0.9, 1.1] is flagged: at these sizes the H200's run-to-run spread is a
few percent, and sub-millisecond timings spread more (the spread columns show how much).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Iterator

TOLERANCE = 0.10


def _load(folder: Path, bench: str) -> dict[str, Any] | None:
    path = folder / bench / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def _figures(folder: Path) -> Iterator[tuple[str, str, float, str]]:
    """(bench, figure, value, unit) for every figure worth comparing; lower-is-better units in s."""
    transfer = _load(folder, "transfer")
    if transfer:
        for row in transfer["rows"]:
            yield "transfer", f"{row['section']}: {row['what']} [{row['direction']}]", row["gib_s"], "GiB/s"
        for name, value in transfer.get("targets", {}).items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    yield "transfer", f"target {name} [{sub}]", v, "x"
            else:
                yield "transfer", f"target {name}", value, "fraction"
    e2e = _load(folder, "e2e")
    if e2e:
        for row in e2e["summary"]["rows"]:
            for key in ("A_wall_s", "B_restore_s", "B_wall_s", "C_wall_s", "A_write_s", "A_over_nocache"):
                if isinstance(row.get(key), (int, float)) and row.get(key):
                    yield "e2e", f"{row['mode']}: {key}", float(row[key]), "s" if key.endswith("_s") else "x"
            if row.get("gate") is not None:
                yield "e2e", f"{row['mode']}: gate PASS", 1.0 if row["gate"] else 0.0, "bool"
    hbm = _load(folder, "hbm_tier")
    if hbm:
        for key in ("d2d_peak_gib_s", "runtime_batch_gib_s", "chunk_runtime_gib_s", "chunk_batched_gib_s"):
            if isinstance((hbm.get("peak") or {}).get(key), (int, float)):
                yield "hbm_tier", f"peak: {key}", float(hbm["peak"][key]), "GiB/s"
        for key in ("hbm_s", "plan_s", "bare_batch_s", "after_promote_s", "write_through_s_per_chunk"):
            if isinstance((hbm.get("full_hit") or {}).get(key), (int, float)):
                yield "hbm_tier", f"full_hit: {key}", float(hbm["full_hit"][key]), "s"
    registration = _load(folder, "registration")
    if registration:
        for row in registration["rows"]:
            yield "registration", f"{row['size_gib']:g} GiB {row['mode']}: s per GiB", row["s_per_gib"], "s"


def _numbered(figures: Iterator[tuple[str, str, float, str]]) -> Iterator[tuple[str, str, float, str]]:
    """A figure measured twice in one run (a repeated first measurement) keeps both, as ``(#2)``."""
    seen: dict[tuple[str, str], int] = {}
    for bench, figure, value, unit in figures:
        n = seen[(bench, figure)] = seen.get((bench, figure), 0) + 1
        yield bench, figure if n == 1 else f"{figure} (#{n})", value, unit


def compare(bases: list[Path], heads: list[Path]) -> list[dict[str, Any]]:
    """One row per figure in both sides: the median of each side's runs, head/base, the spreads."""
    base_figs, head_figs = _runs(bases), _runs(heads)
    rows = []
    for (bench, figure), (unit, values) in head_figs.items():
        if (bench, figure) not in base_figs:
            continue
        before, value = statistics.median(base_figs[(bench, figure)][1]), statistics.median(values)
        ratio = value / before if before else None
        rows.append({"bench": bench, "figure": figure, "unit": unit, "base": before, "head": value,
                     "head_over_base": ratio, "runs": [len(base_figs[(bench, figure)][1]), len(values)],
                     "spread": [_spread(base_figs[(bench, figure)][1]), _spread(values)],
                     "flag": ratio is not None and abs(ratio - 1.0) > TOLERANCE})
    return rows


def _runs(folders: list[Path]) -> dict[tuple[str, str], tuple[str, list[float]]]:
    out: dict[tuple[str, str], tuple[str, list[float]]] = {}
    for folder in folders:
        for bench, figure, value, unit in _numbered(_figures(folder)):
            out.setdefault((bench, figure), (unit, []))[1].append(value)
    return out


def _spread(values: list[float]) -> float | None:
    return max(values) / min(values) if len(values) > 1 and min(values) > 0 else None


def _table(rows: list[dict[str, Any]], labels: tuple[str, str]) -> str:
    lines = [f"| bench | figure | unit | {labels[0]} | {labels[1]} | head/base | spread {labels[0]} / {labels[1]} | |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['head_over_base']:.3f}" if r["head_over_base"] is not None else "n/a"
        spread = " / ".join("-" if x is None else f"{x:.3f}" for x in r["spread"])
        lines.append(f"| {r['bench']} | {r['figure']} | {r['unit']} | {r['base']:.4g} | {r['head']:.4g} | "
                     f"{ratio} | {spread} | {'**check**' if r['flag'] else ''} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path, labels: tuple[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["head_over_base"] is not None and r["unit"] != "bool"]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(shown))))
    y = range(len(shown))
    ax.barh(list(y), [r["head_over_base"] for r in shown],
            color=["tab:red" if r["flag"] else "tab:blue" for r in shown])
    ax.set_yticks(list(y), [f"{r['bench']}: {r['figure']}"[:80] for r in shown], fontsize=6)
    ax.axvline(1.0, color="black", lw=0.8)
    for edge in (1 - TOLERANCE, 1 + TOLERANCE):
        ax.axvline(edge, color="grey", lw=0.5, ls="--")
    ax.set_xlabel(f"{labels[1]} / {labels[0]} (1 = unchanged; for s figures lower is faster)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="a results folder, or several joined by commas (repeated runs)")
    parser.add_argument("head", help="the same for the head tree")
    parser.add_argument("out", type=Path)
    parser.add_argument("--label-base", default="base")
    parser.add_argument("--label-head", default="head")
    args = parser.parse_args()
    labels = (args.label_base, args.label_head)
    rows = compare([Path(p) for p in args.base.split(",")], [Path(p) for p in args.head.split(",")])
    if not rows:
        raise SystemExit(f"error: no figure is in both {args.base} and {args.head}")
    args.out.mkdir(parents=True, exist_ok=True)
    table = _table(rows, labels)
    (args.out / "compare.json").write_text(json.dumps({"labels": labels, "rows": rows}, indent=1))
    (args.out / "compare.md").write_text(table + "\n")
    _plot(rows, args.out / "compare.png", labels)
    flagged = sum(r["flag"] for r in rows)
    print(table)
    print(f"\n{len(rows)} figures compared, {flagged} outside +-{TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
