"""The ``stress`` workload: many sessions with shared prefixes, several at once, on a store far
smaller than what they write.

Sessions walk a tree of actions (`action_tree.ActionTree`): at every depth a session picks one
of ``branching`` actions (Zipf-skewed with exponent ``skew``, so some prefixes are hot), for
``depth`` chunks; ``images`` distinct start images give as many namespaces. ``sessions`` sessions run in a pool of
``threads`` threads that share one manager, forest and store, so restores, writes, evictions
and invalidations interleave.

Capacity: a store without its own capacity (memory/localdisk with ``capacity_bytes`` null) is
bounded to ``capacity_chunks`` chunks (KV plus latent) for the run; a store that has one (the
Plan tier's segment, or an explicit ``store.capacity_bytes``) keeps it.

Store-side losses: before each session, with probability ``lose_rate``, the store drops the values
of a random cached chunk behind the trie's back (its KV through ``free``, or its latent through
``free_skeleton``), as a store that evicts on its own or a restarted worker would: the manager
must notice on restore, invalidate, and restore the longest whole prefix.

Correctness, not just "no crash": every session's frame hashes are compared with a cold run of
the same action sequence on an empty cache (no binding). The run passes when every session
matches, none raised, and the store's peak usage stayed within its capacity. Results: one row
per session, the usage timeline and the figures under ``"stress"``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from cacheseek.errors import ConfigError
from cacheseek.eviction import store_usage
from cacheseek.codecs.quality import require_exact
from cacheseek.progress import bar
from cacheseek.registry import WORKLOADS
from cacheseek.workloads.action_tree import ActionTree, check_count

log = logging.getLogger(__name__)

__all__ = ["StressWorkload"]

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@WORKLOADS.register("stress")
class StressWorkload:
    def __init__(self, sessions: int = 32, depth: int = 5, branching: int = 3, skew: float = 1.0, images: int = 1,
                 threads: int = 3, capacity_chunks: Optional[int] = 8, seed: int = 11, action_dim: int = 4,
                 lose_rate: float = 0.0) -> None:
        check_count("threads", threads, 1)
        if capacity_chunks is not None:
            check_count("capacity_chunks", capacity_chunks, 1)
        if isinstance(lose_rate, bool) or not isinstance(lose_rate, (int, float)) or not 0 <= lose_rate <= 1:
            raise ConfigError("workload.lose_rate", f"must be a number in [0, 1], got {lose_rate!r}")
        self.lose_rate = float(lose_rate)
        self._loss_rng = random.Random(seed + 1)
        self.threads = threads
        self.capacity_chunks = capacity_chunks
        self.tree = ActionTree(sessions=sessions, depth=depth, branching=branching, skew=skew, images=images,
                               seed=seed, action_dim=action_dim)
        self.plan, self.images = self.tree.plan, self.tree.images

    @property
    def cache_chunks(self) -> int:
        """Chunks the run may keep at once: ``capacity_chunks``, else every distinct prefix of
        the plan (`cacheseek.sizing` fits ``auto`` store sizes to it)."""
        if self.capacity_chunks is not None:
            return self.capacity_chunks
        return self.tree.distinct_prefixes()

    @property
    def cache_chunks_why(self) -> str:
        return "workload.capacity_chunks" if self.capacity_chunks is not None else "every distinct prefix"

    @property
    def cache_chunk_depths(self) -> Optional[list[int]]:
        """The depth of each chunk in `cache_chunks`; None with ``capacity_chunks`` (unknown)."""
        return None if self.capacity_chunks is not None else self.tree.prefix_depths()

    def actions(self, path: tuple[int, ...]) -> list[list[float]]:
        return self.tree.actions(path)

    # -- run ------------------------------------------------------------------------------------
    def run(self, stack: Any, sessions: Optional[Sequence[int]] = None, *,
            on_ready: Optional[Callable[[], None]] = None,
            on_session: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
        """Run the plan's sessions (``sessions``: a chosen subset's indices; a worker of
        `tools/workers.py` runs its share this way) on the thread pool. The cold references come
        first, then ``on_ready()`` (the workers wait there for each other); ``on_session(row)``
        after each session (from the pool's threads, one at a time)."""
        require_exact(stack.store, "stress")
        factory = stack.runtime_factory
        capacity = self._bound_capacity(stack)
        chosen = self.tree.chosen(sessions)
        distinct = sorted({self.plan[i] for i in chosen})
        progress = bar(len(distinct) + len(chosen), "stress", unit="run")
        progress.set_postfix_str("cold references")
        t0 = time.perf_counter()
        reference = {}
        for key in distinct:
            reference[key] = factory.make(self.actions(key[1]), hooks=None, image=self.images[key[0]]).generate()
            progress.update()
        reference_s = time.perf_counter() - t0
        if on_ready is not None:
            on_ready()
        progress.set_postfix_str("sessions")

        manager = stack.new_manager()
        lock = threading.Lock()
        errors: list[str] = []

        lost = [0]

        def session(i: int) -> dict[str, Any]:
            with lock:
                lose = self._loss_rng.random() < self.lose_rate
                pick = self._loss_rng.random()
            if lose and self._lose_values(manager, pick):
                with lock:
                    lost[0] += 1
            image, path = self.plan[i]
            binding = stack.new_binding(manager)
            rt = factory.make(self.actions(path), hooks=binding, image=self.images[image])
            t = time.perf_counter()
            try:
                hashes = rt.generate()
            except Exception as exc:  # noqa: BLE001 - recorded, the run fails
                log.exception("session %d failed", i)
                with lock:
                    errors.append(f"session {i}: {type(exc).__name__}: {exc}")
                hashes = []
            ok = hashes == reference[(image, path)]
            k = binding.last_fast_forward
            row = {
                "name": f"s{i:02d}", "session": i, "actions": f"i{image}:" + ".".join(map(str, path)),
                "hit_depth": k, "chunks_computed": len(path) - k, "wall_s": time.perf_counter() - t,
                "bytes_restored": binding.bytes_restored, "bytes_written": binding.bytes_written,
                "dropped": binding.ingest_errors, "expect": "== cold", "verdict": "ok" if ok else "MISMATCH",
            }
            with lock:
                progress.update()
                if on_session is not None:
                    on_session(row)
            return row

        t1 = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="stress") as pool:
                rows = list(pool.map(session, chosen))
        finally:
            progress.close()
        stack.store.flush()
        sessions_s = time.perf_counter() - t1

        m = stack.metrics.as_dict(timeline=True)
        usage = store_usage(stack.store)
        peak = m["store_peak_bytes"] or 0
        within = capacity is None or peak <= capacity
        mismatches = sum(r["verdict"] != "ok" for r in rows)
        written = m["write_bytes"]
        passed = not errors and mismatches == 0 and within
        stress = {
            "sessions": len(rows), "threads": self.threads, "distinct_sequences": len(reference),
            "capacity_bytes": capacity, "high_watermark": manager.eviction.high_watermark,
            "low_watermark": manager.eviction.low_watermark, "policy": manager.eviction.policy,
            "peak_bytes": peak, "peak_within_capacity": within,
            "final_used_bytes": usage.used_bytes if usage else None,
            "bytes_written": written, "written_over_capacity": written / capacity if capacity else None,
            "mismatches": mismatches, "errors": errors, "dropped_writes": m["dropped_writes"],
            "values_lost": lost[0],
            "reference_seconds": reference_s, "sessions_seconds": sessions_s,
            "timeline": m.pop("timeline"),
        }
        summary = (
            f"stress: {len(rows)} sessions ({len(reference)} distinct) on {self.threads} threads: "
            f"{mismatches} hash mismatches, {len(errors)} errors; hit rate {m['hit_rate']:.0%}, "
            f"{m['evictions']} evictions, {m['invalidations']} invalidations ({lost[0]} losses), "
            f"{m['dropped_writes']} dropped writes; wrote {written} B, peak {peak} B of "
            f"{'unbounded' if capacity is None else f'{capacity} B'}")
        return {"workload": "stress", "requests": rows, "stress": stress, "summary": summary,
                "passed": passed}

    def _lose_values(self, manager: Any, pick: float) -> bool:
        """Drop the values of a random ready chunk in the store, not in the trie."""
        forest = manager.forest
        with forest.lock:
            ready = [n for ns in forest.namespaces() for n in ns.iter_nodes() if n.has_kv]
            if not ready:
                return False
            node = ready[int(pick * len(ready)) % len(ready)]
            blob, latent = node.blob, node.skeleton
        store = manager.store
        try:
            if pick < 0.5 or latent is None or not store.frees_latents:
                store.free(blob)
            else:
                store.free_skeleton(latent.latent_locator)
        except Exception as exc:  # noqa: BLE001 - an injected loss that did not happen
            log.info("stress: could not drop the values of %r: %s", node, exc)
            return False
        return True

    def _bound_capacity(self, stack: Any) -> Optional[int]:
        """The store's capacity; a settable, unbounded one is bounded to ``capacity_chunks``."""
        store = stack.store
        usage = store_usage(store)
        if usage is not None and usage.capacity_bytes is not None:
            return usage.capacity_bytes
        if self.capacity_chunks is None or not store.resizable:
            return None
        g = stack.runtime_factory.geometry
        item = _ITEMSIZE[stack.runtime_factory.dtype]
        chunk = g.chunk_kv_nbytes(item) + g.latent_nbytes(item)
        store.capacity_bytes = self.capacity_chunks * chunk
        log.info("stress: store %s bounded to %d chunks = %d B", stack.store_name,
                 self.capacity_chunks, store.capacity_bytes)
        return store.capacity_bytes

