"""Issue 34: the Grafana dashboard in the repository (tools/grafana/cacheseek.json) references only
metrics the code registers and a real run serves, and shows what an operator watches: hit rate by
tier, restore bandwidth against the link's peak, time to first frame restored vs computed, store
usage, evictions, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cacheseek.metrics_server import MetricsServer
from cacheseek.orchestrator import build_stack
from cacheseek.prometheus import FAMILIES, sample_names

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "cacheseek.json"
METRIC = re.compile(r"\bcacheseek_[a-z0-9_]+")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _referenced(dash: dict) -> set[str]:
    names = {m for _, e in _exprs(dash) for m in METRIC.findall(e)}
    for var in dash["templating"]["list"]:
        names |= set(METRIC.findall(json.dumps(var.get("query", ""))))
    return names


def test_the_dashboard_references_only_registered_metrics():
    dash = _dashboard()
    registered = {s for family in FAMILIES for s in sample_names(family)}
    referenced = _referenced(dash)
    assert referenced and referenced <= registered, sorted(referenced - registered)
    for title, expr in _exprs(dash):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), title
        for m in re.finditer(r"histogram_quantile\([^,]+, sum by \(([^)]*)\) \(rate\((cacheseek_[a-z0-9_]+)", expr):
            assert "le" in [x.strip() for x in m.group(1).split(",")] and m.group(2).endswith("_bucket"), title
        assert 'instance=~"$instance"' in expr or "vector(" in expr, title  # the worker filter everywhere
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dash["panels"])


def test_the_dashboard_shows_what_an_operator_watches():
    dash = _dashboard()
    by_title = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]}
    wanted = {
        "Hit rate by tier": ["cacheseek_hits_total", "sum by (tier)"],
        "Restore bandwidth against the link's peak": ["cacheseek_transfer_bytes_sum", "cacheseek_transfer_seconds_sum",
                                                      "$link_peak_gibps"],
        "Time to first frame: restored vs computed": ["cacheseek_session_first_frame_seconds_bucket"],
        "Store usage and capacity": ["cacheseek_store_used_bytes", "cacheseek_store_capacity_bytes"],
        "Chunks restored, written, evicted, invalidated": ["cacheseek_evicted_chunks_total"],
        "Errors": ["cacheseek_dropped_writes_total", "cacheseek_hook_failures_total"],
    }
    for title, needles in wanted.items():
        assert title in by_title, title
        for needle in needles:
            assert needle in by_title[title], (title, needle)
    assert any(v["name"] == "link_peak_gibps" for v in dash["templating"]["list"])


def test_a_real_run_serves_every_metric_the_dashboard_uses(compose_cfg, tmp_path, scrape):
    cfg = compose_cfg("workload=interactive", "workload.sessions=4", "runtime.local_attn_size=7", "runtime.sink_size=3")
    stack = build_stack(cfg, run_dir=tmp_path)
    with MetricsServer(stack.metrics, port=0) as server:
        try:
            assert stack.workload.run(stack)["passed"]
            served = scrape(server.url).families()
        finally:
            stack.close()
    missing = sorted(_referenced(_dashboard()) - served)
    assert not missing, missing
