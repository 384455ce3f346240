"""The A/B/C/D correctness gate (docs/design.md, "Correctness oracle"), plus the per-K ring check.

On one store, with a fixed seed and actions ``P + X`` / ``P + Y``:

- A: cold run of P+X (writes every chunk);
- B: P+X again: hits every chunk; every frame hash equals A's;
- C: P+Y: hits |P| chunks and computes the rest;
- D: P+Y cold on an empty cache (fresh trie, no ingest): every frame hash of C equals D's.

Ring check: for every resume depth K in 1..n-1, a session whose first K actions match A restores
depth K; its ring ``[:local_end]``, both cursors, cached latents and RNG state right after
``on_runtime_created`` equal a cold run's state before chunk K.

A warm store (a persistent root or a shared store whose chunk records a previous run left): A and C may
hit what that run wrote, so their depths are minimums (A: K>=0, C: K>=|P|, reported as ``warm``)
and A's frames are compared with a cold run of P+X on an empty cache (R, no ingest) instead of
being taken as the reference. B, D and the ring check are unchanged.

A lossy codec (``store.codec=int8|int4``, `cacheseek.codecs`) restores KV that differs from what
was computed. The gate then keeps every exact check that still holds (B == A: its frames come from
the exact latents; D[:P] == A: both cold) and replaces the rest with a quality verdict
(``frame_quality``): the PSNR of C's frames against the cold D's and the first chunk whose frames
differ, judged against ``min_psnr_db`` when one is set (null, the default: reported, not judged:
what PSNR is acceptable depends on the model and the use); the ring check compares cursors,
latents and RNG states exactly and reports the restored KV's PSNR. Results carry ``codec`` with
``lossy`` named.

Three verdicts, kept apart in the results (``verdicts``) and in the report: the hit depths (did
the cache serve what it should?), the frame hashes (is what it served, and what was computed,
bit-identical to a cold run?) and the ring check. A request that missed but computed the right
frames fails the first and passes the second; a depth the ring check never restored is
``not restored`` (nothing to compare), not a list of differences.
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any, Optional

import attrs
import torch

from cacheseek.codecs.quality import frame_quality, psnr_db, store_codec
from cacheseek.errors import ConfigError
from cacheseek.progress import bar
from cacheseek.registry import WORKLOADS
from cacheseek.workloads.action_tree import MAX_CHUNKS, check_count
from cacheseek.reuse.exact_prefix import NamespaceForest
from cacheseek.runtime.snapshot import same_bytes, snapshot_diff

log = logging.getLogger(__name__)


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
    frames_served: int = 0  # chunks handed out from stored frames (no denoise, no decode)
    chunks_materialized: int = 0  # chunks of KV restored into the ring where the session computed
    verdict: str = ""  # "ok" when both the depth and the frames are as expected, else "MISMATCH"
    expect: str = ""
    expect_k: int = -1  # the hit depth the gate expects (the least it accepts on a warm store)
    depth: str = ""  # "ok" or "MISS" (hit_depth != expect_k)
    frames: str = ""  # "ok" or "MISMATCH" (against `frames_vs`)
    frames_vs: str = ""

    def row(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d.pop("frame_hashes")
        return d


def _actions(rng: random.Random, n: int, dim: int) -> list[list[float]]:
    return [[round(rng.uniform(-1, 1), 4) for _ in range(dim)] for _ in range(n)]


@WORKLOADS.register("abcd")
class PrefixGate:
    def __init__(self, total_chunks: int = 4, prefix_chunks: int = 2, ring_check: bool = True,
                 action_seed: int = 7, action_dim: int = 4,
                 min_psnr_db: Optional[float] = None) -> None:
        if isinstance(total_chunks, int) and not isinstance(total_chunks, bool) and total_chunks < 2:
            raise ConfigError("workload.total_chunks", f"must be >= 2, got {total_chunks}",
                              "the gate needs a shared prefix and a fork: e.g. workload.total_chunks=4")
        check_count("total_chunks", total_chunks, 2, MAX_CHUNKS, "chunks")
        check_count("action_dim", action_dim, 1)
        if not 1 <= prefix_chunks < total_chunks:
            raise ConfigError("workload.prefix_chunks",
                              f"must be in [1, total_chunks), got {prefix_chunks} with total {total_chunks}",
                              f"e.g. workload.prefix_chunks={max(1, total_chunks // 2)}")
        self.n = total_chunks
        self.p = prefix_chunks
        self.ring_check = ring_check
        if min_psnr_db is not None and (isinstance(min_psnr_db, bool) or not isinstance(min_psnr_db, (int, float))):
            raise ConfigError("workload.min_psnr_db", f"must be a number of dB or null, got {min_psnr_db!r}",
                              "e.g. workload.min_psnr_db=30 (null: a lossy codec's PSNR is reported, not judged)")
        self.min_psnr_db = None if min_psnr_db is None else float(min_psnr_db)  # a lossy codec's frames
        rng = random.Random(action_seed)
        self.P = _actions(rng, prefix_chunks, action_dim)
        self.X = _actions(rng, total_chunks - prefix_chunks, action_dim)
        self.Y = _actions(rng, total_chunks - prefix_chunks, action_dim)
        self.Z = _actions(rng, total_chunks, action_dim)

    @property
    def cache_chunks(self) -> int:
        """Chunks the gate keeps cached at once: A writes n, C writes n - |P| (B hits, D and the
        ring check do not write). `cacheseek.sizing` fits ``auto`` store sizes to it."""
        return 2 * self.n - self.p

    @property
    def cache_chunks_why(self) -> str:
        return f"the gate: A writes {self.n}, C {self.n - self.p}"

    @property
    def cache_chunk_depths(self) -> list[int]:
        """The depth (chunk index) of each chunk in `cache_chunks`: A's 0..n-1, C's |P|..n-1."""
        return list(range(self.n)) + list(range(self.p, self.n))

    def _request(self, stack, name: str, actions, label: str, *, manager=None, ingest=True,
                 frames=None) -> RequestResult:
        binding, hashes, wall = stack.run_session(actions, manager=manager, ingest=ingest, frames=frames)
        k = binding.last_fast_forward
        return RequestResult(name=name, actions=label, hit_depth=k, chunks_computed=self.n - k,
                             wall_s=wall, bytes_restored=binding.bytes_restored, bytes_written=binding.bytes_written,
                             frames_served=binding.frames_served, chunks_materialized=binding.chunks_materialized,
                             frame_hashes=[h if isinstance(h, str) else h.hex() for h in hashes])

    def run(self, stack) -> dict[str, Any]:
        n, p = self.n, self.p
        if not stack.store.wait_ready(None):  # a background warm-up: the gate needs hits
            log.warning("the store's warm-up failed; the gate runs against a store that refuses writes")
        warm = _holds_kv(stack)
        codec = store_codec(stack.store)
        lossy = bool(codec["lossy"])
        frames: dict[str, list] = {"C": [], "D": []}
        steps = 4 + warm + (self.n if self.ring_check else 0)
        with bar(steps, "gate", unit="req") as progress:
            reqs = []
            plan = [("A", self.P + self.X, "P+X", {}), ("B", self.P + self.X, "P+X", {}),
                    ("C", self.P + self.Y, "P+Y", {}), ("D", self.P + self.Y, "P+Y", None)]
            if warm:
                plan.append(("R", self.P + self.X, "P+X", None))
            for name, actions, label, extra in plan:
                progress.set_postfix_str(f"{name} ({label})")
                if extra is None:  # D (and R): a fresh trie, no ingest: a cold reference
                    extra = {"manager": stack.new_manager(forest=NamespaceForest(), shared_index=False), "ingest": False}
                if lossy and name in frames:
                    extra = {**extra, "frames": frames[name]}
                reqs.append(self._request(stack, name, actions, label, **extra))
                progress.update()
            a, b, c, d = reqs[:4]
            checks = [  # (request, expected depth, frames equal?, what they are compared with)
                (a, 0, a.frame_hashes == reqs[-1].frame_hashes if warm else True, "== R" if warm else ""),
                (b, n, b.frame_hashes == a.frame_hashes, "== A"),
                (c, p, c.frame_hashes == d.frame_hashes, "== D") if not lossy else
                (c, p, self._quality_ok(quality := frame_quality(frames["C"], frames["D"])), "~ D (lossy)"),
                (d, 0, d.frame_hashes[:p] == a.frame_hashes[:p], "[:P] == A"),
            ]
            if warm:
                checks.append((reqs[-1], 0, True, ""))
            for req, want_k, frames_ok, vs in checks:
                at_least = warm and req in (a, c)  # a previous run's chunks may serve more
                req.expect_k = want_k
                req.depth = "ok" if req.hit_depth == want_k or (at_least and req.hit_depth >= want_k) else "MISS"
                req.frames = "ok" if frames_ok else "MISMATCH"
                req.frames_vs = vs
                req.verdict = "ok" if req.depth == "ok" and frames_ok else "MISMATCH"
                req.expect = (f"K>={want_k} (warm)" if at_least else f"K={want_k}") + (f", hashes {vs}" if vs else "")
            ring = self._ring_check(stack, progress, lossy) if self.ring_check else []
        verdicts = {
            "hit_depth": all(r.depth == "ok" for r in reqs),
            "frame_hashes": all(r.frames == "ok" for r in reqs if not (lossy and r is c)),
            "ring_check": all(r["verdict"] == "ok" for r in ring),
        }
        out_quality = None
        if lossy:
            verdicts["frame_quality"] = c.frames == "ok"
            out_quality = {**quality, "vs": "C against the cold D", "min_psnr_db_required": self.min_psnr_db}
        return {"workload": "abcd", "frame_quality": out_quality, "warm": warm, "requests": [r.row() for r in reqs],
                "frame_hashes": {r.name: r.frame_hashes for r in reqs}, "ring_check": ring, "verdicts": verdicts,
                "passed": all(verdicts.values())}

    def _quality_ok(self, quality: dict[str, Any]) -> bool:
        """Frames identical, or every chunk's PSNR at least ``min_psnr_db`` (None: reported only)."""
        worst = quality["min_psnr_db"]
        return worst is None or self.min_psnr_db is None or worst >= self.min_psnr_db

    def _ring_check(self, stack, progress: Any, lossy: bool) -> list[dict[str, Any]]:
        """Restore every depth K from the cache A filled and compare with a cold run before chunk K.
        A depth that was not restored (hit depth != K) is ``not restored``, with no diff. ``lossy``:
        the KV's bytes are not compared (their PSNR is reported, ``kv_psnr_db``), all else is."""
        actions = self.P + self.X
        progress.set_postfix_str("ring check: cold run")
        cold = stack.runtime_factory.make(actions, hooks=None)
        states = []
        for k in range(self.n):
            cold.generate(stop_after=k)
            states.append(cold.state_snapshot())
        progress.update()
        out = []
        for k in range(1, self.n):
            progress.set_postfix_str(f"ring check K={k}")
            binding = stack.new_binding(ingest_enabled=False)
            rt = stack.runtime_factory.make(actions[:k] + self.Z[k:], hooks=binding)
            rt.generate(stop_after=0)  # runs on_runtime_created only
            rt.materialize_restored()  # a session serving frames restores its prefix where it computes: now
            hit = binding.last_fast_forward
            if hit != k:
                out.append({"K": k, "hit_depth": hit, "verdict": "not restored", "diff": []})
            else:
                snap = rt.state_snapshot()
                diff = snapshot_diff(snap, states[k])
                for i in range(k):
                    got = rt.world_kv_cached_latents.get(i)
                    if got is None or not same_bytes(got, cold.latents[i]):
                        diff.append(f"cached latent {i} differs from the cold run's")
                row = {"K": k, "hit_depth": hit}
                if lossy:
                    diff = [d for d in diff if not _KV_DIFF.match(d)]
                    row["kv_psnr_db"] = _kv_psnr(snap, states[k])
                out.append({**row, "verdict": "MISMATCH" if diff else "ok", "diff": diff})
            progress.update()
        return out


_KV_DIFF = re.compile(r"layer \d+ [kv]\[")  # snapshot_diff's line for a ring's K or V bytes


def _kv_psnr(got: dict, ref: dict) -> Any:
    """PSNR of a restored ring's K and V against a cold run's (None: identical)."""
    a = [la[key].reshape(-1).float() for la in got["layers"] for key in ("k", "v")]
    b = [lb[key].reshape(-1).float() for lb in ref["layers"] for key in ("k", "v")]
    return psnr_db(torch.cat(a), torch.cat(b))


def _holds_kv(stack: Any) -> bool:
    """Whether the cache already holds committed chunks: the stack's forest names some, or the
    store's records do (a persistent root or a shared store a previous run wrote)."""
    forest = stack.forest
    with forest.lock:
        if any(n.has_kv for ns in forest.namespaces() for n in ns.iter_nodes()):
            return True
    return bool(stack.store.records.node_keys())
