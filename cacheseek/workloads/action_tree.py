"""`ActionTree`: sessions as paths through a tree of actions, popular prefixes first.

At every depth a session picks one of ``branching`` action vectors, Zipf-skewed with exponent
``skew`` (choice ``j`` has weight ``1 / (j + 1) ** skew``), so a few prefixes are hot, as a
popular start image and the common first moves are for a world model's users. ``images``
distinct start images give as many namespaces. Deterministic in ``seed``. Shared by the
``stress`` and ``interactive`` workloads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Optional

from cacheseek.errors import ConfigError
from cacheseek.runtime.synthetic import SyntheticImage

__all__ = ["ActionTree", "check_count", "MAX_CHUNKS"]


MAX_CHUNKS = 10_000  # chunks of one session: each is computed (seconds at 480p); 10,000 is hours already
MAX_COUNT = 100_000  # sessions, branches, images: every one is planned in memory before the run starts
_WHY = {"chunks": "a session computes every chunk it does not restore (seconds each at 480p) and its actions "
                  "are planned in memory first",
        "count": "each is planned in memory before the run starts"}


def check_count(field: str, value: Any, low: int, high: int = MAX_COUNT, why: str = "count") -> None:
    """`ConfigError` naming ``workload.{field}`` unless ``low <= value <= high`` (an integer);
    above ``high`` with the reason (``why``: a key of the reasons), before anything is allocated."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"workload.{field}", f"must be an integer >= {low}, got {value!r}",
                          f"set workload.{field} to an integer >= {low}")
    if value > high:
        raise ConfigError(f"workload.{field}", f"{value:,} is above the limit of {high:,} ({_WHY[why]})",
                          f"set workload.{field} to at most {high}")


class ActionTree:
    """``plan``: per session ``(image index, path)`` with ``path`` a tuple of choices per depth;
    `actions` turns a path into one action vector (``action_dim`` values in [-1, 1]) per chunk."""

    def __init__(self, *, sessions: int, depth: int, branching: int, skew: float, images: int, seed: int,
                 action_dim: int) -> None:
        for name, value in (("sessions", sessions), ("branching", branching), ("images", images),
                            ("action_dim", action_dim)):
            check_count(name, value, 1)
        check_count("depth", depth, 1, MAX_CHUNKS, "chunks")
        if isinstance(skew, bool) or not isinstance(skew, (int, float)) or skew < 0:
            raise ConfigError("workload.skew", f"must be a number >= 0, got {skew!r}", "set workload.skew=1.0")
        rng = random.Random(seed)
        self.choices = [[[round(rng.uniform(-1, 1), 4) for _ in range(action_dim)]
                         for _ in range(branching)] for _ in range(depth)]
        weights = [1.0 / (i + 1) ** skew for i in range(branching)]
        self.plan = [(rng.randrange(images), tuple(rng.choices(range(branching), weights)[0] for _ in range(depth)))
                     for _ in range(sessions)]
        self.images = [image(i) for i in range(images)]

    def actions(self, path: tuple[int, ...]) -> list[list[float]]:
        return [self.choices[d][c] for d, c in enumerate(path)]

    def chosen(self, sessions: Optional[Sequence[int]] = None) -> list[int]:
        """The session indices a run takes: ``sessions`` (a subset of the plan, in the order
        given: a worker's share), else every session. `ValueError` on an index outside the plan
        or given twice (a caller's mistake, not a config one)."""
        if sessions is None:
            return list(range(len(self.plan)))
        out = [int(i) for i in sessions]
        bad = [i for i in out if not 0 <= i < len(self.plan)]
        if bad or len(set(out)) != len(out):
            raise ValueError(f"sessions must be distinct indices in [0, {len(self.plan)}), got {list(sessions)!r}")
        return out

    def distinct_prefixes(self) -> int:
        return len(self.prefix_depths())

    def prefix_depths(self) -> list[int]:
        """The depth (0-based chunk index) of the last chunk of each distinct prefix."""
        return [len(prefix) - 1 for _, prefix in {(img, path[:d + 1]) for img, path in self.plan
                                                  for d in range(len(path))}]


def image(i: int) -> Any:
    """Start image ``i``: 8x8 RGB, distinct per index."""
    return SyntheticImage("RGB", (8, 8), bytes((j * 37 + 11 + 53 * i) % 256 for j in range(8 * 8 * 3)))
