"""What a restore must reproduce, captured and compared byte for byte (the per-K ring check).

`ring_snapshot(runtime, layout)` works on any runtime a layout adapter knows (default ``bshd``:
the synthetic runtime and TeleFuser's hooked/released runtime; ``telefuser_main``: TeleFuser
main's session): per layer ``k``/``v`` ``[:, :local_end]`` and both cursors, and the state of
every RNG the layout says a restore must align (`RingLayout.rng_states`). `snapshot_diff` lists
every difference; empty means equal. Torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from cacheseek.layout.bshd import BshdLayout

__all__ = ["ring_snapshot", "same_bytes", "snapshot_diff"]


def ring_snapshot(runtime: Any, layout: Any = None, **extra: Any) -> dict:
    """Clones of the ring ``[:, :local_end]``, the int cursors of every layer and the RNG states
    of ``runtime`` as ``layout`` (default `BshdLayout`) finds them, plus ``extra`` entries (not
    compared)."""
    if layout is None:
        layout = BshdLayout()
    layers = []
    for (k, v), (global_end, local_end) in zip(layout.layers(runtime), layout.cursors(runtime)):
        layers.append({"k": k[:, :local_end].clone(), "v": v[:, :local_end].clone(),
                       "global_end_index": global_end, "local_end_index": local_end})
    rng = {name: state.clone() for name, state in layout.rng_states(runtime).items()}
    return {"layers": layers, "rng_states": rng, **extra}


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
    if sorted(a["rng_states"]) != sorted(b["rng_states"]):
        diffs.append(f"RNGs {sorted(a['rng_states'])} != {sorted(b['rng_states'])}")
    for name in sorted(set(a["rng_states"]) & set(b["rng_states"])):
        if not same_bytes(a["rng_states"][name], b["rng_states"][name]):
            diffs.append(f"{name} state differs")
    return diffs
