"""Issue 34: several worker processes on one cache, each with its own metrics endpoint
(``tools/workers.py metrics.port=...``: one port per worker), scraped over loopback HTTP while
they run and after their sessions: the ports differ, each endpoint counts its own worker's
sessions (hits = the chunks that worker restored, lookups = its chunks, restore bytes = its
restored bytes), and the endpoints add up to the run's total."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tools" / "workers.py"

pytestmark = pytest.mark.slow


def _free_port_pair() -> int:
    """A base port P with P and P+1 free right now (the OS's pick for P)."""
    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", base + 1))
                    return base
            except OSError:
                continue
    pytest.skip("no two adjacent free loopback ports")


@pytest.mark.parametrize("ports", ["os", "base"])
def test_each_worker_serves_its_own_counters_on_its_own_port(tmp_path, scrape, ports):
    base = 0 if ports == "os" else _free_port_pair()
    workdir = tmp_path / "w"
    env = dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0")
    proc = subprocess.Popen([sys.executable, str(WORKERS), "--workers", "2", "--workdir", str(workdir),
                             "--worker-timeout", "240", "workload.sessions=8", f"metrics.port={base}",
                             "metrics.hold_s=120"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        urls: dict[int, str] = {}
        results: dict[int, dict] = {}
        mid_run: dict[int, float] = {}
        deadline = time.monotonic() + 240
        while len(results) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for k in (0, 1):
                url_file = workdir / f"worker-g0w{k}.metrics"
                if k not in urls and url_file.exists() and url_file.read_text().endswith("\n"):
                    urls[k] = url_file.read_text().strip()
                if k in urls and k not in results:
                    mid_run[k] = scrape(urls[k]).total("cacheseek_lookups_total")  # served while it runs
                    out = workdir / f"worker-g0w{k}.json"
                    if out.exists():
                        results[k] = json.loads(out.read_text())
            time.sleep(0.05)
        assert len(results) == 2, proc.stdout.read() if proc.poll() is not None else "workers did not finish"
        ports_got = {int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls.values()}
        assert len(ports_got) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls.values())
        if base:
            assert urls == {k: f"http://127.0.0.1:{base + k}/metrics" for k in (0, 1)}
        total_hits = 0
        for k, r in results.items():
            assert r["metrics_endpoint"] == urls[k]
            s = scrape(urls[k])  # the worker holds its endpoint after its sessions
            restored = sum(row["hit_depth"] for row in r["rows"])
            chunks = sum(row["hit_depth"] + row["chunks_computed"] for row in r["rows"])
            assert s.total("cacheseek_hits_total", kind="live") == restored == r["metrics"]["hits"]
            assert s.total("cacheseek_lookups_total") == chunks == r["metrics"]["lookups"] >= mid_run[k]
            assert s.total("cacheseek_transfer_bytes_sum", direction="restore") \
                == sum(row["bytes_restored"] for row in r["rows"]) == r["metrics"]["restore_bytes"]
            assert s.get_value("cacheseek_index_adopted_chunks_total") == r["metrics"]["index_adopted"]
            total_hits += restored
        for r in results.values():
            os.kill(r["pid"], signal.SIGTERM)  # ends each worker's hold
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        summary = json.loads((workdir / "results.json").read_text())
        assert summary["passed"] and summary["all"]["chunks_restored"] == total_hits
        assert "metrics endpoints: g0w0 " in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
