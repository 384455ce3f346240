"""Codecs on TeleFuser's real LingBot-World-fast loop (tiny random weights): the gate bit-exact with
``store.codec=lossless`` on LocalDisk, and with int4 a PASS labelled lossy whose frames, computed
after a restore of quantized KV, are close to the cold run's (the quality verdict the synthetic
runtime cannot give: its KV scrambles on any change, by design)."""

from __future__ import annotations

import pytest

from cacheseek.cli import run


@pytest.mark.slow
def test_lossless_gate_is_bit_exact_on_the_real_pipeline(compose_cfg, tmp_path):
    results = run(compose_cfg("runtime=telefuser", "+store=localdisk", f"store.root={tmp_path / 'kv'}",
                              "store.codec=lossless", "store.codec_device=cpu"), tmp_path / "run")
    assert results["passed"] and results["codec"]["lossy"] == []
    fh = results["frame_hashes"]
    assert fh["B"] == fh["A"] and fh["C"] == fh["D"]
    assert all(r["verdict"] == "ok" and "kv_psnr_db" not in r for r in results["ring_check"])


@pytest.mark.slow
def test_int4_quality_verdict_on_the_real_pipeline(compose_cfg, tmp_path):
    results = run(compose_cfg("runtime=telefuser", "+store=memory", "store.codec=int4", "store.codec_device=cpu",
                              "workload.min_psnr_db=40"), tmp_path / "run")
    q = results["frame_quality"]
    assert results["passed"] and results["codec"]["lossy"] == ["int4"]
    assert q["first_differing_chunk"] == 2 and q["min_psnr_db"] >= 40
    assert results["frame_hashes"]["C"] != results["frame_hashes"]["D"]  # lossy: not bit-exact, and said so
