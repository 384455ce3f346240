"""Issue 33, a newcomer's path, in-process (the CLI's side, one error line each, is tests/test_cli.py):
workload sizes beyond a limit are refused before anything is allocated; a GPU-sized run without
CUDA names what to run on a CPU; Hydra's errors for a preset of another runtime and a one-value
list; a range error's implied fix; sizes that are floats, absurd or miscased; a store root's
missing parents; ``--version``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cacheseek.errors import ConfigError
from cacheseek.hydra_errors import config_error_from_hydra
from cacheseek.runtime.geometry import GEOMETRIES, check_cpu_memory, no_cuda_error
from cacheseek.sizes import parse_size
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.workloads.prefix_gate import PrefixGate
from cacheseek.workloads.stress import StressWorkload

REPO = Path(__file__).resolve().parents[1]


def test_a_huge_workload_is_refused_at_once_with_the_limit_and_the_reason():
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        PrefixGate(total_chunks=100_000_000_000)
    assert time.monotonic() - t0 < 1.0  # nothing allocated first
    assert err.value.field == "workload.total_chunks" and "10,000" in str(err.value) and "computes" in str(err.value)
    assert err.value.fix == "set workload.total_chunks to at most 10000"
    with pytest.raises(ConfigError, match="workload.depth"):
        StressWorkload(depth=10**9)
    with pytest.raises(ConfigError, match="workload.sessions"):
        StressWorkload(sessions=10**12)
    assert PrefixGate(total_chunks=10_000).n == 10_000


def test_a_gpu_sized_geometry_without_cuda_names_what_to_run_on_a_cpu():
    err = no_cuda_error(GEOMETRIES["lingbot_480p"], "+experiment=rolling_tiny")
    assert err.field == "runtime.device" and "3.57 GiB" in err.problem and "GPU" in err.problem
    assert "runtime.device=cpu" not in err.fix and "+experiment=rolling_tiny" in err.fix
    small = no_cuda_error(GEOMETRIES["tiny"], "+experiment=rolling_tiny")
    assert small.fix == "use runtime.device=cpu"


def test_a_gpu_sized_geometry_on_a_cpu_without_the_memory_is_refused_before_allocating():
    """Issue 33 newcomer item 2: ``+experiment=lingbot_480p runtime.device=cpu`` ran out of memory
    with a traceback; it needs 4 chunks' KV (14.28 GiB) before the first chunk computes."""
    with pytest.raises(ConfigError) as raised:
        check_cpu_memory(GEOMETRIES["lingbot_480p"], "+experiment=rolling_tiny", available=8 << 30)
    err = raised.value
    assert err.field == "runtime.device" and "14.28 GiB" in err.problem and "8 GiB" in err.problem
    assert "+experiment=rolling_tiny" in err.fix
    check_cpu_memory(GEOMETRIES["lingbot_480p"], "+experiment=rolling_tiny", available=1 << 40)  # it fits
    check_cpu_memory(GEOMETRIES["tiny"], "+experiment=rolling_tiny", available=1 << 20)  # small: never refused


def test_the_cli_refuses_a_gpu_sized_cpu_run_in_one_line(tmp_path):
    """The CLI on this machine, when it has less than 14.28 GiB available (CI's has): one line."""
    from cacheseek.runtime.geometry import CPU_RING_CHUNKS
    import os

    need = CPU_RING_CHUNKS * GEOMETRIES["lingbot_480p"].chunk_kv_nbytes()
    if os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >= need:
        pytest.skip("this machine has the memory for a 480p CPU run")
    done = subprocess.run([sys.executable, "-m", "cacheseek", "+experiment=lingbot_480p", "runtime.device=cpu",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "runtime.device" in ln]
    assert len(lines) == 1 and "of memory" in lines[0] and "Traceback" not in done.stderr


def _compose_error(compose_cfg, *overrides) -> ConfigError:
    with pytest.raises(Exception) as raised:
        compose_cfg(*overrides)
    found = config_error_from_hydra(raised.value)
    assert found is not None, raised.value
    return found


def test_a_model_preset_without_its_runtime_names_the_runtime(compose_cfg):
    err = _compose_error(compose_cfg, "+model=lingbot_world_14b")
    assert err.field == "model" and "runtime=telefuser" in err.problem
    assert err.fix == "choose that runtime with it: runtime=telefuser +model=lingbot_world_14b"
    compose_cfg("runtime=telefuser", "+model=lingbot_world_14b")  # the fix composes


def test_one_value_for_a_list_says_brackets(compose_cfg):
    err = _compose_error(compose_cfg, "+store=tiered", "store.tiers=hbm")
    assert err.field == "store.tiers" and "store.tiers=[hbm]" in err.fix and "ListConfig" not in str(err)


def test_a_range_error_without_a_fix_gets_the_one_it_implies():
    err = ConfigError("store.queue_depth", "must be an integer >= 1, got 0")
    assert err.fix == "set store.queue_depth to an integer >= 1" and "(fix: " in str(err)
    assert ConfigError("x", "must be >= 0, got -1").fix == "set x to a value >= 0"
    assert ConfigError("x", "is odd").fix is None


@pytest.mark.parametrize("value", ["99999999999999999999GiB", 1.5e20, "16384PiB", str(1 << 64)])
def test_an_absurd_size_is_refused(value):
    with pytest.raises(ConfigError) as err:
        parse_size(value, "store.capacity_bytes")
    assert err.value.field == "store.capacity_bytes" and ("16 EiB" in str(err.value) or "cannot read" in str(err.value))


def test_a_float_or_a_unit_in_another_case_is_echoed_explicitly():
    from cacheseek.sizing import SizeField, resolve_sizes

    field = SizeField("capacity_bytes", "capacity")
    for given, says in (("64mib", "'mib' is read as MiB (binary, any case): 64MiB"),
                        (1e9, "1000000000.0 is a float, read as 1000000000 bytes"), ("64m", "read as MiB")):
        cfg = {"capacity_bytes": given}
        (line,) = resolve_sizes(cfg, [field], None)
        assert says in line, line
    (line,) = resolve_sizes({"capacity_bytes": "64MiB"}, [field], None)
    assert line.endswith("(as given)")


def test_a_capacity_beyond_the_whole_machine_is_refused(tmp_path):
    from cacheseek.sizing import SizeField, resolve_sizes

    field = SizeField("capacity_bytes", "capacity", room=8 << 30, total=16 << 30)
    with pytest.raises(ConfigError) as err:
        resolve_sizes({"capacity_bytes": "64TiB"}, [field], None)
    assert "16 GiB" in str(err.value) and "whole memory" in str(err.value) and "auto" in err.value.fix
    assert resolve_sizes({"capacity_bytes": "12GiB"}, [field], None)  # above the free room: a bound, allowed


def test_a_store_root_is_made_but_never_its_parents(tmp_path):
    deep = tmp_path / "nonexistent" / "deep" / "kv"
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(deep))
    assert f"its parent {deep.parent} does not exist" in str(err.value) and "mkdir -p" in err.value.fix
    assert not (tmp_path / "nonexistent").exists()
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError) as err:
        LocalDiskTierStore(str(f / "deep" / "kv"))
    assert str(err.value).startswith(f"store.root: {f} is a file, not a folder")


def test_version_prints_cacheseeks_own():
    done = subprocess.run([sys.executable, "-m", "cacheseek", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("cacheseek 0.") and "Hydra 1." not in done.stdout
