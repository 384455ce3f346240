"""`CacheCollector`: a `CacheMetrics` rendered as Prometheus metric families, at scrape time.

The endpoint reads the same counters the CLI prints and ``results.json`` holds (one truth): a
scrape takes one consistent `CacheMetrics.snapshot` and renders

- every field declared with an export (`cacheseek.metric_fields`): counters, labelled counters
  and histograms, under the names they declare;
- families derived from those counters: ``cacheseek_hit_depth_chunks`` (a histogram of hit
  depths, by kind: a prefix hit of K chunks, a live hit of chunk i as depth i+1),
  ``cacheseek_restored_chunks_total`` (by kind) and ``cacheseek_written_chunks_total`` (by tier);
- what the store reports when scraped: ``cacheseek_store_used_bytes``,
  ``cacheseek_store_capacity_bytes`` (absent for an unbounded store),
  ``cacheseek_store_peak_bytes``, ``cacheseek_store_codec_info`` (each codec in use, lossy or not),
  ``cacheseek_store_chunks`` (per level of a tiered store),
  ``cacheseek_pending_writes``, ``cacheseek_failed_writes_total``,
  ``cacheseek_registration_seconds_total``, a tiered store's per-level writes, promotions and
  demotions, and its chunk records' probes (``cacheseek_index_probe_keys_total{result}``,
  ``cacheseek_index_probe_errors_total``, ``cacheseek_index_probe_seconds``).

`FAMILIES` names every family this module can serve (the dashboard test checks the dashboard
against it). A store that fails while read (closed, unreachable) leaves its gauges out of that
scrape; the counters are always served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cacheseek.codecs.quality import store_codec
from cacheseek.eviction.base import store_usage
from cacheseek.histogram import DEPTH_BUCKETS, Histogram
from cacheseek.metric_fields import Export, exports
from cacheseek.metrics import CacheMetrics, safe_read, store_stats

__all__ = ["CacheCollector", "FAMILIES", "sample_names"]

# The families computed here rather than declared on a field, with their type and help.
DERIVED: dict[str, tuple[str, str]] = {
    "cacheseek_hit_depth_chunks": ("histogram", "Chunks restored by one hit (its depth), by kind: a prefix hit "
                                   "of K chunks, a live hit of chunk i as depth i+1."),
    "cacheseek_restored_chunks_total": ("counter", "Chunks restored instead of computed, by kind."),
    "cacheseek_written_chunks_total": ("counter", "Chunks written to the store, by tier."),
    "cacheseek_store_used_bytes": ("gauge", "Bytes the store holds, by tier."),
    "cacheseek_store_capacity_bytes": ("gauge", "The store's capacity in bytes, by tier (absent: unbounded)."),
    "cacheseek_store_peak_bytes": ("gauge", "The most bytes the store held, by tier."),
    "cacheseek_store_codec_info": ("gauge", "1 for each KV codec the store encodes values with (store.codec), "
                                   "with lossy=\"true\" for a quantizing one: its restores are not bit-exact."),
    "cacheseek_store_chunks": ("gauge", "Chunks a level of a tiered store holds, by tier."),
    "cacheseek_pending_writes": ("gauge", "Writes the store has not completed yet."),
    "cacheseek_failed_writes_total": ("counter", "Writes the store failed (nothing of the chunk kept)."),
    "cacheseek_registration_seconds_total": ("counter", "Seconds the store spent registering memory."),
    "cacheseek_tier_writes_total": ("counter", "Chunk copies written to a level of a tiered store, by tier."),
    "cacheseek_tier_promotions_total": ("counter", "Paths promoted into a level of a tiered store, by tier."),
    "cacheseek_tier_demotions_total": ("counter", "Chunks demoted out of a level of a tiered store, by tier."),
    "cacheseek_index_probes_total": ("counter", "Batched probes of the store's chunk records (the shared index: "
                                     "lookups past the local trie and re-checks before a restore publishes)."),
    "cacheseek_index_probe_keys_total": ("counter", "Keys probed in the store's chunk records, by result "
                                         "(hit: a record found; miss: none)."),
    "cacheseek_index_probe_errors_total": ("counter", "Probes of the store's chunk records that failed."),
    "cacheseek_index_probe_seconds": ("histogram", "Latency of one batched probe of the store's chunk records."),
}


def _declared() -> dict[str, str]:
    out: dict[str, str] = {}
    for _, spec in exports(CacheMetrics):
        out.setdefault(spec.family, "histogram" if spec.kind == "histogram" else "counter")
    return out


FAMILIES: dict[str, str] = {**_declared(), **{name: kind for name, (kind, _) in DERIVED.items()}}


def sample_names(family: str) -> tuple[str, ...]:
    """The sample names a family exposes (``_bucket``/``_sum``/``_count`` of a histogram)."""
    kind = FAMILIES[family]
    if kind == "histogram":
        return tuple(f"{family}{s}" for s in ("_bucket", "_sum", "_count"))
    return (family,)


class CacheCollector:
    """A prometheus-client collector over one `CacheMetrics` (register it in a registry)."""

    def __init__(self, metrics: CacheMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # no describe at registration: collect reads the store

    def collect(self) -> Iterator[Metric]:
        m = self.metrics.snapshot()
        yield from _declared_families(m)
        yield from _derived_counters(m)
        yield from _store_families(m)


def _declared_families(m: CacheMetrics) -> Iterator[Metric]:
    grouped: dict[str, list[tuple[str, Export]]] = {}
    for name, spec in exports(CacheMetrics):
        grouped.setdefault(spec.family, []).append((name, spec))
    for family, fields in grouped.items():
        first = fields[0][1]
        help_text = next((s.help for _, s in fields if s.help), family)
        if first.kind == "histogram":
            fam = HistogramMetricFamily(family, help_text, labels=list(first.label_names))
            for name, _ in fields:
                for key, h in sorted(getattr(m, name).items()):
                    _add_histogram(fam, list(key), h)
            yield fam
            continue
        label_names = [k for k, _ in first.labels] or list(first.label_names)
        fam = CounterMetricFamily(family, help_text, labels=label_names)
        for name, spec in fields:
            value = getattr(m, name)
            if spec.kind == "labelled":
                for key, n in sorted(value.items()):
                    fam.add_metric(list(key), n)
            else:
                fam.add_metric([v for _, v in spec.labels], value)
        yield fam


def _add_histogram(fam: HistogramMetricFamily, labels: list[str], h: Histogram) -> None:
    fam.add_metric(labels, h.cumulative(), sum_value=h.sum)


def _derived_counters(m: CacheMetrics) -> Iterator[Metric]:
    depth = HistogramMetricFamily("cacheseek_hit_depth_chunks", DERIVED["cacheseek_hit_depth_chunks"][1],
                                  labels=["kind"])
    for kind, by_depth in (("prefix", m.hits_by_depth), ("live", {c + 1: n for c, n in m.live_hits_by_chunk.items()})):
        if by_depth:
            h = Histogram(DEPTH_BUCKETS)
            for d, n in by_depth.items():
                h.observe(d, n)
            _add_histogram(depth, [kind], h)
    yield depth
    restored = _counter("cacheseek_restored_chunks_total", ["kind"])
    restored.add_metric(["prefix"], sum(k * v for k, v in m.hits_by_depth.items()))
    restored.add_metric(["live"], m.live_hits)
    yield restored
    written = _counter("cacheseek_written_chunks_total", ["tier"])
    for (direction, tier), h in sorted(m.transfer_bytes.items()):
        if direction == "write":
            written.add_metric([tier], h.count)
    yield written


def _store_families(m: CacheMetrics) -> Iterator[Metric]:
    store = m.store
    if store is None:
        return
    stats = store_stats(store)
    used, cap, peak = (_gauge(n, ["tier"]) for n in ("cacheseek_store_used_bytes", "cacheseek_store_capacity_bytes",
                                                    "cacheseek_store_peak_bytes"))
    tiers = stats.get("tiers") if isinstance(stats.get("tiers"), list) else None
    if tiers is not None:
        chunks = _gauge("cacheseek_store_chunks", ["tier"])
        per_tier = {n: _counter(n, ["tier"]) for n in ("cacheseek_tier_writes_total",
                                                       "cacheseek_tier_promotions_total",
                                                       "cacheseek_tier_demotions_total")}
        for row in tiers:
            tier = str(row.get("name"))
            if row.get("used_bytes") is not None:
                used.add_metric([tier], row["used_bytes"])
            if row.get("capacity_bytes") is not None:
                cap.add_metric([tier], row["capacity_bytes"])
            chunks.add_metric([tier], row.get("blobs") or 0)
            for name, fam in per_tier.items():
                fam.add_metric([tier], row.get(name.split("_")[2], 0) or 0)
        yield chunks
        yield from per_tier.values()
    else:
        usage = safe_read(lambda: store_usage(store))
        if usage is not None:
            used.add_metric([m.store_label], usage.used_bytes)
            if usage.capacity_bytes is not None:
                cap.add_metric([m.store_label], usage.capacity_bytes)
            peak.add_metric([m.store_label], max(m.peak_used_bytes, usage.peak_bytes or 0))
    yield from (used, cap, peak)
    codec = store_codec(store)
    info = _gauge("cacheseek_store_codec_info", ["codec", "lossy"])
    for name in codec["names"]:
        info.add_metric([name, str(name in codec["lossy"]).lower()], 1)
    yield info
    yield _one(_gauge, "cacheseek_pending_writes", stats.get("pending_writes") or 0)
    yield _one(_counter, "cacheseek_failed_writes_total", stats.get("failed_writes") or stats.get("put_failures") or 0)
    yield _one(_counter, "cacheseek_registration_seconds_total", stats.get("register_seconds") or 0.0)
    yield from _record_families(store)


def _record_families(store: Any) -> Iterator[Metric]:
    if not store.records.shared:
        return
    s = store.records.stats_snapshot()
    yield _one(_counter, "cacheseek_index_probes_total", s.probes)
    keys = _counter("cacheseek_index_probe_keys_total", ["result"])
    keys.add_metric(["hit"], s.found)
    keys.add_metric(["miss"], s.probe_keys - s.found)
    yield keys
    yield _one(_counter, "cacheseek_index_probe_errors_total", s.probe_errors)
    lat = HistogramMetricFamily("cacheseek_index_probe_seconds", DERIVED["cacheseek_index_probe_seconds"][1], labels=[])
    _add_histogram(lat, [], s.probe_latency)
    yield lat


def _counter(name: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(name, DERIVED[name][1], labels=labels)


def _gauge(name: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, DERIVED[name][1], labels=labels)


def _one(family: Any, name: str, value: float) -> Metric:
    """A family without labels (``family``: `_counter` or `_gauge`) holding one ``value``."""
    fam = family(name, [])
    fam.add_metric([], value)
    return fam
