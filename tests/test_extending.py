"""docs/extending.md is the way to add a backend: its store, taken from the page as written (the
class, its YAML and the entry point that names its package), runs the gate end to end through
``python -m cacheseek``, and is a tier of the tiered store, without a line anywhere else.

The package is laid out as ``pip install`` leaves one (the module, its ``conf/`` and a
``.dist-info`` with the entry points of the page's pyproject.toml) in a folder of its own on
``PYTHONPATH``, and the runs are subprocesses, so the store is never registered in the test
process (whose config tests check that every registered store has a YAML under conf/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "extending.md"


def _blocks(language: str) -> list[str]:
    """The page's fenced blocks tagged ``language`` ("" for untagged ones), in order."""
    blocks, current, tag = [], None, None
    for line in DOC.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, tag = [], line[3:].strip()
            else:
                if tag == language:
                    blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _file_block(language: str, path: str) -> str:
    """The block of ``language`` whose first line is the comment ``# path``."""
    found = [b for b in _blocks(language) if b.splitlines()[0] == f"# {path}"]
    assert len(found) == 1, f"docs/extending.md: one {language} block for {path}, found {len(found)}"
    return found[0]


def _install_the_documented_package(site: Path) -> dict[str, str]:
    """The page's package under ``site``, as pip would install it; returns its entry points."""
    package = site / "my_backends"
    (package / "conf" / "store").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "conf" / "__init__.py").write_text("")
    (package / "pickled.py").write_text(_file_block("python", "cacheseek/stores/pickled.py"))
    (package / "conf" / "store" / "pickled.yaml").write_text(_file_block("yaml", "conf/store/pickled.yaml"))
    project = tomllib.loads(next(b for b in _blocks("toml") if "cacheseek.backends" in b))
    entry_points = project["project"]["entry-points"]["cacheseek.backends"]
    dist = site / "my_backends-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-backends\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[cacheseek.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return entry_points


def _documented_command() -> list[str]:
    line = next(ln for b in _blocks("") for ln in b.splitlines() if ln.startswith("python -m cacheseek +store=pickled"))
    return line.split()[3:]  # after "python -m cacheseek"


def _cli(args: list[str], site: Path, run_dir: Path) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "cacheseek", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((run_dir / "results.json").read_text()), done.stdout


def test_the_documented_store_runs_the_gate_and_is_a_tier(tmp_path):
    site = tmp_path / "site"
    assert _install_the_documented_package(site) == {"pickled": "my_backends.pickled"}
    args = _documented_command()
    assert args[0] == "+store=pickled" and any(a.startswith("hydra.searchpath=") for a in args), args

    results, out = _cli([*args, "store.capacity_bytes=64MiB"], site, tmp_path / "plain")
    assert results["passed"] and results["store"] == "pickled", out
    assert results["config"]["store"]["_target_"] == "my_backends.pickled.PickledTierStore"
    assert results["store_stats"]["puts"] > 0 and results["store_stats"]["gets"] > 0, results["store_stats"]
    assert "PASS: abcd on store=pickled" in out

    searchpath = next(a for a in args if a.startswith("hydra.searchpath="))
    results, out = _cli(["+store=tiered", "store.tiers=[pickled,localdisk]", searchpath,
                         f"store.localdisk.root={tmp_path / 'kv'}"], site, tmp_path / "tiered")
    assert results["passed"] and results["store"] == "tiered", out
    assert results["config"]["store"]["pickled"]["_target_"] == "my_backends.pickled.PickledTierStore"
