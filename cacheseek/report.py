"""The CLI report: the request table, the metrics block, the gate's three verdicts, and the
tables of the sweep summary.

The gate's verdicts stay apart (`gate_verdicts`): the hit depths, the frame hashes and the ring
check each get one line, so that a cache that stored nothing (every request cold, frames equal)
reads as that, in one line with the dropped and failed writes, and not as a frame mismatch.
A ring-check depth that was never restored is one line; long lists of differences are capped
at `MAX_DIFFS`.
"""

from __future__ import annotations

from typing import Any, Sequence

MAX_DIFFS = 4  # differences shown per ring-check depth; the rest are counted


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Render rows as an aligned table; ``columns`` is ``[(key, header), ...]``."""
    cells = [[h for _, h in columns]]
    for r in rows:
        cells.append([_cell(r.get(k)) for k, _ in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "" if v is None else str(v)


REQUEST_COLUMNS = [
    ("name", "req"), ("actions", "actions"), ("hit_depth", "hit K"),
    ("chunks_computed", "computed"), ("wall_s", "wall s"), ("restored", "restored"),
    ("written", "written"), ("expect", "expected"), ("verdict", "frame hashes"),
]
GATE_COLUMNS = [  # the gate's rows carry the depth and the frames verdicts apart
    ("name", "req"), ("actions", "actions"), ("hit_depth", "hit K"), ("expect_k", "want K"),
    ("depth", "depth"), ("chunks_computed", "computed"), ("wall_s", "wall s"), ("restored", "restored"),
    ("written", "written"), ("frames_vs", "frames vs"), ("frames", "frames"),
]


def request_table(requests: Sequence[dict[str, Any]]) -> str:
    rows = [dict(r, restored=fmt_bytes(r["bytes_restored"]), written=fmt_bytes(r["bytes_written"]))
            for r in requests]
    gate = all(r.get("depth") for r in requests)
    return table(rows, GATE_COLUMNS if gate else REQUEST_COLUMNS)


def nothing_cached(m: dict[str, Any]) -> str | None:
    """One line when the run stored nothing while it tried to (every write dropped or failed)."""
    tried = m.get("dropped_writes", 0) + m.get("failed_writes", 0)
    if m.get("writes", 0) or not tried:
        return None
    return (f"nothing was cached: {m.get('dropped_writes', 0)} writes dropped, {m.get('failed_writes', 0)} "
            f"failed, none stored (store: {fmt_bytes(m.get('store_used_bytes') or 0)} used of "
            f"{_capacity(m.get('store_capacity_bytes'))}; the log file has each failure)")


def gate_verdicts(results: dict[str, Any]) -> list[str]:
    """The gate's three verdict lines (hit depths, frame hashes, ring check), capped diffs."""
    reqs = results.get("requests", [])
    m = results.get("metrics", {})
    empty = nothing_cached(m)
    misses = [r for r in reqs if r.get("depth") not in (None, "ok")]
    if misses:
        what = ", ".join(f"{r['name']} hit {r['hit_depth']} (want {r['expect_k']})" for r in misses)
        depth = f"hit depth:    FAIL: {what}" + (f"; {empty}" if empty else "")
    else:
        depth = "hit depth:    ok (" + ", ".join(f"{r['name']} {r['hit_depth']}" for r in reqs) + ")"
    quality = results.get("frame_quality")
    exact = [r for r in reqs if not (quality and "lossy" in r.get("frames_vs", ""))]
    wrong = [r for r in exact if r.get("frames") not in (None, "ok")]
    compared = ", ".join(f"{r['name']} {r['frames_vs']}" for r in exact if r.get("frames_vs"))
    frames = (f"frame hashes: FAIL: {', '.join(r['name'] + ' ' + r['frames_vs'] for r in wrong)} does not hold"
              if wrong else f"frame hashes: ok ({compared})")
    lines = [depth, frames]
    if quality:
        lines.append(quality_line(results))
    ring = results.get("ring_check") or []
    if ring:
        ok = [r for r in ring if r["verdict"] == "ok"]
        absent = [r for r in ring if r["verdict"] == "not restored"]
        kv = [r["kv_psnr_db"] for r in ring if "kv_psnr_db" in r]
        lossy = (f" but the KV, lossy: KV PSNR {_db(min(kv, key=_key))}..{_db(max(kv, key=_key))}"
                 if kv else "")
        lines.append(f"ring check:   {'ok' if len(ok) == len(ring) else 'FAIL'} ({len(ok)}/{len(ring)} resume "
                     f"depths equal a cold run{lossy})")
        if absent:
            ks = ", ".join(f"K={r['K']}" for r in absent)
            hits = sorted({r["hit_depth"] for r in absent})
            lines.append(f"  {ks}: never restored (hit {', '.join(map(str, hits))}), nothing to compare"
                         + (f"; {empty}" if empty else ""))
        for r in ring:
            if r["verdict"] == "MISMATCH":
                diff = r["diff"]
                shown = "; ".join(diff[:MAX_DIFFS]) + (f"; ... {len(diff) - MAX_DIFFS} more" if len(diff) > MAX_DIFFS else "")
                lines.append(f"  K={r['K']}: {len(diff)} differences from a cold run: {shown}")
    return lines


def _db(x: Any) -> str:
    return "identical" if x is None else f"{x:.1f} dB"


def _key(x: Any) -> float:
    return float("inf") if x is None else x


def quality_line(results: dict[str, Any]) -> str:
    """The gate's frame-quality verdict under a lossy codec: PSNR against a cold run, the first
    chunk whose frames differ, and the threshold (or that none judged it)."""
    q = results["frame_quality"]
    codec = ",".join(results.get("codec", {}).get("lossy") or []) or "?"
    first = q.get("first_differing_chunk")
    want = q.get("min_psnr_db_required")
    ok = results.get("verdicts", {}).get("frame_quality", True)
    judged = (f"{'ok' if ok else 'FAIL'} (>= {want:.1f} dB required)" if want is not None
              else "reported (workload.min_psnr_db=null: not judged)")
    return (f"frame quality: {judged}: LOSSY codec {codec}: {q.get('vs')}: PSNR {_db(q.get('psnr_db'))}, worst chunk "
            f"{_db(q.get('min_psnr_db'))}, first differing chunk {first if first is not None else 'none'}")


def _capacity(n: Any) -> str:
    return "unbounded" if n is None else fmt_bytes(n)


def metrics_block(m: dict[str, Any]) -> str:
    """The `CacheMetrics` block of the CLI report (``results["metrics"]``), a few lines."""
    depths = ", ".join(f"K={k}: {v}" for k, v in m.get("hits_by_depth", {}).items()) or "none"
    live = m.get("live_lookups", 0)
    kinds = f" ({m['lookups'] - live} prefix, {live} live)" if live else ""
    live_hits = f", {m['live_hits']} live" if live else ""
    misses = m["misses"] + m.get("live_not_cached", 0) + m.get("live_misses", 0)
    failed = m["restore_failures"] + m.get("live_restore_failures", 0)
    lines = [
        f"metrics: {m['lookups']} lookups{kinds}, {m['hits']} hits ({m['hit_rate']:.0%}; "
        f"{m['full_hits']} full, {m['partial_hits']} partial{live_hits}), {misses} misses, "
        f"{m['below_break_even']} below break-even, {failed} failed restores",
        f"  hits by depth: {depths}"
        + (f"; by tier: {', '.join(f'{k}: {v}' for k, v in m['hits_by_tier'].items())}"
           if len(m.get("hits_by_tier") or {}) > 1 else ""),
        f"  restore: {fmt_bytes(m['restore_bytes'])} in {m['restore_seconds']:.3f} s ({m['restores']}), "
        f"{m['restore_retries']} retries; write: {fmt_bytes(m['write_bytes'])} in "
        f"{m['write_seconds']:.3f} s ({m['writes']}); registration {m['registration_seconds']:.3f} s",
    ]
    if m.get("live_lookups"):
        by_chunk = ", ".join(f"{k}: {v}" for k, v in m.get("live_hits_by_chunk", {}).items()) or "none"
        lines.append(f"  live sessions: {m['live_lookups']} chunk lookups, {m['live_hits']} chunks restored "
                     f"mid-session (by chunk: {by_chunk}), {m['live_misses']} found gone, {m['live_restore_failures']} failed")
    if m.get("frames_handed_out") or m.get("frames_written"):
        lines.append(
            f"  frames: {m['frames_handed_out']} chunks handed out from stored frames "
            f"({fmt_bytes(m['frames_read_bytes'])}), {m['frames_missing']} missing, {m['frames_corrupt']} failed "
            f"their checks; {m['frames_written']} stored ({fmt_bytes(m['frames_write_bytes'])}), "
            f"{m['frames_dropped']} dropped; {m['materializations']} divergences restored "
            f"{m['chunks_materialized']} served chunks ({m['decoder_replays']} latents decoded again), "
            f"{m['recomputed_chunks']} computed again")
    if m.get("chunks_unkeyed"):
        lines.append(f"  {m['chunks_unkeyed']} chunks not cached: no control was known for them")
    if m.get("store_used_bytes") is not None:
        lines.append(f"  store: {fmt_bytes(m['store_used_bytes'])} used of {_capacity(m['store_capacity_bytes'])}, "
                     f"peak {fmt_bytes(m['store_peak_bytes'] or 0)}")
    for t in m.get("tiers") or []:
        lines.append(
            f"  tier {t['level']} {t['name']} ({t['tier']}): {t['blobs']} chunks, {fmt_bytes(t['used_bytes'] or 0)} of "
            f"{_capacity(t['capacity_bytes'])}; {t.get('hits', 0)} hits, {t.get('writes', 0)} writes, "
            f"{t.get('promotions', 0)} promoted in, {t.get('demotions', 0)} demoted out"
            + (f", {t['evictions_for_demotion']} moved out to make room" if t.get("evictions_for_demotion") else ""))
    lines.append(f"  evictions {m['evictions']} ({fmt_bytes(m['evicted_bytes'])}), invalidations "
                 f"{m['invalidations']}, latents freed {m['skeletons_freed']}; writes dropped "
                 f"{m['dropped_writes']}, failed {m['failed_writes']}, pending {m['pending_writes']}")
    return "\n".join(lines)
