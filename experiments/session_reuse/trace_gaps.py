"""Where a session's device time goes, from a torch profiler trace: the busy and idle time of the
stream that runs the model, and what the host threads were doing in each idle gap.

A GPU-bound session adds wall time in two ways: more device work on the model's stream (or work
beside it that slows it), or gaps in which that stream has nothing to run because the thread
that launches its kernels is busy elsewhere: a synchronize that drained the queue and the host
work after it, or the GIL held by another thread. Comparing the two for a session that writes
against one that does not says which it is (`compare`).

Input: the Chrome trace of ``torch.profiler`` (``export_chrome_trace``), as a dict. Device events
are ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` (``args.stream``); each has a launching host
event (``cuda_runtime`` / ``cuda_driver``) with the same ``args.correlation``, whose ``tid`` is the
launching thread. Host events are ``cpu_op``, ``cuda_runtime``, ``cuda_driver`` and, with
``with_stack``, ``python_function``. Times in the trace are microseconds.

    analyse(trace, gap_us=500) -> {stream, busy_s, span_s, idle_s, gaps: count, gap_s,
                                    by_host_call: {name: s}, by_frame: {name: s}, top: [...]}

``by_host_call``: a gap's time, by the host call that the launching thread was inside when the
gap opened (``cudaStreamSynchronize``: the queue was drained and waited for; ``-``: none, host
work). ``by_frame``: by the innermost ``python_function`` frame of a ``cacheseek`` module open on
the launching thread across the gap (``-``: none: TeleFuser's own host work).
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Optional

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALL_CATS = ("cuda_runtime", "cuda_driver")  # a launch, a synchronize: a thread's calls into CUDA


def analyse(trace: dict, gap_us: float = 500.0, top: int = 12, ours: str = "cacheseek") -> dict:
    """The model stream's busy and idle time in ``trace`` and its gaps of at least ``gap_us``
    (see the module docstring). The model's stream: the one with the most kernel time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if not device:
        return {"stream": None, "busy_s": 0.0, "span_s": 0.0, "idle_s": 0.0, "gaps": 0, "gap_s": 0.0,
                "by_host_call": {}, "by_frame": {}, "top": []}
    per_stream: dict[Any, float] = collections.Counter()
    for e in device:
        if e.get("cat") == "kernel":
            per_stream[_stream(e)] += float(e.get("dur", 0))
    stream = max(per_stream, key=per_stream.get) if per_stream else _stream(device[0])
    mine = sorted((e for e in device if _stream(e) == stream), key=lambda e: e["ts"])
    launcher = {e["args"]["correlation"]: e.get("tid") for e in events
                if e.get("cat") in HOST_CALL_CATS and "correlation" in e.get("args", {})}
    host = _HostTimeline(events, ours)

    busy, gaps, end = 0.0, [], None
    start = mine[0]["ts"]
    for e in mine:
        ts, te = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if end is None or ts >= end:
            if end is not None and ts - end >= gap_us:
                gaps.append((end, ts, launcher.get(e.get("args", {}).get("correlation"))))
            busy += te - ts
            end = te
        elif te > end:
            busy += te - end
            end = te
    span = end - start
    by_call: dict[str, float] = collections.Counter()
    by_frame: dict[str, float] = collections.Counter()
    rows = []
    for g0, g1, tid in gaps:
        call = host.call_at(tid, g0)
        frame = host.frame_over(tid, g0, g1)
        by_call[call] += (g1 - g0) / 1e6
        by_frame[frame] += (g1 - g0) / 1e6
        rows.append({"at_s": (g0 - start) / 1e6, "ms": (g1 - g0) / 1e3, "host_call": call, "frame": frame})
    rows.sort(key=lambda r: -r["ms"])
    return {"stream": stream, "busy_s": busy / 1e6, "span_s": span / 1e6, "idle_s": (span - busy) / 1e6,
            "gaps": len(gaps), "gap_s": sum((g1 - g0) for g0, g1, _ in gaps) / 1e6,
            "by_host_call": _rounded(by_call), "by_frame": _rounded(by_frame), "top": rows[:top]}


def compare(base: dict, other: dict) -> dict:
    """``other`` minus ``base`` (two `analyse` results): the device's busy and idle seconds, the
    gap seconds, and per host call and per frame what the gaps gained."""
    def diff(key: str) -> dict[str, float]:
        names = set(base[key]) | set(other[key])
        d = {n: round(other[key].get(n, 0.0) - base[key].get(n, 0.0), 6) for n in names}
        return dict(sorted(d.items(), key=lambda kv: -abs(kv[1])))

    return {"busy_s": other["busy_s"] - base["busy_s"], "idle_s": other["idle_s"] - base["idle_s"],
            "gap_s": other["gap_s"] - base["gap_s"], "span_s": other["span_s"] - base["span_s"],
            "by_host_call": diff("by_host_call"), "by_frame": diff("by_frame")}


def markdown(results: dict[str, dict], delta: Optional[dict] = None) -> str:
    """The per-session table (``results``: kind -> `analyse` result) and, with ``delta``
    (`compare`), what the second session's gaps gained by host call and by frame."""
    lines = ["| session | span s | model stream busy s | idle s | gaps (>= threshold) | in gaps s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind, r in results.items():
        lines.append(f"| {kind} | {r['span_s']:.3f} | {r['busy_s']:.3f} | {r['idle_s']:.3f} | {r['gaps']} | "
                     f"{r['gap_s']:.3f} |")
    if delta is not None:
        lines += ["", f"Difference: busy {delta['busy_s'] * 1e3:+.1f} ms, idle {delta['idle_s'] * 1e3:+.1f} ms, "
                  f"in gaps {delta['gap_s'] * 1e3:+.1f} ms.", "", "| the gap opened in | ms gained |", "| --- | ---: |"]
        lines += [f"| {n} | {v * 1e3:+.1f} |" for n, v in list(delta["by_host_call"].items())[:10]]
        lines += ["", "| innermost CacheSeek frame across the gap | ms gained |", "| --- | ---: |"]
        lines += [f"| {n} | {v * 1e3:+.1f} |" for n, v in list(delta["by_frame"].items())[:12]]
    for kind, r in results.items():
        lines += ["", f"Longest gaps, {kind}:", "", "| at s | ms | host call | frame |", "| ---: | ---: | --- | --- |"]
        lines += [f"| {g['at_s']:.3f} | {g['ms']:.2f} | {g['host_call']} | {g['frame']} |" for g in r["top"]]
    return "\n".join(lines) + "\n"


class _HostTimeline:
    """Per host thread: its host calls into CUDA and its ``python_function`` frames of ``ours``."""

    def __init__(self, events: list[dict], ours: str) -> None:
        calls: dict[Any, list] = collections.defaultdict(list)
        frames: dict[Any, list] = collections.defaultdict(list)
        for e in events:
            cat, span = e.get("cat"), (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "?"))
            if cat in HOST_CALL_CATS:
                calls[e.get("tid")].append(span)
            elif cat == "python_function" and _is_ours(span[2], ours):
                frames[e.get("tid")].append(span)
        self._calls = {t: sorted(v) for t, v in calls.items()}
        self._call_starts = {t: [c[0] for c in v] for t, v in self._calls.items()}
        self._frames = frames

    def call_at(self, tid: Any, ts: float) -> str:
        """The host call ``tid`` was inside at ``ts`` (``-`` when none)."""
        starts = self._call_starts.get(tid)
        if not starts:
            return "-"
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0:
            c0, c1, name = self._calls[tid][i]
            if c0 <= ts < c1:
                return name
        return "-"

    def frame_over(self, tid: Any, g0: float, g1: float) -> str:
        """The innermost (shortest) frame of ours on ``tid`` overlapping most of ``[g0, g1)``."""
        best = None
        for f0, f1, name in self._frames.get(tid, ()):
            overlap = min(f1, g1) - max(f0, g0)
            if overlap >= 0.5 * (g1 - g0) and (best is None or f1 - f0 < best[0]):
                best = (f1 - f0, _short(name))
        return best[1] if best else "-"


def _is_ours(name: str, ours: str) -> bool:
    """Whether a ``python_function`` event names a frame in package ``ours``: the profiler writes
    ``cacheseek/x/y.py(123): fn`` (relative to its ``sys.path`` entry) or an absolute path."""
    path = name.partition("(")[0]
    return (path.startswith(f"{ours}/") or f"/{ours}/" in path) and "experiments/" not in path


def _short(name: str) -> str:
    """``cacheseek/x/y.py(123): fn`` (or ``.../cacheseek/x/...``) -> ``x/y.py: fn``."""
    path, _, fn = name.partition(": ")
    path = ("/" + path).rsplit("/cacheseek/", 1)[-1].split("(")[0]
    return f"{path}: {fn}" if fn else path


def _stream(e: dict) -> Any:
    return e.get("args", {}).get("stream", e.get("tid"))


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}
