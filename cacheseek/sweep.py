"""A Hydra callback that leaves one summary table for a multirun sweep.

Each row names what ran besides its verdict: the store, the runtime (for TeleFuser its version
and how it was attached: ``released``, ``hooked``, ``main``), the layout adapter and the
geometry (the synthetic runtime's preset, TeleFuser's model as ``layers x heads x head_dim
height x width``), read from what the run reported (``results["runtime"]``, ``results["layout"]``),
so that a sweep over runtimes tells its rows apart. A job that failed before reporting (a bad
value of the sweep, a store failing) is a row ``ERROR``, its error line under the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from cacheseek.report import table

COLUMNS = [("job", "job"), ("verdict", "verdict"), ("store", "store"), ("runtime", "runtime"),
           ("layout", "layout"), ("geometry", "geometry"), ("device", "device"),
           ("hits", "hit K (A,B,C,D)"), ("walls", "wall s (A,B,C,D)"), ("ring", "ring check"),
           ("hit_rate", "hit rate"), ("evictions", "evictions"), ("invalidations", "invalidations")]


def what_ran(data: dict[str, Any]) -> dict[str, Any]:
    """The runtime, layout, geometry and device cells of one job's row (its results.json)."""
    described = dict(data.get("runtime") or {})
    runtime = described.get("runtime")
    if runtime == "telefuser":
        runtime = " ".join(str(p) for p in ("telefuser", described.get("telefuser"), described.get("layout")) if p)
    geometry = described.get("geometry") or described.get("model") \
        or data.get("config", {}).get("runtime", {}).get("geometry")
    return {"runtime": runtime, "layout": data.get("layout"), "geometry": geometry,
            "device": described.get("device")}


def _error_of(job_dir: Path) -> str:
    """Why a job has no results: the error line it recorded (`cacheseek.cli`), else unknown."""
    try:
        return str(json.loads((job_dir / "error.json").read_text())["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return "failed before reporting (see its cacheseek.log)"


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for res in sorted(sweep_dir.glob("*/results.json")):
            data = json.loads(res.read_text())
            reqs = data.get("requests", [])
            ring = data.get("ring_check", [])
            metrics = data.get("metrics", {})
            rows.append({
                "job": res.parent.name,
                "verdict": "PASS" if data.get("passed") else "FAIL",
                "store": data.get("store"),
                **what_ran(data),
                "hits": ",".join(str(r["hit_depth"]) for r in reqs),
                "walls": ",".join(f"{r['wall_s']:.2f}" for r in reqs),
                "ring": f"{sum(r['verdict'] == 'ok' for r in ring)}/{len(ring)}",
                "hit_rate": f"{metrics['hit_rate']:.0%}" if "hit_rate" in metrics else "",
                "evictions": metrics.get("evictions"),
                "invalidations": metrics.get("invalidations"),
                "data": data,
            })
        errors = {}
        for p in sorted(sweep_dir.iterdir()):
            if p.is_dir() and p.name != ".hydra" and not (p / "results.json").exists():
                errors[p.name] = _error_of(p)
                rows.append({"job": p.name, "verdict": "ERROR", "error": errors[p.name], "data": {}})
        text = table(rows, COLUMNS)
        for job, why in errors.items():
            text += f"\n{job}: {why}"
        (sweep_dir / "summary.md").write_text(text + "\n")
        (sweep_dir / "summary.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "data"} for r in rows], indent=2))
        print(f"\nsweep summary ({sweep_dir / 'summary.md'}):\n{text}")
