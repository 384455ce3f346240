"""The A/B/C/D gate and the per-K ring check (docs/design.md section 5) through ``cacheseek.cli.run``
on composed configs: both generic tiers, full-length and rolling rings (S>0 and S=0), resume depths
before and after the ring rolls; plus negative controls that prove the checks can fail."""

from __future__ import annotations

import json

import pytest
import torch

from cacheseek.cli import run
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.kv.ring import RingGeometry
from cacheseek.runtime.geometry import get_geometry
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

TINY = get_geometry("tiny")

# (local_attn_size, sink_size, total_chunks, prefix_chunks)
RINGS = {
    "full": (-1, 0, 4, 2),
    "rolling_L7_S3": (7, 3, 5, 2),  # rolls at chunk 3: K=1,2 before, K=3,4 after
    "rolling_L6_S0": (6, 0, 5, 3),  # rolls at chunk 3; prefix restored after the roll
    "rolling_L5_S1": (5, 1, 4, 2),  # rolls at chunk 2
}


def overrides(ring: str, tier: str, tmp_path) -> list[str]:
    L, S, n, p = RINGS[ring]
    out = [f"runtime.local_attn_size={L}", f"runtime.sink_size={S}",
           f"workload.total_chunks={n}", f"workload.prefix_chunks={p}", "workload.ring_check=true"]
    if tier == "localdisk":
        out += ["+store=localdisk", f"store.root={tmp_path / 'kv'}"]
    return out


def rolled(L: int, S: int, k: int) -> bool:
    """Whether the ring has rolled (dropped a frame) after k chunks."""
    g = RingGeometry(chunk_size=TINY.chunk_size, frame_tokens=TINY.frame_tokens, local_attn_size=L,
                     sink_size=S)
    global_end, local_end = g.cursors(k)
    return local_end < global_end


@pytest.mark.parametrize("tier", ["memory", "localdisk"])
@pytest.mark.parametrize("ring", sorted(RINGS))
def test_gate_and_ring_check_pass(compose_cfg, tmp_path, ring, tier):
    L, S, n, p = RINGS[ring]
    cfg = compose_cfg(*overrides(ring, tier, tmp_path))
    results = run(cfg, tmp_path / "run")

    assert results["passed"] is True
    assert results["store"] == tier
    reqs = {r["name"]: r for r in results["requests"]}
    assert [reqs[x]["hit_depth"] for x in "ABCD"] == [0, n, p, 0]
    assert [reqs[x]["chunks_computed"] for x in "ABCD"] == [n, 0, n - p, n]
    assert all(r["verdict"] == "ok" for r in reqs.values())
    assert reqs["A"]["bytes_written"] > 0
    # B hands out every chunk's stored frames and never touches the ring; C restores its prefix
    # only where it computes (its served chunks, at the divergence)
    assert reqs["B"]["frames_served"] == n and reqs["B"]["bytes_restored"] == 0 and reqs["B"]["chunks_materialized"] == 0
    assert reqs["C"]["frames_served"] == p and reqs["C"]["chunks_materialized"] == p and reqs["C"]["bytes_restored"] > 0
    assert reqs["D"]["bytes_written"] == 0 and reqs["D"]["bytes_restored"] == 0
    fh = results["frame_hashes"]
    assert fh["B"] == fh["A"] and fh["C"] == fh["D"] and len(fh["A"]) == n
    assert fh["C"][:p] == fh["A"][:p] and fh["C"][p:] != fh["A"][p:]

    # Ring equality with a cold run at every resume depth K.
    rows = results["ring_check"]
    assert [r["K"] for r in rows] == list(range(1, n))
    assert all(r["verdict"] == "ok" and r["hit_depth"] == r["K"] and r["diff"] == [] for r in rows)
    if L != -1:  # the chosen depths span the ring before and after it rolls
        states = [rolled(L, S, r["K"]) for r in rows]
        assert False in states and True in states, states

    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["passed"] is True and on_disk["store"] == tier
    if tier == "localdisk":
        assert any((tmp_path / "kv").rglob("*%3Akv%3AL0%3Ak"))  # real files were written
        assert results["store_stats"]["failed_writes"] == 0


def test_rolling_experiments_pass(compose_cfg, tmp_path):
    for name in ("rolling_tiny", "rolling_nosink"):
        cfg = compose_cfg(f"+experiment={name}")
        results = run(cfg, tmp_path / name)
        n = cfg.workload.total_chunks
        assert results["passed"] is True, name
        assert [r["K"] for r in results["ring_check"]] == list(range(1, n))


# -- negative controls: one corrupted byte in a stored K tensor must be caught --------------------


def _flip(buf: torch.Tensor) -> None:
    """Flip the lowest mantissa bit of the last bf16 element (one byte; no NaN or Inf)."""
    buf.view(torch.uint8).reshape(-1)[-2] ^= 1


class CorruptingMemoryStore(InMemoryTierStore):
    """Corrupts one byte of layer 0's K of the ``target``-th blob written (in the store only)."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target
        self.puts_seen = 0

    def put_async(self, locator, payload, *, tier, on_ready=None):
        handle = super().put_async(locator, payload, tier=tier, on_ready=on_ready)
        if self.puts_seen == self.target:
            _flip(self.backend.read(layer_keys(locator, 0)[0]))
        self.puts_seen += 1
        return handle


class CorruptingDiskStore(LocalDiskTierStore):
    """Writes layer 0's K of the ``target``-th blob with one byte flipped before it is written,
    so the file's checksum and the chunk's record cover the wrong bytes: a writer bug, which only
    the gate can see (a flip on the medium, or bytes another writer put there, are caught by the
    checksums: tests/production/test_integrity.py)."""

    def __init__(self, root, target: int) -> None:
        super().__init__(root)
        self.target = target
        self.puts_seen = 0

    def put_async(self, locator, payload, *, tier, on_ready=None):
        if self.puts_seen == self.target:
            payload = [(k.clone(), v) if i == 0 else (k, v) for i, (k, v) in enumerate(payload)]
            _flip(payload[0][0])  # low byte of the last bf16 element
        self.puts_seen += 1
        return super().put_async(locator, payload, tier=tier, on_ready=on_ready)


@pytest.mark.parametrize("tier", ["memory", "localdisk"])
@pytest.mark.parametrize("ring", ["full", "rolling_L7_S3"])
def test_corrupted_byte_is_reported_as_mismatch(compose_cfg, tmp_path, capsys, ring, tier):
    L, S, n, p = RINGS[ring]
    cfg = compose_cfg(*overrides(ring, "memory", tmp_path))
    target = 1  # request A's chunk 1: inside the shared prefix and in every later window
    store = (CorruptingMemoryStore(target) if tier == "memory"
             else CorruptingDiskStore(tmp_path / "kv", target))
    results = run(cfg, tmp_path / "run", store=store)

    assert results["passed"] is False
    reqs = {r["name"]: r for r in results["requests"]}
    # B decodes A's latents (never the KV): still equal. C computes from the corrupted ring.
    assert reqs["A"]["verdict"] == "ok" and reqs["B"]["verdict"] == "ok"
    assert reqs["C"]["hit_depth"] == p and reqs["C"]["verdict"] == "MISMATCH"
    assert results["frame_hashes"]["C"][:p] == results["frame_hashes"]["D"][:p]
    assert results["frame_hashes"]["C"][p:] != results["frame_hashes"]["D"][p:]
    # Exactly the resume depths whose ring holds the corrupted frame (chunk 1's last token, frame
    # 5) differ from a cold run. (A frame the next chunk's write evicts before it is attended,
    # e.g. frame 3 at K=2 with L=7, S=3, fails the ring check but cannot change any output.)
    frame = (target + 1) * TINY.chunk_size - 1
    geo = RingGeometry(chunk_size=TINY.chunk_size, frame_tokens=TINY.frame_tokens,
                       local_attn_size=L, sink_size=S)
    rows = {r["K"]: r for r in results["ring_check"]}
    assert sorted(rows) == list(range(1, n))
    expected_bad = {k for k in rows if frame in geo.slot_frames(k)}
    assert 2 in expected_bad
    for k, row in rows.items():
        assert row["hit_depth"] == k
        if k in expected_bad:
            assert row["verdict"] == "MISMATCH", k
            assert row["diff"] == ["layer 0 k[:, :local_end] differs"], row["diff"]
        else:
            assert row["verdict"] == "ok" and row["diff"] == [], k
    if ring == "rolling_L7_S3":  # the corrupted frame rolled out of the window at the last depth
        assert n - 1 not in expected_bad
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAIL" in out and "PASS" not in out
