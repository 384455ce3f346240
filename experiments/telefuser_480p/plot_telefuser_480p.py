"""The PNGs of a telefuser_480p results.json: per store, each request's wall (A-D) beside the mean
of the no-cache P+X runs that bracketed it, ratios written on the bars (`plot`); and, where the
nocache process priced it, B and C as measured beside B and C less the VAE work that keeping
frames and the decoder cache would replace (`plot_frames_cache`, ``frames_cache.png``).

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


def plot_frames_cache(results: dict, path: Path) -> bool:
    """B and C per store, measured and less the VAE work a kept copy would replace; False when the
    run priced nothing."""
    m = (results["stores"].get("nocache") or {}).get("frames_cache")
    rows = [r for r in results["table"] if r.get("B_s") is not None and r.get("C_s") is not None]
    if not m or not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sv = m["savings"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['store']} {n}" for r in rows for n in ("B", "C")]
    now = [r[f"{n}_s"] for r in rows for n in ("B", "C")]
    kept = [r["B_s"] - sv["full_hit_saves_s"] if n == "B" else r["C_s"] - sv["partial_hit_saves_s"]
            for r in rows for n in ("B", "C")]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], now, 0.4, label="measured (the VAE decodes every restored chunk)")
    ax.bar([x + 0.2 for x in xs], kept, 0.4, label="less the VAE work kept frames + decoder cache replace")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("wall s")
    ax.set_title(f"Keeping frames and the Wan decoder's cache beside the KV: {results['env'].get('gpu', 'CPU')}, "
                 f"git {results['env'].get('git_commit')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    results = json.loads(src.read_text())
    plot(results, out)
    plot_frames_cache(results, out.with_name("frames_cache.png"))
