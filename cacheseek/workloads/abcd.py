"""The A/B/C/D correctness gate of DESIGN.md section 5, plus the per-K ring check.

On one store, with a fixed seed and actions ``P + X`` / ``P + Y``:

- A: cold run of P+X (writes every chunk);
- B: P+X again: hits every chunk; every frame hash equals A's;
- C: P+Y: hits |P| chunks and computes the rest;
- D: P+Y cold on an empty cache (fresh trie, no ingest): every frame hash of C equals D's.

Ring check: for every resume depth K in 1..n-1, a session whose first K actions match A restores
depth K; its ring ``[:local_end]``, both cursors, cached latents and RNG state right after
``on_runtime_created`` equal a cold run's state before chunk K.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any

import attrs

from cacheseek.errors import ConfigError
from cacheseek.registry import WORKLOADS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AbcdSchema:
    _target_: str = "cacheseek.workloads.abcd.AbcdGate"
    total_chunks: int = 4
    prefix_chunks: int = 2
    ring_check: bool = True
    action_seed: int = 7
    action_dim: int = 4


@attrs.define
class RequestResult:
    name: str
    actions: str
    hit_depth: int
    chunks_computed: int
    wall_s: float
    bytes_restored: int
    bytes_written: int
    frame_hashes: list[str]
    verdict: str = ""
    expect: str = ""

    def row(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d.pop("frame_hashes")
        return d


def _actions(rng: random.Random, n: int, dim: int) -> list[list[float]]:
    return [[round(rng.uniform(-1, 1), 4) for _ in range(dim)] for _ in range(n)]


@WORKLOADS.register("abcd", AbcdSchema)
class AbcdGate:
    def __init__(self, total_chunks: int = 4, prefix_chunks: int = 2, ring_check: bool = True,
                 action_seed: int = 7, action_dim: int = 4) -> None:
        if total_chunks < 2:
            raise ConfigError("workload.total_chunks", f"must be >= 2, got {total_chunks}")
        if not 1 <= prefix_chunks < total_chunks:
            raise ConfigError("workload.prefix_chunks",
                              f"must be in [1, total_chunks), got {prefix_chunks} with total {total_chunks}")
        self.n = total_chunks
        self.p = prefix_chunks
        self.ring_check = ring_check
        rng = random.Random(action_seed)
        self.P = _actions(rng, prefix_chunks, action_dim)
        self.X = _actions(rng, total_chunks - prefix_chunks, action_dim)
        self.Y = _actions(rng, total_chunks - prefix_chunks, action_dim)
        self.Z = _actions(rng, total_chunks, action_dim)

    def _request(self, stack, name: str, actions, label: str, *, manager=None, ingest=True) -> RequestResult:
        binding = stack.new_binding(manager, ingest_enabled=ingest)
        rt = stack.runtime_factory.make(actions, hooks=binding)
        t0 = time.perf_counter()
        hashes = rt.generate()
        flush = getattr(stack.store, "flush", None)
        if flush is not None:
            flush()
        wall = time.perf_counter() - t0
        k = binding.last_fast_forward
        return RequestResult(name=name, actions=label, hit_depth=k, chunks_computed=self.n - k,
                             wall_s=wall, bytes_restored=binding.bytes_restored,
                             bytes_written=binding.bytes_written,
                             frame_hashes=[h if isinstance(h, str) else h.hex() for h in hashes])

    def run(self, stack) -> dict[str, Any]:
        n, p = self.n, self.p
        a = self._request(stack, "A", self.P + self.X, "P+X")
        b = self._request(stack, "B", self.P + self.X, "P+X")
        c = self._request(stack, "C", self.P + self.Y, "P+Y")
        fresh = stack.new_manager(forest=_fresh_forest())
        d = self._request(stack, "D", self.P + self.Y, "P+Y", manager=fresh, ingest=False)
        checks = [
            (a, a.hit_depth == 0, "cold (K=0)"),
            (b, b.hit_depth == n and b.frame_hashes == a.frame_hashes, f"K={n}, hashes == A"),
            (c, c.hit_depth == p and c.frame_hashes == d.frame_hashes, f"K={p}, hashes == D"),
            (d, d.hit_depth == 0 and d.frame_hashes[:p] == a.frame_hashes[:p], "cold reference"),
        ]
        for req, ok, expect in checks:
            req.verdict = "ok" if ok else "MISMATCH"
            req.expect = expect
        ring = self._ring_check(stack) if self.ring_check else []
        passed = all(ok for _, ok, _ in checks) and all(r["verdict"] == "ok" for r in ring)
        return {
            "workload": "abcd",
            "requests": [r.row() for r in (a, b, c, d)],
            "frame_hashes": {r.name: r.frame_hashes for r in (a, b, c, d)},
            "ring_check": ring,
            "passed": passed,
        }

    def _ring_check(self, stack) -> list[dict[str, Any]]:
        """Restore every depth K from the cache A filled and compare with a cold run before chunk K."""
        from cacheseek.runtime.snapshot import same_bytes, snapshot_diff

        actions = self.P + self.X
        cold = stack.runtime_factory.make(actions, hooks=None)
        states = []
        for k in range(self.n):
            cold.generate(stop_after=k)
            states.append(cold.state_snapshot())
        out = []
        for k in range(1, self.n):
            binding = stack.new_binding(ingest_enabled=False)
            rt = stack.runtime_factory.make(actions[:k] + self.Z[k:], hooks=binding)
            rt.generate(stop_after=0)  # runs on_runtime_created only
            diff = snapshot_diff(rt.state_snapshot(), states[k])
            for i in range(k):
                got = rt.world_kv_cached_latents.get(i)
                if got is None or not same_bytes(got, cold.latents[i]):
                    diff.append(f"cached latent {i} differs from the cold run's")
            ok = binding.last_fast_forward == k and not diff
            out.append({"K": k, "hit_depth": binding.last_fast_forward,
                        "verdict": "ok" if ok else "MISMATCH", "diff": diff})
        return out


def _fresh_forest():
    from cacheseek.reuse.exact_prefix import NamespaceForest

    return NamespaceForest()
