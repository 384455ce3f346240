"""A restarted worker process skips both encodes (`reuse.exact_prefix.encodes`): two worker
processes of ``tools/workers.py`` on one LocalDisk root run TeleFuser's real pipeline (its Wan
VAE and umT5 encoder, tiny) with live sessions streamed one action per chunk, then a fresh pair
of processes (empty tries, nothing kept in the process) runs the rest: each loads the prompt
embedding and the condition latents from the store, encodes nothing, and every frame equals a
cold run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.telefuser]

REPO = Path(__file__).resolve().parents[2]
TINY = ["runtime=telefuser", "runtime.vae=wan", "runtime.text_encoder=umt5", "runtime.n_layers=1", "runtime.n_heads=1",
        "runtime.head_dim=14", "runtime.ffn_dim=32", "runtime.text_dim=64", "runtime.text_layers=1",
        "runtime.height=32", "runtime.width=32"]


def test_a_restarted_workers_sessions_load_both_encodes_from_the_store(tmp_path):
    pytest.importorskip("telefuser.pipelines.lingbot_world_fast", reason="needs the telefuser extra (see README)")
    out = subprocess.run([sys.executable, str(REPO / "tools" / "workers.py"), "--workdir", str(tmp_path),
                          "--worker-timeout", "600", "--workers", "2", "--restart-after", "2", *TINY,
                          "workload.sessions=4"],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0"),
                         capture_output=True, text=True, timeout=900)
    res = json.loads((tmp_path / "results.json").read_text())
    assert out.returncode == 0 and res["passed"], out.stdout[-3000:]  # every frame equals a cold run's
    by_gen = {g: [p["metrics"] for p in res["processes"] if p["generation"] == g] for g in (0, 1)}
    assert sum(m["encodes_written"] for m in by_gen[0]) >= 2  # the first pair stored them
    for m in by_gen[1]:  # a fresh process: both from the store, none encoded, none damaged
        assert (m["encodes_loaded"], m["encodes_missing"], m["encodes_corrupt"]) == (2, 0, 0), m
