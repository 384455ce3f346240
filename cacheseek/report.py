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
