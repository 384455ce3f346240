"""`CacheMetrics`: the one stats object of a cache (a manager, the bindings and the store report
into it); shown in the CLI report and written to ``results.json`` under ``"metrics"``.

Who records what:

- the manager: the shared index (``index_*``: probes of the store's chunk records, chunks adopted
  from them, records published; the store's own record counters and probe latency under
  ``records``), lookups and their outcome (miss, below break-even, hit of depth K, full or
  partial), a live session's chunks restored instead of computed (``live_lookups``, ``live_hits``
  by chunk index, ``live_misses``, ``live_restore_failures``; each live restore also counts in
  ``restores`` and ``restore_bytes``), restores (bytes, seconds, retries after invalidation, failures), writes (bytes and
  seconds from ``put_async`` to the store's completion callback), dropped writes (store full after
  eviction and one retry, or a write error), evictions and invalidations, and store usage after
  every write and eviction pass (``timeline``);
- the frames (`reuse.exact_prefix.frames`, `handout`): restored chunks handed out from stored
  frames (``frames_handed_out``, ``frames_read_bytes``; ``frames_missing``, ``frames_corrupt``:
  not handed out), frames stored off the request path (``frames_written``, ``frames_write_bytes``,
  ``frames_dropped``), and what a served prefix cost at divergence (``materializations``,
  ``chunks_materialized``, ``decoder_replays``, ``recomputed_chunks``);
- the bindings: their hooks' failures, the sessions run uncached because the store was still
  warming up (``sessions_bypassed_warming``), the chunks whose control had no key
  (``action_key_errors``) and the chunks not cached because no control was known for them or an
  earlier chunk (``chunks_unkeyed``: never keyed by a placeholder);
- the store, read when the metrics are rendered (`as_dict`): its current usage (``usage()``),
  failed and pending writes and its registration seconds (``stats``), where it offers them; a
  tiered store's levels under ``tiers`` (usage, capacity, blobs, hits, writes, promotions,
  demotions per tier; the manager counts its demotion passes and the room it makes for them here).

Thread-safe: every update holds one lock. Times come from the manager's clock.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import attrs

from cacheseek.eviction.base import store_usage

__all__ = ["CacheMetrics"]

TIMELINE_MAX = 20_000  # samples kept (the oldest half is thinned when full)


@attrs.define(eq=False)
class CacheMetrics:
    """Counters of one cache; see the module docstring. ``as_dict()`` is the rendered form."""

    lookups: int = 0
    misses: int = 0
    below_break_even: int = 0
    hits: int = 0
    full_hits: int = 0
    partial_hits: int = 0
    hits_by_depth: dict[int, int] = attrs.field(factory=dict)
    partial_hits_by_depth: dict[int, int] = attrs.field(factory=dict)
    live_lookups: int = 0  # a live session's chunk started on a cursor with children
    live_hits: int = 0  # ... and was restored instead of computed
    live_hits_by_chunk: dict[int, int] = attrs.field(factory=dict)
    live_misses: int = 0  # ... whose values were found gone (invalidated; the chunk computed)
    live_restore_failures: int = 0  # ... whose restore failed (the chunk computed)
    restores: int = 0
    restore_bytes: int = 0
    restore_seconds: float = 0.0
    restore_retries: int = 0
    restore_failures: int = 0
    index_probes: int = 0  # batched probes of the store's chunk records (the shared index)
    index_keys_probed: int = 0
    index_adopted: int = 0  # chunks found there (another process's, or a previous run's) and adopted
    index_published: int = 0  # records this manager published (its chunks made findable)
    index_recheck_misses: int = 0  # restores whose chunk's record went while they read: a miss
    index_claims: int = 0  # chunks a live session claimed before computing them (in flight, for others)
    index_waits: int = 0  # live chunks that waited for another process's claimed chunk
    index_wait_adopted: int = 0  # ... and were adopted from its record, not computed
    index_wait_seconds: float = 0.0
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    reingest_kept: int = 0
    dropped_writes: int = 0
    store_full_retries: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    eviction_passes: int = 0
    eviction_errors: int = 0
    demotions: int = 0
    demoted_bytes: int = 0
    demotion_passes: int = 0
    demotion_errors: int = 0
    evictions_for_demotion: int = 0  # victims moved out of a full tier to let a demotion in
    demotion_no_room: int = 0  # a full tier in which no room could be made (all protected)
    skeletons_freed: int = 0
    invalidations: int = 0
    hook_failures: int = 0
    sessions_bypassed_warming: int = 0  # sessions run as with no cache: the store was still warming
    action_key_errors: int = 0  # a later chunk's control had no key: the session ingested no further
    chunks_unkeyed: int = 0  # chunks not cached: their control (or an earlier chunk's) was never known
    frames_handed_out: int = 0  # restored chunks whose stored frames were handed out (not decoded)
    frames_read_bytes: int = 0
    frames_missing: int = 0  # ... whose frames were not in the store (the chunk decoded or computed)
    frames_corrupt: int = 0  # ... whose frames failed their checks (removed; never handed out)
    frames_written: int = 0  # computed chunks whose frames were stored (off the request path)
    frames_write_bytes: int = 0
    frames_dropped: int = 0  # ... not stored (queue or store full, a write error)
    materializations: int = 0  # sessions whose served prefix was restored into the ring to compute on
    chunks_materialized: int = 0  # ... chunks of KV restored then (a full hit restores none)
    decoder_replays: int = 0  # latents decoded again at divergence to rebuild the decoder's state
    recomputed_chunks: int = 0  # served chunks computed again: their KV was gone at divergence
    hook_failures_by_hook: dict[str, int] = attrs.field(factory=dict)
    peak_used_bytes: int = 0
    timeline: list[tuple[float, int, Optional[int], str]] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _store: Any = attrs.field(default=None, init=False, repr=False)
    _t0: Optional[float] = attrs.field(default=None, init=False, repr=False)
    _failure_kinds: set = attrs.field(factory=set, init=False, repr=False)

    # -- recording ------------------------------------------------------------------------------
    def bind_store(self, store: Any) -> None:
        """The store whose usage and stats `as_dict` reads (the last one bound wins)."""
        self._store = store

    def add(self, **deltas: Any) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def record_hit(self, depth: int, requested: int) -> None:
        with self._lock:
            self.hits += 1
            self.hits_by_depth[depth] = self.hits_by_depth.get(depth, 0) + 1
            if depth < requested:
                self.partial_hits += 1
                self.partial_hits_by_depth[depth] = self.partial_hits_by_depth.get(depth, 0) + 1
            else:
                self.full_hits += 1

    def record_live_hit(self, chunk: int) -> None:
        """Chunk ``chunk`` of a live session was restored instead of computed."""
        with self._lock:
            self.live_hits += 1
            self.live_hits_by_chunk[chunk] = self.live_hits_by_chunk.get(chunk, 0) + 1

    def record_hook_failure(self, hook: str, kind: str) -> bool:
        """A runtime hook of a binding raised ``kind`` (an exception type; the runtime then runs
        cold). True for the first failure of this hook and kind: the one worth a log line."""
        with self._lock:
            self.hook_failures += 1
            self.hook_failures_by_hook[hook] = self.hook_failures_by_hook.get(hook, 0) + 1
            first = (hook, kind) not in self._failure_kinds
            self._failure_kinds.add((hook, kind))
            return first

    def observe_usage(self, now: float, used: int, capacity: Optional[int], event: str) -> None:
        """A usage sample (after a write or an eviction pass); keeps the peak and the timeline."""
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            self.peak_used_bytes = max(self.peak_used_bytes, used)
            if len(self.timeline) >= TIMELINE_MAX:
                self.timeline = self.timeline[: TIMELINE_MAX // 2 : 2] + self.timeline[TIMELINE_MAX // 2 :]
            self.timeline.append((now - self._t0, used, capacity, event))

    # -- rendering ------------------------------------------------------------------------------
    def as_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """Every counter, the store's usage (``store_used_bytes``, ``store_capacity_bytes``,
        ``store_peak_bytes``), its failed and pending writes and registration seconds. With
        ``timeline``, the usage samples as ``[t_s, used, capacity, event]`` too."""
        with self._lock:
            out = {
                f.name: getattr(self, f.name)
                for f in attrs.fields(type(self))
                if not f.name.startswith("_") and f.name != "timeline"
            }
            out["hits_by_depth"] = dict(sorted(self.hits_by_depth.items()))
            out["partial_hits_by_depth"] = dict(sorted(self.partial_hits_by_depth.items()))
            out["live_hits_by_chunk"] = dict(sorted(self.live_hits_by_chunk.items()))
            out["hook_failures_by_hook"] = dict(sorted(self.hook_failures_by_hook.items()))
            samples = list(self.timeline) if timeline else None
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        store = self._store
        usage = store_usage(store) if store is not None else None
        out["store_used_bytes"] = usage.used_bytes if usage else None
        out["store_capacity_bytes"] = usage.capacity_bytes if usage else None
        peak = max(out["peak_used_bytes"], (usage.peak_bytes or 0) if usage else 0)
        out["store_peak_bytes"] = peak if usage else None
        stats = _store_stats(store)
        out["failed_writes"] = _first(stats, "failed_writes", "put_failures", default=0)
        out["pending_writes"] = _first(stats, "pending_writes", default=0)
        out["registration_seconds"] = _first(stats, "register_seconds", default=0.0)
        records = getattr(store, "records", None) if store is not None else None
        if records is not None and records.shared:
            out["records"] = records.stats.as_dict()
        if isinstance(stats.get("tiers"), list):  # a tiered store: capacity and traffic per tier
            out["tiers"] = [{k: v for k, v in row.items() if k != "store"} for row in stats["tiers"]]
        if samples is not None:
            out["timeline"] = [list(s) for s in samples]
        return out


def _store_stats(store: Any) -> dict[str, Any]:
    if store is None:
        return {}
    try:
        stats = getattr(store, "stats", None)
    except Exception:  # noqa: BLE001 - a closed store's stats are not worth a crash in a report
        return {}
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return stats
    as_dict = getattr(stats, "as_dict", None)
    return as_dict() if callable(as_dict) else {}


def _first(stats: dict[str, Any], *names: str, default: Any) -> Any:
    for name in names:
        if stats.get(name) is not None:
            return stats[name]
    return default
