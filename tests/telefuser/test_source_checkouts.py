"""The live-session tests on TeleFuser source checkouts: the hooked commit (bb98a6b) and main
(5a12f03), which PyPI does not ship. Each runs `test_live_sessions.py`, `test_live_restore.py` and
`test_examples.py` in a subprocess with the checkout first on ``PYTHONPATH``, and skips, naming
how to make one, when its variable is unset:

    git archive bb98a6b telefuser | tar -x -C /tmp/tf_hooked   # in a TeleFuser clone
    CACHESEEK_TELEFUSER_HOOKED=/tmp/tf_hooked CACHESEEK_TELEFUSER_MAIN=/tmp/tf_main python -m pytest ...
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/telefuser/test_live_sessions.py", "tests/telefuser/test_live_restore.py", "tests/telefuser/test_wan_parts.py",
         "tests/telefuser/test_examples.py"]
CHECKOUTS = {"hooked": ("CACHESEEK_TELEFUSER_HOOKED", "bb98a6b", "hooked"),
             "main": ("CACHESEEK_TELEFUSER_MAIN", "5a12f03", "main")}


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(CHECKOUTS))
def test_live_sessions_on_a_telefuser_source_checkout(which):
    var, commit, layout = CHECKOUTS[which]
    checkout = os.environ.get(var)
    if not checkout:
        pytest.skip(f"set {var} to a TeleFuser {commit} checkout (git archive {commit} telefuser | tar -x -C DIR)")
    if not (Path(checkout) / "telefuser" / "pipelines" / "lingbot_world_fast").is_dir():
        pytest.fail(f"{var}={checkout} holds no telefuser/pipelines/lingbot_world_fast")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, str(ROOT)])}
    probe = subprocess.run([sys.executable, "-c", "from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory as F;"
                            "f = F(); f.pipeline; print(f.layout.value)"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip().endswith(layout), probe.stdout + probe.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:]
