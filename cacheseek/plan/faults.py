"""`PlanFaults`: failures injected into the embedded Plan store at every step (tests only)."""

from __future__ import annotations

__all__ = ["PlanFaults"]


class PlanFaults:
    """Faults for `EmbeddedPlanClient`, armed by tests.

    Points (each fires on the ``nth`` next time the client reaches it, ``times`` times):
    ``put_start`` (start raises PlanError), ``commit_raise`` (the commit call raises after it was
    submitted), ``commit_status`` (the commit resolves with status 1, nothing published),
    ``get_start``, ``get_transfer`` (raises; the plan stays STARTED), ``remove`` (raises),
    ``table_magic`` / ``table_count`` / ``table_null`` (the next table is written corrupt).
    ``key_codes[key] = code`` makes the commit of ``key`` return that code (not published).
    """

    POINTS = (
        "put_start", "commit_raise", "commit_status", "get_start", "get_transfer", "remove",
        "table_magic", "table_count", "table_null",
    )

    def __init__(self) -> None:
        self._armed: dict[str, list[list[int]]] = {}
        self.key_codes: dict[str, int] = {}
        self.fired: list[str] = []

    def arm(self, point: str, *, nth: int = 1, times: int = 1) -> None:
        if point not in self.POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(self.POINTS)}")
        self._armed.setdefault(point, []).append([nth - 1, times])

    def fire(self, point: str) -> bool:
        for entry in self._armed.get(point, []):
            if entry[1] <= 0:
                continue
            if entry[0] > 0:
                entry[0] -= 1
                continue
            entry[1] -= 1
            self.fired.append(point)
            return True
        return False

    def key_code(self, key: str) -> int:
        return self.key_codes.get(key, 0)
