"""Issue 34: the Prometheus endpoint serves the run's own counters (one truth with the printed
block and results.json), scraped over loopback HTTP while the run goes on.

- live sessions (``workload=interactive``): after every session, the endpoint's live hits equal
  the chunks the sessions restored so far, lookups the chunks run, restore bytes the restored
  chunks' KV sizes, written chunks the chunks written; at the end every counter equals
  results.json's and the printed block's;
- the CLI serves ``metrics.port=0`` on loopback, prints the port, keeps serving ``metrics.hold_s``
  after its report and stops on SIGTERM;
- a port in use and a non-loopback host are one clear error; every declared family is served.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cacheseek.errors import ConfigError
from cacheseek.metric_fields import exports
from cacheseek.metrics import CacheMetrics
from cacheseek.metrics_server import MetricsConfig, MetricsServer
from cacheseek.orchestrator import build_stack
from cacheseek.prometheus import FAMILIES
from cacheseek.report import metrics_block

REPO = Path(__file__).resolve().parents[2]
RING = ["runtime.local_attn_size=7", "runtime.sink_size=3"]


def chunk_kv_bytes(stack) -> int:
    """One chunk's KV in bytes from the runtime's geometry (K and V of every layer, bf16)."""
    g = stack.runtime_factory.geometry
    return 2 * g.n_layers * g.chunk_tokens * g.n_heads * g.head_dim * 2


@pytest.mark.parametrize("store", ["memory", "localdisk"])
def test_the_endpoint_counts_what_live_sessions_did_while_they_run(compose_cfg, tmp_path, scrape, store):
    extra = [f"store.root={tmp_path / 'kv'}"] if store == "localdisk" else []
    cfg = compose_cfg("workload=interactive", f"+store={store}", *extra, *RING)
    stack = build_stack(cfg, run_dir=tmp_path)
    seen: list[dict] = []
    with MetricsServer(stack.metrics, port=0) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        kv = chunk_kv_bytes(stack)

        def after_session(row: dict) -> None:  # the workload's own callback: the run is still going
            seen.append(row)
            s = scrape(server.url)
            restored = sum(r["hit_depth"] for r in seen)
            chunks = sum(r["hit_depth"] + r["chunks_computed"] for r in seen)
            assert s.get_value("cacheseek_hits_total", kind="live", tier=store) == restored
            assert s.get_value("cacheseek_restored_chunks_total", kind="live") == restored
            assert s.total("cacheseek_lookups_total") == chunks  # every live chunk is a lookup
            # issue 32: a served chunk hands out its frames and moves no KV until the session
            # computes; then its whole served prefix is restored at once (a materialization)
            served = sum(r["frames_served"] for r in seen)
            assert s.get_value("cacheseek_frames_handed_out_total") == served
            eager = restored - served  # restored into the ring chunk by chunk, each its whole KV
            moved = eager + sum(r["chunks_materialized"] for r in seen)
            got = s.get_value("cacheseek_transfer_bytes_sum", direction="restore", tier=store)
            assert got == sum(r["bytes_restored"] for r in seen)
            # a materialization moves what the rolling ring keeps of the served prefix, at most all of it
            assert eager * kv <= got <= moved * kv and (got == moved * kv or moved > eager)
            assert s.total("cacheseek_transfer_bytes_count", direction="restore") \
                == restored - served + sum(r["chunks_materialized"] > 0 for r in seen)
            written = sum(r["bytes_written"] for r in seen)
            assert s.get_value("cacheseek_written_chunks_total", tier=store) * kv == written
            assert s.total("cacheseek_chunk_seconds_count") == chunks - len(seen)  # chunk 0 is the first frame
            assert s.total("cacheseek_session_first_frame_seconds_count") == len(seen)

        try:
            results = stack.workload.run(stack, on_session=after_session)
            stack.store.flush()
            final = scrape(server.url)
            m = stack.metrics.as_dict()
        finally:
            stack.close()
    assert results["passed"] and len(seen) == 12 and m["live_hits"] > 0
    # one truth: the endpoint, results' metrics and the printed block
    assert m["lookups"] == m["live_lookups"] == 48 and m["hits"] == m["live_hits"] == results["interactive"]["chunks_restored"]
    assert m["hit_rate"] == m["hits"] / m["lookups"]
    for name, spec in exports(CacheMetrics):
        if spec.kind == "counter":
            assert final.get_value(spec.family, **dict(spec.labels)) == m[name], name
    assert final.total("cacheseek_hits_total") == m["hits"] and final.total("cacheseek_lookups_total") == m["lookups"]
    assert final.total("cacheseek_transfer_seconds_sum", direction="write") == pytest.approx(m["write_seconds"])
    assert final.get_value("cacheseek_index_probes_total") == m["records"]["probes"]
    block = metrics_block(m)
    assert f"{m['lookups']} lookups" in block and f"{m['hits']} hits" in block
    assert final.get_value("cacheseek_store_used_bytes", tier=store) == m["store_used_bytes"] > 0
    restored_s = final.get_value("cacheseek_chunk_seconds_sum", source="restored")
    computed_s = final.get_value("cacheseek_chunk_seconds_sum", source="computed")
    f = results["interactive"]
    assert restored_s == pytest.approx(f["restored_chunk_s"]["mean"] * f["restored_chunk_s"]["n"])
    assert computed_s == pytest.approx(f["computed_chunk_s"]["mean"] * f["computed_chunk_s"]["n"])


def test_every_declared_family_is_served(compose_cfg, tmp_path, scrape):
    """A tiered store (two levels) so that the per-tier families are there too."""
    cfg = compose_cfg("workload=interactive", "+store=tiered", "store.tiers=[memory,localdisk]",
                      f"store.localdisk.root={tmp_path / 'kv'}", "workload.sessions=6", *RING)
    stack = build_stack(cfg, run_dir=tmp_path)
    with MetricsServer(stack.metrics, port=0) as server:
        try:
            results = stack.workload.run(stack)
            stack.store.flush()
            s = scrape(server.url)
            m = stack.metrics.as_dict()
        finally:
            stack.close()
    assert results["passed"]
    served = s.families()
    for family, kind in FAMILIES.items():
        wanted = f"{family}_count" if kind == "histogram" else family
        if family == "cacheseek_store_capacity_bytes" or family == "cacheseek_store_peak_bytes":
            continue  # unbounded levels have no capacity; a tiered store reports peaks per level in results
        assert wanted in served, family
    assert all(name.startswith("cacheseek_") for name in served)
    assert {dict(ls)["tier"] for n, ls in s if n == "cacheseek_store_chunks"} == {"memory", "localdisk"}
    tiers = {row["name"]: row for row in m["tiers"]}
    for tier, row in tiers.items():
        assert s.get_value("cacheseek_store_chunks", tier=tier) == row["blobs"]
        assert s.get_value("cacheseek_tier_writes_total", tier=tier) == row.get("writes", 0)
    assert s.total("cacheseek_hits_total") == m["hits"] > 0
    # a chunk served from its frames reads no level's KV (issue 32): its hit is the tiered store's.
    # Frames are written off the request path, so a session may reach a chunk whose frames the
    # writer has not put yet: that chunk reads them missing and decodes (a slow CI machine does)
    assert sum(m["hits_by_tier"].values()) == m["hits"] and set(m["hits_by_tier"]) <= {"memory", "localdisk", "tiered"}
    frames_read = m["frames_handed_out"] + m["frames_missing"] + m["frames_corrupt"]
    assert m["frames_handed_out"] > 0 and m["hits_by_tier"].get("tiered", 0) == frames_read


def test_the_cli_serves_prints_the_port_holds_and_stops_on_sigterm(tmp_path, scrape):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "cacheseek", "workload=interactive", "metrics.port=0",
                             "metrics.hold_s=120", f"hydra.run.dir={run_dir}", *RING],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.match(r"metrics: serving (http://127\.0\.0\.1:\d+/metrics)", line)
            if found:
                url = found.group(1)
                scrape(url)  # served while the run goes on
            if line.startswith("metrics: still serving"):
                break
        assert url is not None and lines[-1].startswith("metrics: still serving"), "".join(lines)
        s = scrape(url)  # after the report: the final counters
        results = json.loads((run_dir / "results.json").read_text())
        m = results["metrics"]
        assert results["metrics_endpoint"] == url and results["passed"]
        assert s.total("cacheseek_lookups_total") == m["lookups"] == m["live_lookups"] > 0
        assert s.total("cacheseek_hits_total") == m["hits"] == results["interactive"]["chunks_restored"] > 0
        assert s.total("cacheseek_transfer_bytes_sum", direction="restore") == m["restore_bytes"]
        assert any(f"metrics: {m['lookups']} lookups" in line and f"{m['hits']} hits" in line for line in lines)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    with pytest.raises(OSError):  # the port is free again: nothing listens
        socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])), timeout=2).close()


def test_a_port_in_use_and_a_non_loopback_host_are_one_clear_error():
    with MetricsServer(CacheMetrics(), port=0) as first:
        with pytest.raises(ConfigError) as exc:
            MetricsServer(CacheMetrics(), port=first.port).start()
        assert exc.value.field == "metrics.port" and "in use" in str(exc.value.problem)
    with pytest.raises(ConfigError) as exc:
        MetricsConfig(port=0, host="0.0.0.0")
    assert exc.value.field == "metrics.host"
    with pytest.raises(ConfigError) as exc:
        MetricsConfig(port=70000)
    assert exc.value.field == "metrics.port"
    assert MetricsConfig(host="::1").host == "::1" and MetricsConfig(host="localhost").host == "localhost"
    assert MetricsConfig(port=9400).with_port_offset(3).port == 9403 and MetricsConfig(port=0).with_port_offset(3).port == 0
    assert MetricsConfig().port is None  # off by default


def test_the_cli_refuses_a_bad_metrics_section_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "cacheseek", "metrics.port=0", "metrics.host=10.1.2.3",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: metrics.host: '10.1.2.3' is not a loopback address")


@pytest.mark.parametrize("override, field", [("metrics.host=0.0.0.0", "error: metrics.host: "),
                                             ("metrics.port=65535", "error: metrics.port=65535: worker k serves")])
def test_workers_refuse_a_bad_metrics_section_before_any_worker_starts(tmp_path, capsys, override, field):
    import importlib.util

    spec = importlib.util.spec_from_file_location("workers_tool", REPO / "tools" / "workers.py")
    workers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workers)
    workdir = tmp_path / "w"
    assert workers.main(["--workers", "2", "--workdir", str(workdir), "metrics.port=0", override]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(field), err
    assert not workdir.exists()


@pytest.mark.parametrize("codec, lossy", [("int8", "true"), ("lossless", "false")])
def test_the_store_codec_is_served_and_a_lossy_one_is_labelled(compose_cfg, tmp_path, scrape, codec, lossy):
    """Issue 36: a quantizing codec is labelled lossy in the metrics, as in results.json."""
    cfg = compose_cfg("+store=memory", f"store.codec={codec}", *RING)
    stack = build_stack(cfg, run_dir=tmp_path)
    with MetricsServer(stack.metrics, port=0) as server:
        try:
            s = scrape(server.url)
        finally:
            stack.close()
    assert s.get_value("cacheseek_store_codec_info", codec=codec, lossy=lossy) == 1
    assert {dict(ls)["codec"] for n, ls in s if n == "cacheseek_store_codec_info"} == {codec}
