"""Several live worker processes on one LocalDisk root (``tools/workers.py``, no snapshot
exchange), running ``workload=interactive``:

- 4 workers at once hit within 5 points of one process running the same sessions, every frame
  equal to a cold run;
- a worker killed (SIGKILL) between its chunk's values and its record: the others see a miss (and
  do not wait on its claim), the root stays usable, and a later open's reconcile removes the half
  chunk once it is older than ``store.orphan_grace_s``;
- a restarted worker's first session hits what the others wrote;
- two workers writing the same chunk at once: the first record wins, the second is a no-op, and
  a later reader restores it exactly;
- eviction under pressure (a small ``store.capacity_bytes``) while others restore: no wrong frame,
  no worker stuck (every wait bounded).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cacheseek.kv.claims import ChunkClaim
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import make_full_kv_config
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.workloads.action_tree import ActionTree

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tools" / "workers.py"

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0")


def tool(workdir: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """``tools/workers.py ARGS`` with its work folder ``workdir``: the process and its results."""
    out = subprocess.run([sys.executable, str(WORKERS), "--workdir", str(workdir), "--worker-timeout", "240", *args],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    path = workdir / "results.json"
    return out, json.loads(path.read_text()) if path.exists() else {}


def worker(k: int, n: int, sessions: list[int], workdir: Path, overrides: list[str], patch: str = "") -> subprocess.Popen:
    """One worker of tools/workers.py started by hand (``patch``: Python run in it first, to inject
    a fault), ``n`` of them meeting at one start barrier in ``workdir``."""
    ready = workdir / "ready"
    ready.mkdir(parents=True, exist_ok=True)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tools')!r})
        import workers
        {textwrap.indent(textwrap.dedent(patch), '        ').strip()}
        sys.exit(workers.main({["--worker", str(k), "--workers", str(n), "--sessions", ",".join(map(str, sessions)),
                                "--out", str(workdir / f"w{k}.json"), "--ready-dir", str(ready),
                                "--workdir", str(workdir / f"run{k}"), *overrides]!r}))
    """)
    log = open(workdir / f"w{k}.log", "wb")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def shared(a: tuple, b: tuple) -> int:
    """How many first chunks two paths share."""
    return next((d for d in range(len(a)) if a[d] != b[d]), len(a))


def restored(results: dict) -> float:
    return results["all"]["hit_rate"]


def test_four_workers_at_once_hit_as_one_process_does(tmp_path):
    one, r1 = tool(tmp_path / "one", "--workers", "1", "workload.sessions=24")
    four, r4 = tool(tmp_path / "four", "--workers", "4", "workload.sessions=24")
    assert one.returncode == 0 and four.returncode == 0, (one.stdout[-2000:], four.stdout[-3000:], four.stderr[-2000:])
    assert r1["passed"] and r4["passed"] and r4["mismatches"] == 0 and len(r4["processes"]) == 4
    assert len({p["pid"] for p in r4["processes"]}) == 4 and r4["all"]["chunks_total"] == 96
    assert abs(restored(r4) - restored(r1)) <= 0.05, (restored(r1), restored(r4))
    adopted = sum(p["metrics"]["index_adopted"] for p in r4["processes"])
    assert adopted > 0  # what another worker wrote, found by its key
    assert "PASS: 4 workers on one localdisk store (shared index on)" in four.stdout


def test_a_worker_killed_between_values_and_record_leaves_a_miss_and_a_usable_root(tmp_path):
    root = tmp_path / "kv"
    overrides = ["workload=interactive", "workload.sessions=4", "+store=localdisk", f"store.root={root}"]
    die_at_third_record = """
        import os, signal
        from cacheseek.stores.localdisk import DiskRecords
        publish, seen = DiskRecords.publish, []
        def dying(self, record):
            seen.append(record)
            if len(seen) == 3:  # the chunk's values are committed; its record never will be
                os.kill(os.getpid(), signal.SIGKILL)
            return publish(self, record)
        DiskRecords.publish = dying
    """
    proc = worker(0, 1, [0, 1, 2, 3], tmp_path / "killed", overrides, die_at_third_record)
    assert proc.wait(120) == -signal.SIGKILL
    store = LocalDiskTierStore(root)  # what another worker sees now
    try:
        committed = store.records.node_keys()
        half = {k.partition(":")[0] for k in store.keys() if not k.endswith((":rec", ":claim"))} - {
            key.hex() for key in committed}
        assert len(committed) == 2 and len(half) == 1  # two chunks committed, the third half
        (half_key,) = (bytes.fromhex(h) for h in half)
        assert store.records.find([half_key]) == [None]  # a miss for everyone
        claim = store.records.holder(half_key)
        assert isinstance(claim, ChunkClaim) and claim.stale(600)  # its holder is gone: nobody waits on it
        assert store.orphans() == []  # younger than store.orphan_grace_s: could be a write in flight
    finally:
        store.close()
    time.sleep(0.6)
    store = LocalDiskTierStore(root, orphan_grace_s=0.5)  # a later open
    try:
        done = WorldKVManager(NamespaceForest(), store, make_full_kv_config()).reconcile()
        assert done["orphans_removed"] == 2 * 2 + 1 + 1  # the half chunk's 2 layers of K and V, latent, claim
        assert not any(k.startswith(half_key.hex()) for k in store.keys())
        assert store.records.node_keys() == committed  # the committed chunks stay
    finally:
        store.close()
    out, res = tool(tmp_path / "after", "--workers", "2", "workload.sessions=8", f"store.root={root}")
    assert out.returncode == 0 and res["passed"], out.stdout[-3000:]
    assert res["all"]["chunks_restored"] > 0
    assert sum(p["metrics"]["index_wait_seconds"] for p in res["processes"]) < 5


def test_a_restarted_workers_first_session_hits_what_the_others_wrote(tmp_path):
    out, res = tool(tmp_path, "--workers", "2", "--restart-after", "8", "workload.sessions=12")
    assert out.returncode == 0 and res["passed"], out.stdout[-3000:]
    assert {p["generation"] for p in res["processes"]} == {0, 1} and len(res["processes"]) == 4
    assert "sessions 8.. (after the restart)" in out.stdout
    plan = ActionTree(sessions=12, depth=4, branching=3, skew=1.2, images=1, seed=7, action_dim=4).plan
    firsts = res["restarted_first_sessions"]
    assert len(firsts) == 2
    for first in firsts:
        image, path = plan[first["session"]]
        written = max((shared(p, path) for img, p in plan[:8] if img == image), default=0)
        assert first["chunks_restored"] >= written, (first, written)
    assert sum(f["chunks_restored"] for f in firsts) > 0
    restarted = [p for p in res["processes"] if p["generation"] == 1]
    assert all(p["metrics"]["index_adopted"] > 0 for p in restarted)  # found by key, on an empty trie


def test_two_workers_writing_the_same_chunk_at_once(tmp_path):
    root = tmp_path / "kv"
    # every session the same path; no claims (wait_s=0), so both compute; both publish chunk 0 together
    overrides = ["workload=interactive", "workload.sessions=2", "workload.branching=1", "+store=localdisk",
                 f"store.root={root}", "manager.shared_index.wait_s=0"]
    publish_together = f"""
        import os, pathlib, time
        from cacheseek.stores.localdisk import DiskRecords
        publish, gate = DiskRecords.publish, pathlib.Path({str(tmp_path / 'gate')!r})
        def together(self, record):
            if record.depth == 0:
                gate.mkdir(exist_ok=True)
                (gate / str(os.getpid())).touch()
                deadline = time.monotonic() + 60
                while len(list(gate.iterdir())) < 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
            return publish(self, record)
        DiskRecords.publish = together
    """
    procs = [worker(k, 2, [k], tmp_path / "race", overrides, publish_together) for k in range(2)]
    assert [p.wait(180) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / "race" / f"w{k}.json").read_text()) for k in range(2)]
    assert all(r["rows"][0]["verdict"] == "ok" for r in results)
    stats = [r["metrics"]["records"] for r in results]
    assert sum(s["published"] for s in stats) == 4  # each of the path's 4 chunks has one record ...
    assert sum(s["already_there"] for s in stats) >= 1  # ... chunk 0's second writer was a no-op
    assert sorted(r["rows"][0]["bytes_written"] > 0 for r in results) == [True, True]
    out, res = tool(tmp_path / "reader", "--workers", "1", "workload.sessions=2", "workload.branching=1",
                    f"store.root={root}")
    assert out.returncode == 0 and res["passed"], out.stdout[-3000:]
    assert res["all"]["chunks_restored"] == res["all"]["chunks_total"] == 8  # restored exactly
    assert res["processes"][0]["metrics"]["writes"] == 0


def test_eviction_under_pressure_while_others_restore(tmp_path):
    t0 = time.monotonic()
    # a chunk is about 1.9 KB on disk here (4 values, latent, record): room for about 6 of 50
    out, res = tool(tmp_path, "--workers", "3", "workload.sessions=24", "store.capacity_bytes=12000")
    assert out.returncode == 0 and res["passed"], out.stdout[-3000:]  # no wrong frame, no worker failed
    assert res["mismatches"] == 0 and not res["failures"] and not res["missing_sessions"]
    metrics = [p["metrics"] for p in res["processes"]]
    assert sum(m["evictions"] for m in metrics) > 0 and res["all"]["chunks_restored"] > 0
    assert time.monotonic() - t0 < 240  # nobody stuck: every wait is bounded
