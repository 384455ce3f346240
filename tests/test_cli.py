"""``python -m cacheseek`` in a subprocess: plain run, ``+store=localdisk``, a stress run, ``--help``,
a table of bad inputs (each one ``error:`` line naming the field and the fix, exit 2, no
traceback), a multirun sweep with one summary, and runs on TeleFuser's real pipeline (its loguru
lines and banner in ``cacheseek.log``, none in the piped report; the summary naming TeleFuser).

Every run but the bare ``--help`` (which writes nothing) passes ``hydra.run.dir`` and
``hydra.sweep.dir`` under a temp folder; nothing may be
left under ``outputs/`` or ``multirun/`` of the repository. The subprocesses of this module are
started by a module fixture, three at a time, and each test checks its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# About 30 CLI processes (torch and Hydra start in each): slow, run by .ci/run after the README's fast set.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _listing() -> dict[str, set[str]]:
    out = {}
    for name in ("outputs", "multirun"):
        d = REPO / name
        out[name] = {str(p.relative_to(d)) for p in d.rglob("*")} if d.exists() else set()
    return out


class Proc:
    """One CLI run in a subprocess, started by ``pool`` (a few at a time: the machine is small)."""

    def __init__(self, args: list[str], tmp: Path, pool: ThreadPoolExecutor,
                 pythonpath: Path | None = None, dirs: bool = True) -> None:
        self.run_dir = tmp / "run"
        self.sweep_dir = tmp / "sweep"
        dirs = [f"hydra.run.dir={self.run_dir}", f"hydra.sweep.dir={self.sweep_dir}"] if dirs else []
        self.cmd = [sys.executable, "-m", "cacheseek", *args,
                    *(d for d in dirs if not any(a.startswith(d.split("=")[0] + "=") for a in args))]
        self.env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        if pythonpath is not None:
            self.env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO), self.env.get("PYTHONPATH", "")])
        self._future = pool.submit(self._run)

    def _run(self) -> tuple[int, str, str]:
        try:
            out = subprocess.run(self.cmd, cwd=REPO, env=self.env, capture_output=True, text=True,
                                 timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            return -1, str(exc.stdout or ""), f"CLI did not finish in {TIMEOUT_S} s: {exc.stderr or ''}"
        return out.returncode, out.stdout, out.stderr

    def wait(self) -> tuple[int, str, str]:
        rc, out, err = self._future.result()
        if rc == -1:
            pytest.fail(err + "\n" + out)
        return rc, out, err


def _not_a_dir(tmp: Path) -> Path:
    f = tmp / "regular-file"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("not a folder")
    return f / "kv"


def _a_file(tmp: Path) -> Path:
    return _not_a_dir(tmp).parent


def _no_fluxon_py(tmp: Path) -> Path:
    """A folder that shadows fluxon_py with a package that cannot be imported (as if missing)."""
    pkg = tmp / "shadow" / "fluxon_py"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('No module named fluxon_py (hidden by the test)')\n")
    return pkg.parent


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_cuda_bindings() -> bool:
    for name in ("cuda.bindings", "cuda.cudart"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False


ABSENT_FLUXON = ["store.cluster_name=cs-test-absent", "store.share_mem_path=/dev/shm/cs-test-absent",
                 "store.attach_timeout_s=3"]

# name -> (args, the field the error line names, a word the line must hold besides the field).
# {NOT_A_DIR}, {A_FILE} are replaced per case; "no_fluxon_py" runs with a shadowed fluxon_py.
BAD = {
    "unknown_store": (["+store=nope"], "store", "localdisk"),
    "store_without_plus": (["store=localdisk"], "store", "+store=localdisk"),
    "store_chosen_twice": (["+store=memory", "+store=localdisk"], "store", "once"),
    "field_without_a_store": (["+store.rooot=x"], "store", "+store=localdisk store.root=x"),
    "store_field_without_a_store": (["store.capacity_bytes=1GiB"], "store.capacity_bytes",
                                    "+store=memory store.capacity_bytes=1GiB"),
    "appended_field_without_a_store": (["+store.capacity_bytes=1GiB"], "store",
                                       "+store=memory store.capacity_bytes=1GiB"),
    "appended_typo_key": (["+store=localdisk", "+store.rooot=x"], "store.rooot", "store.root?"),
    "typo_key": (["+store=localdisk", "store.rooot=/tmp/x"], "store.rooot", "store.root?"),
    "typo_manager": (["manager.break_even=2"], "manager.break_even", "manager.break_even_k"),
    "wrong_type": (["runtime.local_attn_size=abc"], "runtime.local_attn_size", "integer"),
    "wrong_type_float": (["workload.total_chunks=1.5"], "workload.total_chunks", "integer"),
    "wrong_type_bool": (["+store=localdisk", "store.fsync=maybe"], "store.fsync", "true or false"),
    "list_without_brackets": (["+store=tiered", "store.tiers=hbm,localdisk"], "store.tiers",
                              "store.tiers=[hbm,localdisk]"),
    "two_choices_of_a_group": (["layout=bshd,telefuser_main"], "layout", "-m layout="),
    "unparsable": (["+store=localdisk", "store.root=["], "store.root", "quote"),
    "unknown_experiment": (["+experiment=nope"], "experiment", "rolling_tiny"),
    "unwritable_root": (["+store=localdisk", "store.root=/proc/forbidden"], "store.root", "writable"),
    "root_under_file": (["+store=localdisk", "store.root={NOT_A_DIR}"], "store.root", "regular-file is a file"),
    "root_is_a_file": (["+store=localdisk", "store.root={A_FILE}"], "store.root", "not a folder"),
    "unwritable_run_dir": (["hydra.run.dir=/proc/forbidden"], "hydra.run.dir", "hydra.run.dir=/tmp"),
    "run_dir_is_a_file": (["hydra.run.dir={A_FILE}"], "hydra.run.dir", "not a folder"),
    "wrong_geometry": (["runtime.geometry=huge"], "runtime.geometry", "lingbot_480p"),
    "window_too_small": (["runtime.local_attn_size=4", "runtime.sink_size=3"], "runtime.local_attn_size", ">= 6"),
    "bad_workload": (["workload.total_chunks=1"], "workload.total_chunks", ">= 2"),
    # issue 33, a newcomer's path: each one line naming the field and the fix
    "chunks_above_the_limit": (["workload.total_chunks=100000000000"], "workload.total_chunks", "10,000"),
    "model_without_its_runtime": (["+model=lingbot_world_14b"], "model", "runtime=telefuser +model=lingbot_world_14b"),
    "one_tier_without_brackets": (["+store=tiered", "store.tiers=hbm"], "store.tiers", "store.tiers=[hbm]"),
    "range_without_a_fix": (["runtime.num_steps=0"], "runtime.num_steps", "an integer >= 1"),
    "root_parent_missing": (["+store=localdisk", "store.root={A_FILE}-missing/deep/kv"], "store.root", "mkdir -p"),
    "capacity_beyond_memory": (["+store=memory", "store.capacity_bytes=99999999999999999999GiB"],
                               "store.capacity_bytes", "16 EiB"),
    "layout_the_runtime_lacks": (["layout=telefuser_main"], "layout", "layout=bshd"),
    "watermark_above_one": (["manager.eviction.high_watermark=1.5"], "manager.eviction.high_watermark",
                            "high_watermark=0.9"),
    "break_even_below_one": (["manager.break_even_k=-1"], "manager.break_even_k", "break_even_k=1"),
    # the natural first GPU run with a segment too small for one 480p chunk: refused at start
    "segment_below_a_chunk": (["+store=fluxon_plan", "+experiment=lingbot_480p", "runtime.device=cpu",
                               "store.segment_bytes=256MiB"], "store.segment_bytes", "3.57 GiB"),
    "segment_above_memory": (["+store=fluxon_plan", "store.segment_bytes=64TiB"], "store.segment_bytes",
                             "free memory"),
    "capacity_zero": (["+store=memory", "store.capacity_bytes=0"], "store.capacity_bytes", "one chunk"),
    "capacity_not_a_size": (["+store=memory", "store.capacity_bytes=lots"], "store.capacity_bytes", "512MiB"),
    "decimal_unit": (["+store=memory", "store.capacity_bytes=1.5GB"], "store.capacity_bytes", "1.5GiB"),
    "size_with_a_space": (["+store=memory", "store.capacity_bytes=5 GiB"], "store.capacity_bytes", "5GiB"),
    "no_fluxon_service": (["+store=fluxon", *ABSENT_FLUXON], "store", "tools/fluxon_service.py start"),
    "no_fluxon_py": (["+store=fluxon", *ABSENT_FLUXON], "store", "pip install -e '.[fluxon]'"),
}
# no_fluxon_service's error comes from fluxon-py's client: it runs where fluxon-py is installed.
NEEDS_FLUXON_PY = {"no_fluxon_service"}
HAS_FLUXON_PY = importlib.util.find_spec("fluxon_py") is not None
if not _has_cuda():
    BAD["gpu_experiment_on_a_cpu"] = (["+experiment=lingbot_480p"], "runtime.device", "+experiment=rolling_tiny")
if not _has_cuda_bindings():
    BAD["cuda_without_cuda_bindings"] = (["transfer=cuda"], "transfer", "cuda-bindings")


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    before = _listing()
    started: dict[str, Proc] = {}
    base = tmp_path_factory.mktemp("cli")
    kv = base / "localdisk-root"
    with ThreadPoolExecutor(max_workers=3) as pool:
        started["plain"] = Proc([], base / "plain", pool)
        started["localdisk"] = Proc(["+store=localdisk", f"store.root={kv}"], base / "localdisk", pool)
        started["multirun"] = Proc(["-m", "+store=memory,localdisk"], base / "multirun", pool)
        started["multirun_bad"] = Proc(["-m", "workload.total_chunks=4,0"], base / "multirun_bad", pool)
        started["version"] = Proc(["--version"], base / "version", pool, dirs=False)
        started["stress"] = Proc(["+experiment=stress", "workload.sessions=8", "workload.threads=2"],
                                 base / "stress", pool)
        started["help"] = Proc(["--help"], base / "help", pool, dirs=False)  # bare: Hydra is skipped
        started["help_by_hydra"] = Proc(["--help", "hydra.job.name=cacheseek"], base / "help_by_hydra", pool)
        for name, (args, _, _) in BAD.items():
            if name in NEEDS_FLUXON_PY and not HAS_FLUXON_PY:
                continue  # its test skips
            tmp = base / name
            args = [a.replace("{NOT_A_DIR}", str(_not_a_dir(tmp))).replace("{A_FILE}", str(_a_file(tmp)))
                    for a in args]
            started[name] = Proc(args, tmp, pool, pythonpath=_no_fluxon_py(tmp) if name == "no_fluxon_py" else None)
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
    assert "store=memory" in out and "ring check:   ok (3/3" in out
    assert "hit depth:    ok (A 0, B 4, C 2, D 0)" in out and "frame hashes: ok" in out
    assert out.splitlines()[2].startswith("store.capacity_bytes=auto -> unbounded")  # choices first
    assert err == "" and "INFO" not in out  # log lines go to the run folder's log file only
    assert "\x1b[" not in out  # piped: no colours, no progress bar
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


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.fluxon_py) if n in NEEDS_FLUXON_PY else n
                                  for n in sorted(BAD)])
def test_bad_input_is_one_error_line_naming_the_field(procs, name):
    """Exit 2, nothing on stderr but one ``error: FIELD: ... (fix: ...)`` line, which is not
    repeated on stdout; no traceback, no PASS, no run started, no run folder left behind."""
    started, _ = procs
    rc, out, err = started[name].wait()
    _, field, word = BAD[name]
    assert rc == 2, out + err
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), err
    assert word in lines[0], lines[0]
    assert "(fix: " in lines[0], lines[0]
    message = lines[0][len("error: "):]
    assert message not in out and "error" not in out.lower(), out
    assert "PASS" not in out and "hit depth" not in out
    assert not started[name].run_dir.exists(), sorted(started[name].run_dir.rglob("*"))


# Bad inputs whose fix is overrides to run instead: name -> (the words before them in the fix,
# the bad case's overrides that the fix keeps). Following the fix must give a run, not an error.
FIX_RUNS = {
    "store_field_without_a_store": ("choose a store first: ", []),
    "appended_field_without_a_store": ("choose a store first: ", []),
    "list_without_brackets": ("a list takes brackets: ", ["+store=tiered"]),
}


def _fix_overrides(line: str, lead: str) -> list[str]:
    """The overrides an error line's fix names: after ``lead``, up to a ``;`` or the end."""
    fix = line.split(f"(fix: {lead}", 1)[1]
    return fix[:-1].split(";")[0].split()


@pytest.mark.parametrize("name", sorted(FIX_RUNS))
def test_the_fix_of_a_bad_input_runs(procs, tmp_path, name):
    """The fix's command line passes; a size it sets is echoed at start, as read."""
    started, _ = procs
    _, _, err = started[name].wait()
    lead, kept = FIX_RUNS[name]
    overrides = [*kept, *_fix_overrides(err.strip(), lead)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        rc, out, err = Proc(overrides, tmp_path, pool).wait()
    assert rc == 0 and "PASS" in out and "Traceback" not in out + err, f"{overrides}: rc {rc}\n{out}{err}"
    for size in (o for o in overrides if o.startswith("store.capacity_bytes=")):
        assert f"{size} -> 1 GiB = 1073741824 bytes (as given)" in out.splitlines(), out


def test_help_teaches_the_groups_the_plus_and_the_workers(procs):
    from cacheseek.registry import STORES, TRANSFERS, WORKLOADS

    started, _ = procs
    rc, out, err = started["help"].wait()
    assert rc == 0, out + err
    assert "+store=NAME" in out and "leading +" in out and "python tools/workers.py" in out
    for name in STORES.names() + TRANSFERS.names() + WORKLOADS.names():
        assert name in out, name
    for yaml in (*(REPO / "conf" / "experiment").glob("*.yaml"), *(REPO / "conf" / "model").glob("*.yaml")):
        assert yaml.stem in out, yaml.stem
    assert "+model=NAME" in out
    assert "Examples:" in out and "512MiB" in out
    assert "schema/" not in out and "Powered by Hydra" not in out


def test_bare_help_is_hydras_help_byte_for_byte(procs):
    """A bare ``--help`` skips Hydra (`cacheseek.cli_help`); with an override Hydra renders it."""
    started, _ = procs
    rc, out, err = started["help"].wait()
    rc_h, out_h, err_h = started["help_by_hydra"].wait()
    assert rc == rc_h == 0 and err == err_h == "", err + err_h
    assert out == out_h


def test_help_imports_neither_torch_nor_hydra_nor_a_backend():
    code = ("import runpy, sys; sys.argv = ['cacheseek', '--help']; "
            "runpy.run_module('cacheseek', run_name='__main__'); "
            "loaded = [m for m in ('torch', 'hydra', 'cacheseek.cli', 'cacheseek.stores') if m in sys.modules]; "
            "sys.exit('imported: ' + ', '.join(loaded) if loaded else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-500:] + out.stderr
    assert "+store=NAME" in out.stdout


def test_the_stress_run_prints_its_choices_and_the_table_not_the_log(procs):
    started, _ = procs
    p = started["stress"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    first = out.splitlines()[:3]
    assert first[0].startswith("transfer: host") and first[1].startswith("store: memory"), out
    assert first[2].startswith("store.capacity_bytes=auto -> unbounded"), out
    assert "INFO" not in out + err and "stress:" in out and "PASS" in out
    log = (p.run_dir / "cacheseek.log").read_text()
    assert "INFO" in log and "transfer: host" in log


def test_a_sweep_with_a_bad_value_keeps_the_others_rows_and_says_why(procs):
    """Issue 33: ``-m workload.total_chunks=4,0``: the good job's row, the bad one ERROR with its line."""
    started, _ = procs
    p = started["multirun_bad"]
    rc, out, err = p.wait()
    assert rc == 2 and "Traceback" not in out + err, out + err
    summary = (p.sweep_dir / "summary.md").read_text()
    rows = {cols[0]: cols[1] for cols in map(str.split, summary.splitlines()[2:])
            if len(cols) > 1 and cols[1] in ("PASS", "FAIL", "ERROR")}
    assert rows == {"workload.total_chunks=4": "PASS", "workload.total_chunks=0": "ERROR"}, summary
    assert "workload.total_chunks=0: error: workload.total_chunks: must be >= 2" in summary
    assert "sweep summary" in out


def test_version_is_cacheseeks(procs):
    rc, out, err = procs[0]["version"].wait()
    assert rc == 0 and out.startswith("cacheseek 0.") and "hydra-core" in out, out + err


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
        assert cols[3:7] == ["synthetic", "bshd", "tiny", "cpu"], summary  # what ran
        res = json.loads((p.sweep_dir / job / "results.json").read_text())
        assert res["passed"] is True
    assert (p.sweep_dir / "+store=localdisk" / "kvstore").is_dir()  # root: null -> run folder
    assert json.loads((p.sweep_dir / "summary.json").read_text())
    assert not p.run_dir.exists()


LOGURU_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| [A-Z]+ +\|", re.M)


@pytest.fixture(scope="module")
def telefuser_procs(tmp_path_factory):
    """A run and a one-job sweep on TeleFuser's real pipeline, stdout and stderr piped."""
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    base = tmp_path_factory.mktemp("cli-telefuser")
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {"run": Proc(["runtime=telefuser"], base / "run", pool),
                   "sweep": Proc(["-m", "runtime=telefuser", "+store=memory"], base / "sweep", pool)}
        yield started
        for p in started.values():
            p.wait()


@pytest.mark.telefuser
def test_telefuser_logs_go_to_the_log_file_not_the_piped_report(telefuser_procs):
    p = telefuser_procs["run"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    assert "PASS" in out and "Traceback" not in out + err
    assert "\x1b[" not in out + err, "ANSI codes in piped output"
    assert not LOGURU_LINE.search(out + err) and "LingBot runtime created" not in out + err, out
    assert err == "" and "TeleFuser Logging" not in out, err  # the banner
    log = (p.run_dir / "cacheseek.log").read_text()
    assert "[telefuser.pipelines.lingbot_world_fast.pipeline][INFO] - LingBot runtime created" in log
    assert "telefuser: TeleFuser Logging  initialized" in log and "\x1b[" not in log


@pytest.mark.telefuser
def test_telefuser_sweep_summary_names_telefuser_its_layout_and_geometry(telefuser_procs):
    p = telefuser_procs["sweep"]
    rc, out, err = p.wait()
    assert rc == 0, out + err
    assert "\x1b[" not in out + err and not LOGURU_LINE.search(out + err), out + err
    job = p.sweep_dir / "+store=memory,runtime=telefuser"
    described = json.loads((job / "results.json").read_text())["runtime"]
    assert "LingBot runtime created" in (job / "cacheseek.log").read_text()
    [row] = json.loads((p.sweep_dir / "summary.json").read_text())
    assert row["runtime"] == f"telefuser {described['telefuser']} {described['layout']}", row
    assert row["layout"] in ("bshd", "telefuser_main") and row["geometry"] == "2x2x12 ffn 48 text 32 64x64", row
    assert row["runtime"] in (p.sweep_dir / "summary.md").read_text()


def _refused_run_in(folder: Path) -> None:
    """What a refused run leaves before `forget_run_folder`: the check's record, Hydra's files."""
    from omegaconf import OmegaConf

    from cacheseek.cli import unwritable_output_dir

    assert unwritable_output_dir(OmegaConf.create({"hydra": {"run": {"dir": str(folder)}}}), "run") is None
    (folder / ".hydra").mkdir(exist_ok=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text("{}\n")


def test_a_refused_run_removes_the_folder_it_made_and_nothing_else(tmp_path):
    import logging

    from cacheseek.cli import forget_run_folder

    made = tmp_path / "outputs" / "day" / "time"
    _refused_run_in(made)
    handler = logging.FileHandler(made / "cacheseek.log")
    logging.getLogger().addHandler(handler)
    forget_run_folder()
    assert handler not in logging.getLogger().handlers
    assert not (tmp_path / "outputs").exists()  # the parents it made go too

    there = tmp_path / "there"
    there.mkdir()
    _refused_run_in(there)
    forget_run_folder()
    assert (there / ".hydra" / "config.yaml").exists()  # not made by this run: kept

    holding = tmp_path / "holding"
    _refused_run_in(holding)
    (holding / "kvstore" / "ab").mkdir(parents=True)
    (holding / "kvstore" / "ab" / "value").write_bytes(b"v")
    forget_run_folder()
    assert (holding / "kvstore" / "ab" / "value").exists()  # holds a value Hydra did not write: kept

    opened = tmp_path / "opened"  # issue 33: a store opened, then the run refused: its root holds only the lock
    _refused_run_in(opened)
    (opened / "kvstore" / "localdisk" / "ab").mkdir(parents=True)
    (opened / "kvstore" / ".lock").write_bytes(b"")
    (opened / "kvstore" / "localdisk" / ".lock").write_bytes(b"")
    forget_run_folder()
    assert not opened.exists()


def _cli(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "cacheseek", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _value_files(root: Path) -> set[str]:
    return {p.name for p in root.glob("[0-9a-f][0-9a-f]/*") if "." not in p.name}


HOLD_ROOT = ("import sys; from cacheseek.stores.localdisk import LocalDiskTierStore; "
             "s = LocalDiskTierStore(sys.argv[1]); print('held', flush=True); sys.stdin.read(); s.close()")


def test_a_persistent_root_hits_on_the_second_run_and_is_shared_by_a_live_process(tmp_path):
    """Issue 31: the root is its own index (chunk records), so the second run hits what the first
    wrote and its reconcile removes nothing committed; a run beside a process holding the root
    shares it: it passes, hits what was committed, and wipes nothing."""
    root = tmp_path / "kv"
    args = ["+store=localdisk", f"store.root={root}"]
    first = _cli(args, tmp_path / "run1")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    committed = _value_files(root)
    assert committed and not (root / "forest.json").exists()
    second = _cli(args, tmp_path / "run2")
    assert second.returncode == 0 and "PASS" in second.stdout, second.stdout[-2000:] + second.stderr
    res = json.loads((tmp_path / "run2" / "results.json").read_text())
    rows = {r["name"]: r for r in res["requests"]}
    assert res["warm"] and rows["A"]["hit_depth"] == res["config"]["workload"]["total_chunks"]
    assert rows["A"]["frames"] == "ok" and rows["R"]["hit_depth"] == 0
    assert _value_files(root) >= committed  # nothing committed was reconciled away

    before = _value_files(root)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_ROOT, str(root)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        third = _cli(args, tmp_path / "run3")
    finally:
        holder.communicate("", timeout=TIMEOUT_S)
    assert third.returncode == 0 and "PASS" in third.stdout, third.stdout[-2000:] + third.stderr
    assert _value_files(root) >= before
