"""The repository stands on its own (issue 22): nothing it ships points outside it, the README's
Set up section holds exactly two commands (the ones .ci/run runs), and tools/netns-run.sh, the
project's own namespace tool, explains itself when it cannot run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NETNS_RUN = REPO / "tools" / "netns-run.sh"


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def test_nothing_tracked_points_at_the_shared_folder_outside_the_repo():
    outside = ["../" + "shared", "/work/" + "shared", "/work/" + "main"]  # split: this file is tracked too
    hits = []
    for path in _tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        hits += [f"{path.relative_to(REPO)}: {word}" for word in outside if word in text]
    assert hits == []


def _setup_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_set_up_holds_exactly_the_two_commands_ci_runs():
    main, tests = _setup_commands()  # exactly two
    assert main.endswith("&& python -m cacheseek")
    assert tests.startswith("python -m pip install torch==2.13.0 -e '.[test,telefuser]' ")
    assert tests.endswith('python -m pytest -q -m "not slow"')
    ci = (REPO / ".ci" / "run").read_text()
    assert '"Install and run the main job" "Install and run the tests"' in ci  # it runs them from README.md


def test_netns_run_prints_its_usage():
    out = subprocess.run(["bash", str(NETNS_RUN)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith("usage: tools/netns-run.sh CMD [ARGS...]")
    out = subprocess.run(["bash", str(NETNS_RUN), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("usage: tools/netns-run.sh CMD")
    assert os.access(NETNS_RUN, os.X_OK)


def test_netns_run_without_unshare_names_the_fix(tmp_path):
    """A PATH holding only what the script needs before its checks: no unshare, no ip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "env"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    out = subprocess.run([str(bin_dir / "bash"), str(NETNS_RUN), "true"], capture_output=True, text=True,
                         timeout=30, env={"PATH": str(bin_dir)})
    assert out.returncode == 2
    if os.geteuid() != 0:
        assert "needs root" in out.stderr and "sudo tools/netns-run.sh true" in out.stderr
    else:
        assert "'unshare' not found on PATH" in out.stderr and "apt-get install util-linux" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a network namespace")
def test_netns_run_gives_a_private_namespace_and_the_command_status():
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (bash tools/install_fluxon_deps.sh)")
    probe = subprocess.run(["unshare", "--net", "--", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this process may not create network namespaces: {probe.stderr.decode().strip()}")
    out = subprocess.run(["bash", str(NETNS_RUN), "cat", "/proc/self/net/dev"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    names = sorted(line.split(":", 1)[0].strip() for line in out.stdout.splitlines() if ":" in line)
    assert names == ["fx0", "fx1", "lo"]
    check = "from cacheseek.fluxon_service.netns import private_netns_problem as p; print(p())"
    out = subprocess.run(["bash", str(NETNS_RUN), sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stdout + out.stderr  # what the service asks
    out = subprocess.run(["bash", str(NETNS_RUN), "sh", "-c", "exit 3"], capture_output=True, timeout=30)
    assert out.returncode == 3
