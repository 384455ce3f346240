"""``python -m cacheseek`` in a subprocess: plain run, ``+store=localdisk``, bad input (one clear
message naming the field, non-zero exit, no traceback) and a multirun sweep with one summary.

Every run passes ``hydra.run.dir`` and ``hydra.sweep.dir`` under a temp folder; nothing may be
left under ``outputs/`` or ``multirun/`` of the repository. The subprocesses of this module are
started together (a module fixture) and each test checks its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _listing() -> dict[str, set[str]]:
    out = {}
    for name in ("outputs", "multirun"):
        d = REPO / name
        out[name] = {str(p.relative_to(d)) for p in d.rglob("*")} if d.exists() else set()
    return out


class Proc:
    def __init__(self, args: list[str], tmp: Path) -> None:
        self.run_dir = tmp / "run"
        self.sweep_dir = tmp / "sweep"
        cmd = [sys.executable, "-m", "cacheseek", *args,
               f"hydra.run.dir={self.run_dir}", f"hydra.sweep.dir={self.sweep_dir}"]
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self._done = None

    def wait(self) -> tuple[int, str, str]:
        if self._done is None:
            try:
                out, err = self.p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.p.kill()
                out, err = self.p.communicate()
                pytest.fail(f"CLI did not finish in {TIMEOUT_S} s:\n{out}\n{err}")
            self._done = (self.p.returncode, out, err)
        return self._done


def _not_a_dir(tmp: Path) -> Path:
    f = tmp / "regular-file"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("not a folder")
    return f / "kv"


# name -> (args, expected field in the message); None = a passing run
BAD = {
    "unknown_store": (["+store=nope"], "store"),
    "typo_key": (["+store=localdisk", "store.rooot=/tmp/x"], "store.rooot"),
    "wrong_type": (["runtime.local_attn_size=abc"], "runtime.local_attn_size"),
    "typo_manager": (["manager.break_even=2"], "manager.break_even"),
    "unwritable_root": (["+store=localdisk", "store.root=/proc/forbidden"], "store.root"),
    "root_under_file": (["+store=localdisk", "store.root={NOT_A_DIR}"], "store.root"),
    "wrong_geometry": (["runtime.geometry=huge"], "runtime.geometry"),
    "window_too_small": (["runtime.local_attn_size=4", "runtime.sink_size=3"],
                         "runtime.local_attn_size"),
    "bad_workload": (["workload.total_chunks=1"], "workload.total_chunks"),
    "no_fluxon_service": (["+store=fluxon", "store.cluster_name=cs-test-absent",
                           "store.share_mem_path=/dev/shm/cs-test-absent", "store.attach_timeout_s=3"],
                          "error: store:"),
}
# Errors raised by CacheSeek itself (ConfigError): the CLI prints "error: <field>: ..." once, exit 2
CONFIG_ERRORS = {"unwritable_root", "root_under_file", "wrong_geometry", "window_too_small",
                 "bad_workload"}


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    before = _listing()
    started: dict[str, Proc] = {}
    base = tmp_path_factory.mktemp("cli")
    started["plain"] = Proc([], base / "plain")
    kv = base / "localdisk-root"
    started["localdisk"] = Proc(["+store=localdisk", f"store.root={kv}"], base / "localdisk")
    started["multirun"] = Proc(["-m", "+store=memory,localdisk"], base / "multirun")
    for name, (args, _) in BAD.items():
        tmp = base / name
        args = [a.replace("{NOT_A_DIR}", str(_not_a_dir(tmp))) for a in args]
        started[name] = Proc(args, tmp)
    yield started, kv
    for p in started.values():
        p.wait()
    assert _listing() == before, "the CLI left files under outputs/ or multirun/"


def test_plain_run_passes(procs):
    started, _ = procs
    p = started["plain"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    assert "PASS" in out and "FAIL" not in out and "Traceback" not in out + err
    assert "store=memory" in out and "ring check: 3/3" in out
    for req in "ABCD":
        assert any(line.startswith(req + " ") for line in out.splitlines()), req
    res = json.loads((p.run_dir / "results.json").read_text())
    assert res["passed"] is True and res["store"] == "memory"
    assert [r["hit_depth"] for r in res["requests"]] == [0, 4, 2, 0]
    assert (p.run_dir / ".hydra" / "config.yaml").exists()


def test_localdisk_run_passes(procs):
    started, kv = procs
    p = started["localdisk"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    assert "PASS" in out and "store=localdisk" in out and "Traceback" not in out + err
    res = json.loads((p.run_dir / "results.json").read_text())
    assert res["passed"] is True and res["store"] == "localdisk"
    assert res["store_stats"]["puts"] > 0 and res["store_stats"]["failed_writes"] == 0
    assert any(f.is_file() and f.name != ".lock" for f in kv.rglob("*"))
    assert not (p.run_dir / "kvstore").exists()  # the given root, not the run folder


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_names_the_field_without_traceback(procs, name):
    started, _ = procs
    rc, out, err = started[name].wait()
    _, field = BAD[name]
    assert rc != 0, out + err
    assert "Traceback" not in out + err
    assert field in err, err
    if name in CONFIG_ERRORS:
        assert rc == 2
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {field}:"), err
    assert "PASS" not in out


def test_multirun_sweep_leaves_one_summary(procs):
    started, _ = procs
    p = started["multirun"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    assert "Traceback" not in out + err
    summary = (p.sweep_dir / "summary.md").read_text()
    jobs = {}
    for line in summary.splitlines()[2:]:
        cols = line.split()
        jobs[cols[0]] = cols
    assert set(jobs) == {"+store=memory", "+store=localdisk"}, summary
    for job, cols in jobs.items():
        assert cols[1] == "PASS" and cols[2] == job.split("=")[1], summary
        res = json.loads((p.sweep_dir / job / "results.json").read_text())
        assert res["passed"] is True
    assert (p.sweep_dir / "+store=localdisk" / "kvstore").is_dir()  # root: null -> run folder
    assert json.loads((p.sweep_dir / "summary.json").read_text())
    assert not p.run_dir.exists()
