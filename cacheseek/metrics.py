"""`CacheMetrics`: the one stats object of a cache (a manager, the bindings and the store report
into it). The same counters are printed by the CLI (`cacheseek.report`), written to
``results.json`` under ``"metrics"`` (`as_dict`) and served on the Prometheus endpoint
(`cacheseek.prometheus`, ``metrics.port=``): one truth.

Each counter is one field, declared with what it is on the endpoint (`cacheseek.metric_fields`:
adding a counter is one line here). Who records what:

- the manager: lookups (``kind`` ``prefix``: a session's planned chunks at its creation;
  ``live``: one chunk of a live session as it starts) and their outcome (a hit of depth K, from a
  tier; a miss, below break-even, values found gone, a failed restore), restores and writes
  (bytes and seconds, per tier, as histograms: `record_transfer`), the shared index (``index_*``:
  probes of the store's chunk records, chunks adopted from them, records published, claims and
  waits; the store's own record counters and probe latency under ``records``), dropped writes
  (store full after eviction and one retry, or a write error), evictions, demotions and
  invalidations, and store usage after every write and eviction pass (``timeline``);
- the frames (`reuse.exact_prefix.frames`, `handout`): restored chunks handed out from stored
  frames (``frames_handed_out``, ``frames_read_bytes``; ``frames_missing``, ``frames_corrupt``:
  not handed out), frames stored with computed chunks (``frames_written``, ``frames_write_bytes``,
  ``frames_dropped``), and what a served prefix cost at divergence (``materializations``,
  ``chunks_materialized``, ``decoder_replays``, ``recomputed_chunks``), decoder states stored at
  resume points (``decoder_states_written``, ``decoder_state_write_bytes``, ``decoder_states_dropped``)
  and loaded at divergence (``decoder_states_restored``, ``decoder_state_read_bytes``;
  ``decoder_states_missing``, ``decoder_states_corrupt``: rebuilt instead);
- the stored encodes (`reuse.exact_prefix.encodes`): a session's prompt and condition encodes
  loaded from the store (``encodes_loaded``), looked for and absent (``encodes_missing``), failing
  their checks (``encodes_corrupt``, removed), stored (``encodes_written``) or not (``encodes_dropped``);
- the bindings: their hooks' failures (by hook and exception type), the sessions run uncached
  because the store was still warming up (``sessions_bypassed_warming``), the chunks whose
  control had no key (``action_key_errors``) and the chunks not cached because no control was
  known for them or an earlier chunk (``chunks_unkeyed``);
- whoever drives sessions (the live-session workload): each session's time to first frame and
  each chunk's wall, restored or computed (`observe_first_frame`, `observe_chunk`);
- the store, read when the metrics are rendered: its usage and capacity (per level of a tiered
  store), failed and pending writes, registration seconds, its chunk records' probe counters.

A live restore is a lookup and a hit like a prefix restore: ``lookups``, ``hits`` and
``hit_rate`` count both kinds; ``live_*`` and ``prefix_lookups`` are the parts.

Thread-safe: every update holds one lock (a dict lookup and an addition or a histogram bucket:
microseconds, nothing allocated but a new label key's first entry). Times come from the caller.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import attrs

from cacheseek.eviction.base import store_usage
from cacheseek.histogram import BYTES_BUCKETS, SECONDS_BUCKETS, Histogram
from cacheseek.metric_fields import counter, exports, histogram, labelled

__all__ = ["CacheMetrics", "safe_read", "store_stats"]

TIMELINE_MAX = 20_000  # samples kept (the oldest half is thinned when full)
MAX_ERROR_KINDS = 32  # distinct (hook, exception type) labels; later kinds count as error="other"


@attrs.define(eq=False)
class CacheMetrics:
    """Counters of one cache; see the module docstring. ``as_dict()`` is the rendered form."""

    prefix_lookups: int = counter("cacheseek_lookups_total", "Lookups, by kind: prefix (a session's planned "
                                  "chunks at its creation) or live (one chunk of a live session).", kind="prefix")
    live_lookups: int = counter("cacheseek_lookups_total", "", kind="live")
    hits_by_kind_tier: dict = labelled("cacheseek_hits_total", "Lookups served from the cache, by kind and by the "
                                       "tier that served them.", "kind", "tier")
    misses: int = counter("cacheseek_lookup_misses_total", "Lookups not served, by kind and reason.",
                          kind="prefix", reason="not_cached")
    below_break_even: int = counter("cacheseek_lookup_misses_total", "", kind="prefix", reason="below_break_even")
    live_not_cached: int = counter("cacheseek_lookup_misses_total", "", kind="live", reason="not_cached")
    live_misses: int = counter("cacheseek_lookup_misses_total", "", kind="live", reason="values_gone")
    restore_failures: int = counter("cacheseek_restore_failures_total", "Restores that failed (the chunks were "
                                    "computed), by kind.", kind="prefix")
    live_restore_failures: int = counter("cacheseek_restore_failures_total", "", kind="live")
    restore_retries: int = counter("cacheseek_restore_retries_total", "Prefix restores retried shorter after "
                                   "values were found gone.")
    full_hits: int = 0
    partial_hits: int = 0
    hits_by_depth: dict[int, int] = attrs.field(factory=dict)
    partial_hits_by_depth: dict[int, int] = attrs.field(factory=dict)
    live_hits_by_chunk: dict[int, int] = attrs.field(factory=dict)
    transfer_bytes: dict = histogram("cacheseek_transfer_bytes", "Bytes of one restore (store to runtime) or "
                                     "one chunk's write (runtime to store), by direction and tier.",
                                     BYTES_BUCKETS, "direction", "tier")
    transfer_seconds: dict = histogram("cacheseek_transfer_seconds", "Seconds of one restore (fetch to "
                                       "publication) or write (put to the store's completion), by direction "
                                       "and tier.", SECONDS_BUCKETS, "direction", "tier")
    index_probes: int = 0  # the lookups' probes (the endpoint serves the records' own count, re-checks included)
    index_keys_probed: int = 0
    index_adopted: int = counter("cacheseek_index_adopted_chunks_total", "Chunks found in the store's records "
                                 "(another process's, or an earlier run's) and adopted.")
    index_published: int = counter("cacheseek_index_published_records_total", "Chunk records this process "
                                   "published (its chunks made findable).")
    index_recheck_misses: int = counter("cacheseek_index_recheck_misses_total", "Restores whose chunk record "
                                        "went while they read: a miss.")
    index_claims: int = counter("cacheseek_index_claims_total", "Chunks a live session claimed before "
                                "computing them.")
    index_waits: int = counter("cacheseek_index_waits_total", "Live chunks that waited for another process's "
                               "claimed chunk.")
    index_wait_adopted: int = counter("cacheseek_index_wait_adopted_chunks_total", "... and were adopted from "
                                      "its record, not computed.")
    index_wait_seconds: float = counter("cacheseek_index_wait_seconds_total", "Seconds live chunks waited for "
                                        "other processes' claimed chunks.", default=0.0)
    reingest_kept: int = counter("cacheseek_reingest_kept_chunks_total", "Chunk writes skipped: the chunk was "
                                 "already cached.")
    dropped_writes: int = counter("cacheseek_dropped_writes_total", "Chunk writes dropped (store full after "
                                  "eviction and one retry, or a write error).")
    store_full_retries: int = counter("cacheseek_store_full_retries_total", "Writes retried after an "
                                      "eviction pass made room.")
    evictions: int = counter("cacheseek_evicted_chunks_total", "Chunks whose KV values were evicted.")
    evicted_bytes: int = counter("cacheseek_evicted_bytes_total", "Bytes of evicted KV values.")
    eviction_passes: int = counter("cacheseek_eviction_passes_total", "Eviction passes run.")
    eviction_errors: int = counter("cacheseek_eviction_errors_total", "Evictions that failed (the value kept).")
    demotions: int = counter("cacheseek_demoted_chunks_total", "Chunks moved down a tier of a tiered store.")
    demoted_bytes: int = counter("cacheseek_demoted_bytes_total", "Bytes moved down a tier.")
    demotion_passes: int = counter("cacheseek_demotion_passes_total", "Demotion passes run.")
    demotion_errors: int = counter("cacheseek_demotion_errors_total", "Demotions that failed.")
    evictions_for_demotion: int = counter("cacheseek_evictions_for_demotion_total", "Victims moved out of a "
                                          "full tier to let a demotion in.")
    demotion_no_room: int = counter("cacheseek_demotion_no_room_total", "Demotions that found no room below.")
    skeletons_freed: int = counter("cacheseek_freed_latents_total", "Latents of dead subtrees freed.")
    invalidations: int = counter("cacheseek_invalidated_chunks_total", "Chunks dropped because the store lost "
                                 "their values.")
    frames_handed_out: int = counter("cacheseek_frames_handed_out_total", "Restored chunks whose stored frames "
                                     "were handed out (not decoded).")
    frames_read_bytes: int = counter("cacheseek_frames_read_bytes_total", "Bytes of stored frames handed out.")
    frames_missing: int = counter("cacheseek_frames_missing_total", "Restored chunks whose frames were not in the "
                                  "store (the chunk decoded or computed).")
    frames_corrupt: int = counter("cacheseek_frames_corrupt_total", "Stored frames that failed their checks "
                                  "(removed, never handed out).")
    frames_written: int = counter("cacheseek_frames_written_total", "Computed chunks whose frames were stored.")
    frames_write_bytes: int = counter("cacheseek_frames_write_bytes_total", "Bytes of frames stored.")
    frames_dropped: int = counter("cacheseek_frames_dropped_total", "Computed chunks whose frames were not "
                                  "stored (store full, a write error, the writer busy).")
    materializations: int = counter("cacheseek_materializations_total", "Sessions whose served prefix was "
                                    "restored into the ring to compute on.")
    chunks_materialized: int = counter("cacheseek_materialized_chunks_total", "Chunks of KV restored at a "
                                       "served session's divergence (a full hit restores none).")
    decoder_replays: int = counter("cacheseek_decoder_replays_total", "Latents decoded again at divergence to "
                                   "rebuild the decoder's state.")
    decoder_states_written: int = counter("cacheseek_decoder_states_written_total", "Decoder states stored "
                                          "after a computed chunk at a resume point (decoder_state_every).")
    decoder_state_write_bytes: int = counter("cacheseek_decoder_state_write_bytes_total", "Bytes of decoder states stored.")
    decoder_states_dropped: int = counter("cacheseek_decoder_states_dropped_total", "Decoder states not stored "
                                          "(store full, a write error, the writer busy).")
    decoder_states_restored: int = counter("cacheseek_decoder_states_restored_total", "Decoder states loaded at "
                                           "divergence (the chunks before them not decoded again).")
    decoder_state_read_bytes: int = counter("cacheseek_decoder_state_read_bytes_total", "Bytes of decoder states loaded.")
    decoder_states_missing: int = counter("cacheseek_decoder_states_missing_total", "Decoder states looked for "
                                          "at divergence and not found (the decoder rebuilt instead).")
    decoder_states_corrupt: int = counter("cacheseek_decoder_states_corrupt_total", "Stored decoder states that "
                                          "failed their checks (removed, never loaded).")
    encodes_loaded: int = counter("cacheseek_encodes_loaded_total", "Session encodes (prompt, condition) "
                                  "loaded from the store instead of run.")
    encodes_missing: int = counter("cacheseek_encodes_missing_total", "Session encodes looked for in the store "
                                   "and not found (run instead).")
    encodes_corrupt: int = counter("cacheseek_encodes_corrupt_total", "Stored session encodes that failed their "
                                   "checks (removed, run instead).")
    encodes_written: int = counter("cacheseek_encodes_written_total", "Session encodes stored.")
    encodes_dropped: int = counter("cacheseek_encodes_dropped_total", "Session encodes not stored (store full, "
                                   "a write error).")
    recomputed_chunks: int = counter("cacheseek_recomputed_chunks_total", "Served chunks computed again: their "
                                     "KV was gone at divergence.")
    hook_failures_by_error: dict = labelled("cacheseek_hook_failures_total", "Runtime hooks of a binding that "
                                            "raised (the runtime ran cold), by hook and exception type.",
                                            "hook", "error")
    sessions_bypassed_warming: int = counter("cacheseek_sessions_bypassed_warming_total", "Sessions run "
                                             "uncached: the store was still warming up.")
    action_key_errors: int = counter("cacheseek_action_key_errors_total", "Chunks whose control had no key (the "
                                     "session ingested no further).")
    chunks_unkeyed: int = counter("cacheseek_unkeyed_chunks_total", "Chunks not cached: no control was known "
                                  "for them or an earlier chunk.")
    first_frame_seconds: dict = histogram("cacheseek_session_first_frame_seconds", "A live session's time to "
                                          "its first frame (creation and chunk 0), by whether chunk 0 was "
                                          "restored or computed.", SECONDS_BUCKETS, "start")
    chunk_seconds: dict = histogram("cacheseek_chunk_seconds", "Wall of one chunk of a live session after "
                                    "chunk 0, restored or computed.", SECONDS_BUCKETS, "source")
    peak_used_bytes: int = 0
    timeline: list[tuple[float, int, Optional[int], str]] = attrs.field(factory=list)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _store: Any = attrs.field(default=None, init=False, repr=False)
    _store_label: str = attrs.field(default="none", init=False, repr=False)
    _t0: Optional[float] = attrs.field(default=None, init=False, repr=False)

    # -- recording ------------------------------------------------------------------------------
    def bind_store(self, store: Any) -> None:
        """The store whose usage and stats `as_dict` and the endpoint read (the last one bound wins)."""
        self._store, self._store_label = store, store.label if store is not None else "none"
        tiers = [self._store_label]
        if store is not None:  # a tiered store: its levels
            tiers = [u.name for u in safe_read(store.tier_usages) or ()] or tiers
        with self._lock:  # every (kind, tier) served from the start, at 0
            for key in ((kind, tier) for kind in ("prefix", "live") for tier in tiers):
                self.hits_by_kind_tier.setdefault(key, 0)
            for key in [("restore", tier) for tier in tiers] + [("write", self._store_label)]:
                self.transfer_bytes.setdefault(key, Histogram(BYTES_BUCKETS))
                self.transfer_seconds.setdefault(key, Histogram(SECONDS_BUCKETS))

    @property
    def store(self) -> Any:
        return self._store

    @property
    def store_label(self) -> str:
        """The bound store's tier label (its registry name: ``memory``, ``localdisk``, ...)."""
        return self._store_label

    def add(self, **deltas: Any) -> None:
        """Add to scalar counters by field name (``add(dropped_writes=1)``)."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def record_hit(self, depth: int, requested: int, tier: Optional[str] = None) -> None:
        """A prefix lookup restored ``depth`` of ``requested`` chunks from ``tier``."""
        key = ("prefix", tier or self._store_label)
        with self._lock:
            self.hits_by_kind_tier[key] = self.hits_by_kind_tier.get(key, 0) + 1
            self.hits_by_depth[depth] = self.hits_by_depth.get(depth, 0) + 1
            if depth < requested:
                self.partial_hits += 1
                self.partial_hits_by_depth[depth] = self.partial_hits_by_depth.get(depth, 0) + 1
            else:
                self.full_hits += 1

    def record_live_hit(self, chunk: int, tier: Optional[str] = None) -> None:
        """Chunk ``chunk`` of a live session was restored (from ``tier``) instead of computed."""
        key = ("live", tier or self._store_label)
        with self._lock:
            self.hits_by_kind_tier[key] = self.hits_by_kind_tier.get(key, 0) + 1
            self.live_hits_by_chunk[chunk] = self.live_hits_by_chunk.get(chunk, 0) + 1

    def record_transfer(self, direction: str, tier: Optional[str], nbytes: int, seconds: float) -> None:
        """One restore (``direction="restore"``) or chunk write (``"write"``) of ``nbytes`` bytes
        in ``seconds`` on ``tier`` (default: the bound store's label)."""
        key = (direction, tier or self._store_label)
        with self._lock:
            self._observe(self.transfer_bytes, key, BYTES_BUCKETS, nbytes)
            self._observe(self.transfer_seconds, key, SECONDS_BUCKETS, seconds)

    def observe_first_frame(self, seconds: float, *, restored: bool) -> None:
        """A live session's time to first frame; ``restored``: its chunk 0 was restored."""
        with self._lock:
            self._observe(self.first_frame_seconds, ("restored" if restored else "computed",), SECONDS_BUCKETS, seconds)

    def observe_chunk(self, seconds: float, *, restored: bool) -> None:
        """One chunk's wall (after chunk 0) of a live session, restored or computed."""
        with self._lock:
            self._observe(self.chunk_seconds, ("restored" if restored else "computed",), SECONDS_BUCKETS, seconds)

    @staticmethod
    def _observe(hists: dict, key: tuple, bounds: tuple[float, ...], value: float) -> None:
        h = hists.get(key)
        if h is None:
            h = hists[key] = Histogram(bounds)
        h.observe(value)

    def record_hook_failure(self, hook: str, kind: str) -> bool:
        """A runtime hook of a binding raised ``kind`` (an exception type; the runtime then runs
        cold). True for the first failure of this hook and kind: the one worth a log line."""
        with self._lock:
            key = (hook, kind)
            first = key not in self.hook_failures_by_error
            if first and len(self.hook_failures_by_error) >= MAX_ERROR_KINDS:
                key = (hook, "other")
            self.hook_failures_by_error[key] = self.hook_failures_by_error.get(key, 0) + 1
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

    # -- derived totals (read by callers and tests as attributes) --------------------------------
    def _hits(self, kind: Optional[str] = None) -> int:
        return sum(v for (k, _), v in self.hits_by_kind_tier.items() if kind is None or k == kind)

    def _transfer(self, direction: str, what: str) -> Any:
        hists = self.transfer_seconds if what == "seconds" else self.transfer_bytes
        total = sum(getattr(h, "count" if what == "count" else "sum")
                    for (d, _), h in hists.items() if d == direction)
        return int(total) if what == "bytes" else total

    lookups = property(lambda self: self.prefix_lookups + self.live_lookups)
    hits = property(lambda self: self._hits())
    live_hits = property(lambda self: self._hits("live"))
    hook_failures = property(lambda self: sum(self.hook_failures_by_error.values()))
    restores = property(lambda self: self._transfer("restore", "count"))
    restore_bytes = property(lambda self: self._transfer("restore", "bytes"))
    restore_seconds = property(lambda self: float(self._transfer("restore", "seconds")))
    writes = property(lambda self: self._transfer("write", "count"))
    write_bytes = property(lambda self: self._transfer("write", "bytes"))
    write_seconds = property(lambda self: float(self._transfer("write", "seconds")))

    # -- rendering ------------------------------------------------------------------------------
    def snapshot(self, *, timeline: bool = False) -> "CacheMetrics":
        """A consistent copy of every counter (taken under the lock), with the store bound: what a
        scrape and `as_dict` render, so that one rendering never mixes two moments. The usage
        ``timeline`` is copied only when asked for (a scrape does not serve it)."""
        with self._lock:
            copy = CacheMetrics.__new__(CacheMetrics)
            for f in attrs.fields(CacheMetrics):
                value = getattr(self, f.name)
                if f.name == "_lock":
                    value = threading.Lock()
                elif f.name == "timeline" and not timeline:
                    value = []
                elif isinstance(value, dict):
                    value = {k: (v.copy() if isinstance(v, Histogram) else v) for k, v in value.items()}
                elif isinstance(value, list):
                    value = list(value)
                object.__setattr__(copy, f.name, value)
        return copy

    def as_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """Every counter, the derived totals, the histograms, the store's usage
        (``store_used_bytes``, ``store_capacity_bytes``, ``store_peak_bytes``), its failed and
        pending writes and registration seconds. With ``timeline``, the usage samples as
        ``[t_s, used, capacity, event]`` too."""
        m = self.snapshot(timeline=timeline)
        out: dict[str, Any] = {}
        for f in attrs.fields(CacheMetrics):
            if f.name.startswith("_") or f.name == "timeline" or isinstance(getattr(m, f.name), dict):
                continue
            out[f.name] = getattr(m, f.name)
        for name in ("lookups", "hits", "live_hits", "hook_failures", "restores", "restore_bytes",
                     "restore_seconds", "writes", "write_bytes", "write_seconds"):
            out[name] = getattr(m, name)
        out["hits_by_depth"] = dict(sorted(m.hits_by_depth.items()))
        out["partial_hits_by_depth"] = dict(sorted(m.partial_hits_by_depth.items()))
        out["live_hits_by_chunk"] = dict(sorted(m.live_hits_by_chunk.items()))
        out["chunks_restored"] = sum(k * v for k, v in m.hits_by_depth.items()) + out["live_hits"]
        out["hits_by_tier"] = _sum_by(m.hits_by_kind_tier, 1)
        out["hook_failures_by_hook"] = _sum_by(m.hook_failures_by_error, 0)
        out["hook_failures_by_error"] = {f"{h}:{e}": n for (h, e), n in sorted(m.hook_failures_by_error.items())}
        out["histograms"] = {
            spec.family: [{"labels": dict(zip(spec.label_names, key)), **h.as_dict()}
                          for key, h in sorted(getattr(m, name).items())]
            for name, spec in exports(CacheMetrics) if spec.kind == "histogram"}
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        store = m._store
        usage = safe_read(lambda: store_usage(store)) if store is not None else None
        out["store"] = m._store_label
        out["store_used_bytes"] = usage.used_bytes if usage else None
        out["store_capacity_bytes"] = usage.capacity_bytes if usage else None
        peak = max(out["peak_used_bytes"], (usage.peak_bytes or 0) if usage else 0)
        out["store_peak_bytes"] = peak if usage else None
        stats = store_stats(store)
        out["failed_writes"] = _first(stats, "failed_writes", "put_failures", default=0)
        out["pending_writes"] = _first(stats, "pending_writes", default=0)
        out["registration_seconds"] = _first(stats, "register_seconds", default=0.0)
        if store is not None and store.records.shared:
            out["records"] = store.records.stats.as_dict()
        if isinstance(stats.get("tiers"), list):  # a tiered store: capacity and traffic per tier
            out["tiers"] = [{k: v for k, v in row.items() if k != "store"} for row in stats["tiers"]]
        if timeline:
            out["timeline"] = [list(s) for s in m.timeline]
        return out


def _sum_by(counts: dict, part: int) -> dict[str, int]:
    """``{(a, b): n}`` summed by ``key[part]`` (``(kind, tier)`` by tier, ``(hook, error)`` by hook)."""
    out: dict[str, int] = {}
    for key, n in counts.items():
        out[key[part]] = out.get(key[part], 0) + n
    return dict(sorted(out.items()))


def safe_read(read: Any) -> Any:
    """``read()``, or None when it raises (a closed or unreachable store)."""
    try:
        return read()
    except Exception:  # noqa: BLE001 - a closed store's usage is not worth a crash in a report or a scrape
        return None


def store_stats(store: Any) -> dict[str, Any]:
    """The store's ``stats`` as a dict (``{}`` when it has none, or cannot say: closed)."""
    if store is None:
        return {}
    try:
        stats = store.stats
        if stats is None:
            return {}
        return stats if isinstance(stats, dict) else stats.as_dict()
    except Exception:  # noqa: BLE001 - a closed store's stats are not worth a crash in a report
        return {}


def _first(stats: dict[str, Any], *names: str, default: Any) -> Any:
    for name in names:
        if stats.get(name) is not None:
            return stats[name]
    return default

