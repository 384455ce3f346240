"""The commands users run against a real Fluxon service, as subprocesses in the test's own
network namespace: ``python -m cacheseek +store=fluxon_plan store.client=fluxon ...`` (the gate
prints PASS) and ``python tools/workers.py`` (worker processes at once on one cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tools" / "workers.py"
sys.path.insert(0, str(WORKERS.parent))

from workers import shares, store_overrides  # noqa: E402


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0")


def plan_cli(cluster_name: str, share_mem_path: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cacheseek", "+store=fluxon_plan", "store.client=fluxon",
            f"+store.client_options.cluster_name={cluster_name}",
            f"+store.client_options.share_mem_path={share_mem_path}",
            f"hydra.run.dir={run_dir}", *extra]


def test_store_overrides_name_the_cluster():
    assert store_overrides("fluxon_plan", "c", "/dev/shm/x", 5.0) == [
        "+store=fluxon_plan", "store.client=fluxon", "+store.client_options.cluster_name=c",
        "+store.client_options.share_mem_path=/dev/shm/x", "+store.client_options.op_timeout_s=5.0"]
    assert store_overrides("fluxon", "c", "/dev/shm/x", 5.0)[:2] == ["+store=fluxon", "store.cluster_name=c"]
    with pytest.raises(ValueError, match="unknown store"):
        store_overrides("memory", "c", "/x", 1.0)


def test_sessions_are_split_over_the_workers_and_the_restart():
    assert shares(5, 2) == [[[0, 2, 4], [1, 3]]]
    assert shares(6, 2, restart_after=3) == [[[0, 2], [1]], [[4], [3, 5]]]
    assert shares(2, 4) == [[[0], [1], [], []]]


@pytest.mark.fluxon_py  # the error comes from fluxon-py's client, so it must be installed
def test_cli_without_a_service_fails_at_once_naming_it(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run(plan_cli("nosuch", str(tmp_path / "shm"), tmp_path / "run"), cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "no Fluxon owner serves cluster 'nosuch'" in out.stdout + out.stderr
    assert time.monotonic() - t0 < 60  # interpreter, torch and hydra start included; the attach fails at once


@pytest.mark.fluxon
def test_cli_gate_passes_on_the_plan_tier_over_fluxon(fluxon_service, tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(plan_cli(fluxon_service.cluster_name, fluxon_service.share_mem_path, run,
                                  "namespace.model_fingerprint=cli-test", "+store.client_options.op_timeout_s=20"),
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "PASS: abcd on store=fluxon_plan runtime=synthetic geometry=tiny" in out.stdout
    assert "ring check:   ok (3/3 resume depths equal a cold run)" in out.stdout
    log_text = (run / "cacheseek.log").read_text()
    assert "emulating it over the public client (fluxon_public" in log_text
    results = json.loads((run / "results.json").read_text())
    stats = results["store_stats"]
    assert stats["plans_committed"] > 0 and stats["read_hits"] > 0 and stats["put_failures"] == 0
    assert [m["writable"] for m in stats["mappings"]] == [False, True]  # owner's segment, staging
    assert "store.client_options.staging_bytes=auto -> " in out.stdout  # sized for the workload


@pytest.mark.fluxon
def test_cli_on_the_tensor_tier_reports_the_service_capacity_and_keeps_banners_in_the_log(fluxon_service, tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "cacheseek", "+store=fluxon",
                          f"store.cluster_name={fluxon_service.cluster_name}",
                          f"store.share_mem_path={fluxon_service.share_mem_path}", "store.op_timeout_s=20",
                          "namespace.model_fingerprint=cli-tier-test", "workload.total_chunks=2",
                          "workload.prefix_chunks=1", "workload.ring_check=false", f"hydra.run.dir={run}"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "store capacity: 64 MiB (as the fluxon store reports it)" in out.stdout
    assert "of 64.00 MiB" in out.stdout and "unbounded" not in out.stdout
    assert "Client config" not in out.stdout + out.stderr  # fluxon-py's attach banners ...
    assert "fluxon-py: " in (run / "cacheseek.log").read_text()  # ... are in the log file
    # the native client's warnings, printed by its own threads at any time (FLUXON_LOG=error)
    assert " WARN " not in out.stdout + out.stderr and "\x1b[" not in out.stdout + out.stderr


@pytest.mark.fluxon
@pytest.mark.parametrize("store", ["fluxon_plan", "fluxon"])
def test_worker_processes_at_once_on_one_fluxon_cache(fluxon_service, tmp_path, store):
    """Two workers start at once on the service and run interactive sessions (session i on
    worker i % 2), no snapshot exchanged: every frame equals the worker's cold run."""
    workdir = tmp_path / "w"
    cmd = [sys.executable, str(WORKERS), "--workers", "2", "--store", store,
           "--cluster-name", fluxon_service.cluster_name, "--share-mem-path", fluxon_service.share_mem_path,
           "--workdir", str(workdir), "--op-timeout", "20", "--worker-timeout", "240",
           f"namespace.model_fingerprint=workers-{store}", "workload.sessions=8"]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert f"PASS: 2 workers on one {store} store (shared index on): every frame equals a cold run" in out.stdout
    results = json.loads((workdir / "results.json").read_text())
    first, second = results["processes"]
    assert first["pid"] != second["pid"] != os.getpid() and first["store"] == store
    assert [r["session"] for r in results["sessions"]] == list(range(8))
    assert results["all"]["chunks_total"] == 32 and results["all"]["chunks_restored"] > 0
