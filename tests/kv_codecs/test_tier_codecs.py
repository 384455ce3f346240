"""Codecs in the generic tiers and the gate: values stored encoded and read back bit-exact
(lossless), a damaged encoded file read as a miss, the codec in the namespace fingerprint (chunks of
one codec never restored under another), the CLI gate bit-exact with ``lossless`` on memory and
LocalDisk, and with int8/int4 a PASS labelled lossy with its frame-quality verdict."""

from __future__ import annotations

import pytest
import torch

from cacheseek.cli import run
from cacheseek.errors import ConfigError
from cacheseek.kv.handles import Tier
from cacheseek.kv.locators import layer_keys
from cacheseek.namespace import FingerprintContext
from cacheseek.namespace import FINGERPRINT_FIELDS
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore


def payload(n_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [tuple((torch.randn(1, 256, 4, 32, generator=g) * 0.6).to(torch.bfloat16) for _ in range(2))
            for _ in range(n_layers)]


def make(kind: str, tmp_path, codec: str):
    if kind == "memory":
        return InMemoryTierStore(codec=codec, codec_device="cpu")
    return LocalDiskTierStore(tmp_path / f"kv-{codec}", codec=codec, codec_device="cpu", fsync=False)


@pytest.mark.parametrize("kind", ["memory", "localdisk"])
def test_lossless_values_are_stored_smaller_and_read_back_bit_exact(kind, tmp_path):
    layers = payload()
    used = {}
    for codec in ("none", "lossless"):
        store = make(kind, tmp_path, codec)
        try:
            h = store.put_async("ab:kv", layers, tier=Tier.CPU)
            assert h.ready
            for i, (k, v) in enumerate(layers):
                got = store.get_layer(h, i)
                assert torch.equal(got[0].view(torch.int16), k.view(torch.int16))
                assert torch.equal(got[1].view(torch.int16), v.view(torch.int16))
            used[codec] = store.usage().used_bytes
        finally:
            store.close()
    assert used["none"] / used["lossless"] >= 1.25


def test_a_damaged_encoded_file_is_a_miss(tmp_path):
    store = make("localdisk", tmp_path, "lossless")
    try:
        h = store.put_async("ab:kv", payload(1), tier=Tier.CPU)
        path = store.disk.path_of(layer_keys("ab:kv", 0)[1])
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x04  # a flipped bit in the encoded body (sign/mantissa plane)
        path.write_bytes(bytes(data))
        assert store.get_layer(h, 0) is None
        assert store.stats.corrupt_values == 1
        assert not path.exists()  # removed by the read that found it
    finally:
        store.close()


def test_a_value_of_another_codec_is_a_miss_not_kv(tmp_path):
    """The same key written raw, read by a lossless tier (as a shared root could offer it were the
    namespace not to separate them): a corrupt value, never KV."""
    raw = make("localdisk", tmp_path, "none")
    h = raw.put_async("ab:kv", payload(1), tier=Tier.CPU)
    raw.close()
    store = LocalDiskTierStore(tmp_path / "kv-none", codec="lossless", codec_device="cpu", fsync=False)
    try:
        assert store.get_layer(h, 0) is None
        assert store.stats.corrupt_values == 1
    finally:
        store.close()


def test_the_codec_is_a_fingerprint_field():
    field = FINGERPRINT_FIELDS.get("codec")
    values = {c: field.value(FingerprintContext(None, None, None, InMemoryTierStore(codec=c, codec_device="cpu")))
              for c in ("none", "lossless", "int8", "int4")}
    assert len(set(values.values())) == 4
    assert values["lossless"] == "lossless/v1"


def test_a_bad_codec_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="store.codec"):
        LocalDiskTierStore(tmp_path / "kv", codec="zstd")
    assert not (tmp_path / "kv").exists()  # refused before the root was made
    with pytest.raises(ConfigError, match="store.codec_device"):
        InMemoryTierStore(codec="lossless", codec_device="tpu")


@pytest.mark.parametrize("tier", ["memory", "localdisk"])
def test_gate_is_bit_exact_with_lossless(compose_cfg, tmp_path, tier):
    over = ["store.codec=lossless", "store.codec_device=cpu"]
    if tier == "localdisk":
        over = ["+store=localdisk", f"store.root={tmp_path / 'kv'}"] + over
    else:
        over = ["+store=memory"] + over
    results = run(compose_cfg(*over), tmp_path / "run")
    assert results["passed"] is True
    assert results["codec"] == {"fingerprint": "lossless/v1", "names": ["lossless"], "lossy": []}
    assert results["verdicts"] == {"hit_depth": True, "frame_hashes": True, "ring_check": True}
    assert all(r["frames"] == "ok" and "lossy" not in r["frames_vs"] for r in results["requests"])


def test_chunks_of_one_codec_are_never_restored_under_another(compose_cfg, tmp_path):
    root = tmp_path / "kv"
    first = run(compose_cfg("+store=localdisk", f"store.root={root}"), tmp_path / "run1")
    assert first["passed"]
    second = run(compose_cfg("+store=localdisk", f"store.root={root}", "store.codec=lossless",
                             "store.codec_device=cpu"), tmp_path / "run2")
    reqs = {r["name"]: r for r in second["requests"]}
    assert second["warm"] is True  # the root holds the first run's chunks ...
    assert reqs["A"]["hit_depth"] == 0  # ... none of which the lossless namespace finds
    assert second["passed"] is True


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_gate_reports_quality_for_lossy_codecs(compose_cfg, tmp_path, codec, capsys):
    results = run(compose_cfg("+store=memory", f"store.codec={codec}", "store.codec_device=cpu"), tmp_path / "run")
    assert results["codec"]["lossy"] == [codec]
    q = results["frame_quality"]
    n, p = 4, 2
    assert q["first_differing_chunk"] == p  # the first chunk computed on restored KV
    assert q["per_chunk_psnr_db"][:p] == [None] * p and all(x is not None for x in q["per_chunk_psnr_db"][p:])
    assert all(r["kv_psnr_db"] is not None and r["verdict"] == "ok" for r in results["ring_check"])
    assert results["verdicts"]["frame_hashes"] and results["verdicts"]["hit_depth"]
    assert results["passed"] is True  # no threshold: reported, not judged
    out = capsys.readouterr().out
    assert f"PASS (LOSSY codec {codec}" in out and "frame quality: reported" in out
    judged = run(compose_cfg("+store=memory", f"store.codec={codec}", "store.codec_device=cpu",
                             "workload.min_psnr_db=200"), tmp_path / "run2")
    assert judged["verdicts"]["frame_quality"] is False and judged["passed"] is False
    assert len(q["per_chunk_psnr_db"]) == n


@pytest.mark.parametrize("workload", ["interactive", "stress"])
def test_workloads_that_judge_bit_exactly_refuse_a_lossy_codec(compose_cfg, tmp_path, workload):
    with pytest.raises(ConfigError, match="store.codec: int4 is lossy"):
        run(compose_cfg(f"workload={workload}", "+store=memory", "store.codec=int4", "store.codec_device=cpu"),
            tmp_path / "run")


def test_interactive_sessions_pass_with_lossless(compose_cfg, tmp_path):
    results = run(compose_cfg("workload=interactive", "+store=memory", "store.codec=lossless",
                              "store.codec_device=cpu"), tmp_path / "run")
    assert results["passed"] and results["codec"]["names"] == ["lossless"]
