"""Plain-text tables for the CLI report and the sweep summary."""

from __future__ import annotations

from typing import Any, Sequence


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


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
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


REQUEST_COLUMNS = [
    ("name", "req"), ("actions", "actions"), ("hit_depth", "hit K"),
    ("chunks_computed", "computed"), ("wall_s", "wall s"), ("restored", "restored"),
    ("written", "written"), ("expect", "expected"), ("verdict", "frame hashes"),
]


def request_table(requests: Sequence[dict[str, Any]]) -> str:
    rows = [dict(r, restored=fmt_bytes(r["bytes_restored"]), written=fmt_bytes(r["bytes_written"]))
            for r in requests]
    return table(rows, REQUEST_COLUMNS)


def _capacity(n: Any) -> str:
    return "unbounded" if n is None else fmt_bytes(n)


def metrics_block(m: dict[str, Any]) -> str:
    """The `CacheMetrics` block of the CLI report (``results["metrics"]``), a few lines."""
    depths = ", ".join(f"K={k}: {v}" for k, v in m.get("hits_by_depth", {}).items()) or "none"
    lines = [
        f"metrics: {m['lookups']} lookups, {m['hits']} hits ({m['hit_rate']:.0%}; "
        f"{m['full_hits']} full, {m['partial_hits']} partial), {m['misses']} misses, "
        f"{m['below_break_even']} below break-even, {m['restore_failures']} failed restores",
        f"  hits by depth: {depths}",
        f"  restore: {fmt_bytes(m['restore_bytes'])} in {m['restore_seconds']:.3f} s ({m['restores']}), "
        f"{m['restore_retries']} retries; write: {fmt_bytes(m['write_bytes'])} in "
        f"{m['write_seconds']:.3f} s ({m['writes']}); registration {m['registration_seconds']:.3f} s",
    ]
    if m.get("store_used_bytes") is not None:
        lines.append(
            f"  store: {fmt_bytes(m['store_used_bytes'])} used of {_capacity(m['store_capacity_bytes'])}, "
            f"peak {fmt_bytes(m['store_peak_bytes'] or 0)}"
        )
    for t in m.get("tiers") or []:
        lines.append(
            f"  tier {t['level']} {t['name']}: {t['blobs']} chunks, {fmt_bytes(t['used_bytes'] or 0)} of "
            f"{_capacity(t['capacity_bytes'])}; {t.get('hits', 0)} hits, {t.get('writes', 0)} writes, "
            f"{t.get('promotions', 0)} promoted in, {t.get('demotions', 0)} demoted out"
        )
    lines.append(
        f"  evictions {m['evictions']} ({fmt_bytes(m['evicted_bytes'])}), invalidations "
        f"{m['invalidations']}, latents freed {m['skeletons_freed']}; writes dropped "
        f"{m['dropped_writes']}, failed {m['failed_writes']}, pending {m['pending_writes']}"
    )
    return "\n".join(lines)
