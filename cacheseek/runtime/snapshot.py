"""What a restore must reproduce, captured and compared byte for byte (the per-K ring check).

`ring_snapshot(runtime)` works on any runtime with TeleFuser's attributes (the synthetic one and
the real LingBot-World-fast runtime): per layer ``k``/``v`` ``[:, :local_end]`` and both cursors,
and the generator state. `snapshot_diff` lists every difference; empty means equal. Torch is
imported inside the functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ring_snapshot", "same_bytes", "snapshot_diff"]


def ring_snapshot(runtime: Any, **extra: Any) -> dict:
    """Clones of the ring ``[:, :local_end]``, the int cursors of every layer and the generator
    state of ``runtime``, plus ``extra`` entries (not compared)."""
    return {
        "layers": [
            {
                "k": c["k"][:, : int(c["local_end_index"])].clone(),
                "v": c["v"][:, : int(c["local_end_index"])].clone(),
                "global_end_index": int(c["global_end_index"]),
                "local_end_index": int(c["local_end_index"]),
            }
            for c in runtime.self_kv_cache
        ],
        "generator_state": runtime.generator.get_state().clone(),
        **extra,
    }


def same_bytes(a: Any, b: Any) -> bool:
    """Equal shape, dtype and bytes (bit-exact, NaNs included)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a = a.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    b = b.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a, b))


def snapshot_diff(a: dict, b: dict) -> list[str]:
    """Byte-exact differences between two `ring_snapshot` results; empty when equal."""
    diffs: list[str] = []
    if len(a["layers"]) != len(b["layers"]):
        return [f"layer count {len(a['layers'])} != {len(b['layers'])}"]
    for i, (la, lb) in enumerate(zip(a["layers"], b["layers"])):
        for key in ("global_end_index", "local_end_index"):
            if la[key] != lb[key]:
                diffs.append(f"layer {i} {key}: {la[key]} != {lb[key]}")
        for key in ("k", "v"):
            if not same_bytes(la[key], lb[key]):
                diffs.append(f"layer {i} {key}[:, :local_end] differs")
    if not same_bytes(a["generator_state"], b["generator_state"]):
        diffs.append("generator state differs")
    return diffs
