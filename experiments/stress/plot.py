"""Figures of a ``+experiment=stress`` run: store usage over time against the capacity and the
eviction watermarks, and hits by restored depth.

    python experiments/stress/plot.py RESULTS_JSON OUT_PNG [TITLE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(results_path: Path, out: Path, title: str = "") -> None:
    data = json.loads(results_path.read_text())
    s, m = data["stress"], data["metrics"]
    cap = s["capacity_bytes"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [2.2, 1]})

    t = [p[0] for p in s["timeline"]]
    used = [p[1] / 1024 for p in s["timeline"]]
    ax.step(t, used, where="post", lw=1.0, color="tab:blue", label="store used")
    ev = [(p[0], p[1] / 1024) for p in s["timeline"] if p[3] == "evict"]
    if ev:
        ax.plot(*zip(*ev), "v", ms=3, color="tab:red", alpha=0.6, label="after an eviction pass")
    if cap:
        ax.axhline(cap / 1024, color="black", lw=1.5, label=f"capacity {cap / 1024:.1f} KiB")
        ax.axhline(s["high_watermark"] * cap / 1024, color="tab:orange", ls="--", lw=1,
                   label=f"high watermark {s['high_watermark']:.0%}")
        ax.axhline(s["low_watermark"] * cap / 1024, color="tab:green", ls="--", lw=1,
                   label=f"low watermark {s['low_watermark']:.0%}")
    ax.set_xlabel("time since the first write (s)")
    ax.set_ylabel("KiB")
    ax.set_ylim(0, (cap or max(used)) / 1024 * 1.15)
    ax.set_title(f"store usage ({data['store']}): peak {s['peak_bytes'] / 1024:.2f} KiB, "
                 f"{m['write_bytes'] / 1024:.1f} KiB written ({s['written_over_capacity']:.1f}x capacity)")
    ax.legend(loc="lower right", fontsize=8)

    depths = list(range(1, max([int(k) for k in m["hits_by_depth"]] + [1]) + 1))
    full = [m["hits_by_depth"].get(str(d), 0) - m["partial_hits_by_depth"].get(str(d), 0) for d in depths]
    part = [m["partial_hits_by_depth"].get(str(d), 0) for d in depths]
    bx.bar(depths, part, color="tab:cyan", label="partial hits")
    bx.bar(depths, full, bottom=part, color="tab:blue", label="full hits")
    bx.set_ylim(0, max([f + p for f, p in zip(full, part)] + [1]) * 1.75)
    bx.set_xlabel("restored depth K (chunks)")
    bx.set_ylabel("sessions")
    bx.set_title(f"hits by depth: hit rate {m['hit_rate']:.0%}, {m['misses']} misses")
    bx.legend(fontsize=8, loc="upper left")
    text = (f"{s['sessions']} sessions ({s['distinct_sequences']} distinct), {s['threads']} threads\n"
            f"evictions {m['evictions']}, latents freed {m['skeletons_freed']}\n"
            f"losses injected {s.get('values_lost', 0)}, invalidations {m['invalidations']}, "
            f"retries {m['restore_retries']}\n"
            f"dropped writes {m['dropped_writes']}, hash mismatches {s['mismatches']}")
    bx.text(0.98, 0.97, text, transform=bx.transAxes, ha="right", va="top", fontsize=8,
            bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    plot(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
