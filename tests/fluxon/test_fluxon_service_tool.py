"""``tools/fluxon_service.py``: ``start`` returns once the service serves (in the background) and
says how to attach and how to stop; ``stop`` stops it and removes the segment folder; ``run``
starts it, runs one command and stops it. Each service lives only seconds: the master and owner
busy-poll a core each, and the session's service runs beside them on this 2-core machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(REPO / "tools" / "fluxon_service.py")]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def _names(tag: str) -> tuple[str, str]:
    return f"cs{tag}{os.getpid()}", f"/dev/shm/cacheseek-{tag}-{os.getpid()}"


@pytest.mark.fluxon
def test_start_in_the_background_then_stop(fluxon_env, tmp_path):
    cluster, share = _names("bg")
    work = tmp_path / "svc"
    common = ["--dir", str(work), "--cluster-name", cluster, "--share-mem-path", share]
    out = subprocess.run([*TOOL, "start", "--dram", "48MiB", *common], env=_env(), capture_output=True,
                         text=True, timeout=120)
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "in the background" in out.stdout and f"stop --dir {work}" in out.stdout
        assert f"store.cluster_name={cluster}" in out.stdout
        pid = int((work / "service.pid").read_text())
        assert Path(f"/proc/{pid}").exists() and (Path(share) / cluster / "shared.json").is_file()
        again = subprocess.run([*TOOL, "start", *common], env=_env(), capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and again.stderr.startswith("error: --dir: a service started from")
        # A CacheSeek run against it is README's next line (checked by hand, see the report): kept
        # out of here because a second service busy-polling beside the session's starves it.
    finally:
        stop = subprocess.run([*TOOL, "stop", "--dir", str(work)], env=_env(), capture_output=True, text=True,
                              timeout=120)
    assert stop.returncode == 0 and "stopped the Fluxon service" in stop.stdout, stop.stdout + stop.stderr
    assert not (Path(share) / cluster).exists() and not (work / "service.pid").exists()
    assert (work / "logs" / "service.log").is_file()
    again = subprocess.run([*TOOL, "stop", "--dir", str(work)], env=_env(), capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "no Fluxon service" in again.stdout


@pytest.mark.fluxon
def test_run_starts_runs_and_stops_with_the_command_status(fluxon_env, tmp_path):
    cluster, share = _names("run")
    cmd = [*TOOL, "run", "--dram", "32MiB", "--dir", str(tmp_path / "svc"), "--cluster-name", cluster,
           "--share-mem-path", share, "--", sys.executable, "-c",
           f"import os, sys; sys.exit(3 if os.path.exists('{share}/{cluster}/shared.json') else 1)"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stdout + out.stderr  # the command saw the service, its status is ours
    assert "Fluxon service stopped" in out.stdout and not (Path(share) / cluster).exists()


def test_refuses_before_starting_anything(tmp_path):
    out = subprocess.run([*TOOL, "start", "--dram", "lots", "--dir", str(tmp_path / "svc")], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --dram: cannot read 'lots'")
    assert not (tmp_path / "svc").exists()
    out = subprocess.run([*TOOL, "run", "--dir", str(tmp_path / "svc")], env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "no command given" in out.stderr


def test_dram_too_small_for_the_geometry_is_refused_with_the_numbers(tmp_path):
    out = subprocess.run([*TOOL, "start", "--listen", "10.0.0.1", "--dram", "512MiB", "--geometry", "lingbot_480p",
                          "--dir", str(tmp_path / "svc")], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --dram: 512 MiB is too small for geometry lingbot_480p")
    assert "64 MiB slot" in out.stderr and "give --dram 640MiB or more" in out.stderr
    assert not (tmp_path / "svc").exists()
