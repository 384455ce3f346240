"""The PNG of a telefuser_480p results.json: per store, each request's wall (A-D) beside the mean
of the no-cache P+X runs that bracketed it, ratios written on the bars.

    python experiments/telefuser_480p/plot_telefuser_480p.py results.json [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["table"] if r.get("A_s") is not None or r.get("nocache_mean_s") is not None]
    names = ["no cache", "A", "B", "C", "D"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(rows))
    for j, r in enumerate(rows):
        vals = [r.get("nocache_mean_s")] + [r.get(f"{n}_s") for n in "ABCD"]
        xs = [i + j * width for i in range(len(names))]
        ax.bar(xs, [v or 0 for v in vals], width, label=r["store"])
        for x, n, v in zip(xs, names, vals):
            q = r.get(f"{n}_ratio") if n != "no cache" else None
            if v and q:
                ax.text(x, v, f"{q:.2f}x", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("wall s (3 chunks)")
    e = results["env"]
    model = next((r["runtime"]["model"] for r in results["stores"].values() if r.get("runtime")), "?")
    ax.set_title(f"A/B/C/D on TeleFuser's DiT {model}: {e.get('gpu', 'CPU')}, git {e.get('git_commit')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    src = Path(sys.argv[1])
    plot(json.loads(src.read_text()), Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png"))
