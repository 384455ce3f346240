"""Loading fluxon-py leaves the process environment as it was (issue 23 item 8): its loader
points LD_LIBRARY_PATH at the bundled fluxon_pyo3.libs, which broke every later subprocess of
the process (``mount`` found a bundled libmount and failed, so tests/production/test_disk_full.py
skipped whenever a Fluxon test had run first in the session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fluxon_py

REPO = Path(__file__).resolve().parents[2]

FIRST_LOAD = """
import os, subprocess, sys
before = os.environ.get("LD_LIBRARY_PATH")
from cacheseek.fluxon.loader import load_fluxon
load_fluxon()
import fluxon_pyo3  # loaded: the bundled libraries are in this process
after = os.environ.get("LD_LIBRARY_PATH")
assert after == before, f"LD_LIBRARY_PATH changed: {before!r} -> {after!r}"
tool = sys.argv[1]
if tool:
    done = subprocess.run([tool, "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
print("ok")
"""


def test_a_first_load_gives_ld_library_path_back_and_subprocesses_still_run():
    tool = shutil.which("mount") or ""
    done = subprocess.run([sys.executable, "-c", FIRST_LOAD, tool], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_no_bundled_library_folder_on_the_test_process_path():
    from cacheseek.fluxon.loader import load_fluxon

    load_fluxon()
    assert "fluxon_pyo3.libs" not in os.environ.get("LD_LIBRARY_PATH", "")
