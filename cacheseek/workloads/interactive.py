"""The ``interactive`` workload: live sessions, one action per chunk, as TeleFuser's services run
them.

Each session is created with no controls (nothing to look up up front) and then streams one
action per chunk along a path of a Zipf-popular action tree (`action_tree.ActionTree`:
``depth`` chunks, ``branching`` choices per chunk, exponent ``skew``, ``sessions`` sessions,
``images`` start images). While a session follows a path already cached, each chunk is restored
instead of computed (the binding's live restore); once it leaves the path it computes and writes
as usual. Sessions run one after another, so later ones find what earlier ones wrote: a popular
start and the common first moves are served from the cache.

The verdict, like the gate's: every session's frame hashes equal a cold run of the same actions
on no cache (one reference per distinct path, computed first). Reported: hits by chunk index
(``live_hits_by_chunk`` in the metrics), chunks restored mid-session, per-chunk time of restored
and of computed chunks (each ``generate`` of one chunk, timed from the caller; on CUDA after a
synchronize; also in the metrics, ``cacheseek_chunk_seconds``), time to first frame (creation plus chunk 0) of sessions whose first chunk was
restored and of those that computed it, one row per session, and a plot (``interactive.png`` in
the run folder, where matplotlib is installed) of the hit rate and the chunk times by index.

Runs on every runtime whose ``make`` takes ``streamed=True``: the synthetic one and
``runtime=telefuser`` (its release, hooked and main layouts).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from cacheseek.codecs.quality import require_exact
from cacheseek.progress import bar
from cacheseek.registry import WORKLOADS
from cacheseek.workloads.action_tree import ActionTree

log = logging.getLogger(__name__)

__all__ = ["InteractiveWorkload"]


@WORKLOADS.register("interactive")
class InteractiveWorkload:
    def __init__(self, sessions: int = 12, depth: int = 4, branching: int = 3, skew: float = 1.2,
                 images: int = 1, seed: int = 7, action_dim: int = 4) -> None:
        self.tree = ActionTree(sessions=sessions, depth=depth, branching=branching, skew=skew, images=images,
                               seed=seed, action_dim=action_dim)

    @property
    def cache_chunks(self) -> int:
        """Chunks the run may keep at once: every distinct prefix (`cacheseek.sizing`)."""
        return self.tree.distinct_prefixes()

    cache_chunks_why = "every distinct prefix"

    @property
    def cache_chunk_depths(self) -> list[int]:
        """The depth of each chunk in `cache_chunks` (`cacheseek.sizing`: decoder states)."""
        return self.tree.prefix_depths()

    def run(self, stack: Any, sessions: Optional[Sequence[int]] = None, *,
            on_ready: Optional[Callable[[], None]] = None,
            on_session: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
        """Run the plan's sessions (``sessions``: the indices of a chosen subset, in order; a
        worker of `tools/workers.py` runs its share this way) and return the results. The cold
        references of the chosen sessions' paths come first; then ``on_ready()`` is called (the
        workers wait there for each other, so their live sessions start at once), and
        ``on_session(row)`` after each live session."""
        require_exact(stack.store, "interactive")
        tree, factory = self.tree, stack.runtime_factory
        chosen = self.tree.chosen(sessions)
        distinct = sorted({tree.plan[i] for i in chosen})
        progress = bar(len(distinct) + len(chosen), "interactive", unit="session")
        progress.set_postfix_str("cold references")
        reference, cold_chunk_s = {}, []
        for key in distinct:
            hashes, times = _stream(factory, tree.actions(key[1]), None, tree.images[key[0]])
            reference[key] = hashes
            cold_chunk_s += times[1:]  # chunk 0's time holds the session's creation
            progress.update()
        if on_ready is not None:
            on_ready()
        progress.set_postfix_str("live sessions")
        manager = stack.new_manager()
        rows, errors = [], []
        restored_s, computed_s, ttff = [], [], {"restored": [], "computed": []}
        try:
            for i in chosen:
                image, path = tree.plan[i]
                binding = stack.new_binding(manager)
                try:
                    hashes, times = _stream(factory, tree.actions(path), binding, tree.images[image])
                except Exception as exc:  # noqa: BLE001 - recorded, the run fails
                    log.exception("session %d failed", i)
                    errors.append(f"session {i}: {type(exc).__name__}: {exc}")
                    hashes, times = [], []
                restored = set(binding.restored_chunks)
                for idx, t in enumerate(times):
                    binding.chunk_finished(idx, t)  # the metrics (unless attach's seam timed the chunk already)
                for idx, t in enumerate(times[1:], start=1):
                    (restored_s if idx in restored else computed_s).append(t)
                if times:
                    ttff["restored" if 0 in restored else "computed"].append(times[0])
                rows.append({
                    "name": f"s{i:02d}", "session": i, "actions": f"i{image}:" + ".".join(map(str, path)),
                    "hit_depth": len(restored), "chunks_computed": len(path) - len(restored),
                    "wall_s": sum(times), "bytes_restored": binding.bytes_restored,
                    "frames_served": binding.frames_served, "chunks_materialized": binding.chunks_materialized,
                    "bytes_written": binding.bytes_written, "expect": "== cold",
                    "verdict": "ok" if hashes == reference[(image, path)] else "MISMATCH",
                })
                binding.close()
                if on_session is not None:
                    on_session(rows[-1])
                progress.update()
        finally:
            progress.close()
        stack.store.flush()
        m = stack.metrics.as_dict()
        figures = {
            "sessions": len(rows), "distinct_paths": len(distinct), "depth": len(tree.plan[0][1]),
            "live_hits_by_chunk": m["live_hits_by_chunk"],
            "chunks_restored": sum(r["hit_depth"] for r in rows),
            "chunks_total": sum(len(tree.plan[i][1]) for i in chosen),
            "restored_chunk_s": _stats(restored_s), "computed_chunk_s": _stats(computed_s),
            "cold_chunk_s": _stats(cold_chunk_s),
            "ttff_restored_s": _stats(ttff["restored"]), "ttff_computed_s": _stats(ttff["computed"]),
            "mismatches": sum(r["verdict"] != "ok" for r in rows), "errors": errors,
        }
        r_med, c_med = figures["restored_chunk_s"]["median"], figures["cold_chunk_s"]["median"]
        figures["restored_over_cold"] = r_med / c_med if r_med and c_med else None
        figures["plot"] = _plot(figures, tree, rows, stack.run_dir)
        passed = not errors and figures["mismatches"] == 0
        return {"workload": "interactive", "requests": rows, "interactive": figures,
                "summary": _summary(figures), "passed": passed}


def _stream(factory: Any, actions: list, binding: Any, image: Any) -> tuple[list[bytes], list[float]]:
    """One live session, chunk by chunk: its frame hashes and each chunk's seconds (chunk 0's
    includes the session's creation)."""
    session = factory.make(actions, hooks=binding, image=image, streamed=True)
    on_gpu = str(getattr(factory, "device", "cpu")).startswith("cuda")
    times = []
    for i in range(len(actions)):
        t0 = time.perf_counter()
        hashes = session.generate(stop_after=i + 1)
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return list(hashes), times


def _stats(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"n": 0, "mean": None, "median": None}
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values)}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1e3 * x:.1f} ms"


def _summary(f: dict[str, Any]) -> str:
    by_chunk = ", ".join(f"{k}: {v}" for k, v in f["live_hits_by_chunk"].items()) or "none"
    ratio = f["restored_over_cold"]
    return (
        f"interactive: {f['sessions']} live sessions ({f['distinct_paths']} distinct paths of {f['depth']} chunks): "
        f"{f['chunks_restored']} of {f['chunks_total']} chunks restored mid-session (by chunk: {by_chunk}); "
        f"chunk time median restored {_ms(f['restored_chunk_s']['median'])} vs computed "
        f"{_ms(f['computed_chunk_s']['median'])} (cold reference {_ms(f['cold_chunk_s']['median'])}"
        f"{'' if ratio is None else f', restored/cold {ratio:.3f}'}); time to first frame median restored "
        f"{_ms(f['ttff_restored_s']['median'])}, computed {_ms(f['ttff_computed_s']['median'])}; "
        f"{f['mismatches']} sessions differ from a cold run, {len(f['errors'])} errors")


def _plot(f: dict[str, Any], tree: ActionTree, rows: list, run_dir: Optional[Path]) -> Optional[str]:
    """``interactive.png``: the share of sessions restoring each chunk index, and chunk times."""
    if run_dir is None:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("interactive: no plot (matplotlib is not installed: pip install -e '.[bench]')")
        return None
    depth = f["depth"]
    hits = [f["live_hits_by_chunk"].get(i, 0) / f["sessions"] for i in range(depth)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.bar(range(depth), hits, color="tab:green")
    ax1.set_xticks(range(depth))
    ax1.set(xlabel="chunk index", ylabel="sessions restoring it", ylim=(0, 1), title="live hits by chunk")
    medians = [("restored", f["restored_chunk_s"]["median"]), ("computed", f["computed_chunk_s"]["median"]),
               ("cold", f["cold_chunk_s"]["median"])]
    ax2.bar([n for n, _ in medians], [1e3 * (v or 0) for _, v in medians], color=["tab:green", "tab:red", "tab:gray"])
    ax2.set(ylabel="median chunk time (ms)", title="per-chunk time")
    fig.tight_layout()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "interactive.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
