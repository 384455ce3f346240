"""Values in and out of a generic level of a tiered store (a `TierStore` of owned CPU values).

Writing: a generic level keeps what it is given and the runtime overwrites its ring right after
the hook, so it gets one owned CPU snapshot of the chunk, made once for every generic level
(`cpu_snapshot`). Reading: `read_generic` fetches every latent and window layer first (nothing is
written when one is missing), then copies them into the restore targets byte for byte, run by
run. Values read from a Plan-style level without a template are raw bytes; `as_tensors` makes
them flat uint8 tensors. torch is imported only when a value is touched.
"""

from __future__ import annotations

from typing import Any

import torch

from cacheseek.errors import LayoutMismatchError
from cacheseek.kv.handles import ChunkNode
from cacheseek.stores.base import RestoreTarget

__all__ = ["cpu_snapshot", "as_tensors", "device_of", "bytes_view", "read_generic"]


def cpu_snapshot(layers: list, cache: list) -> list:
    """Owned CPU copies of ``layers`` (tensors; other objects as they are), made once: the first
    call fills ``cache``, later calls with the same ``cache`` return that snapshot."""
    if not cache:
        def own(x: Any) -> Any:
            return x.to("cpu", copy=True) if hasattr(x, "to") and hasattr(x, "data_ptr") else x

        cache.append([tuple(own(t) for t in layer) if isinstance(layer, tuple) else own(layer) for layer in layers])
    return cache[0]


def as_tensors(value: Any) -> Any:
    """A layer read from a level as tensors: raw bytes (a Plan-style level read without a
    template) become flat uint8 tensors; tensors stay as they are."""
    def one(x: Any) -> Any:
        if isinstance(x, (bytes, bytearray, memoryview)):
            return torch.frombuffer(bytearray(x), dtype=torch.uint8)
        return x

    return tuple(one(x) for x in value) if isinstance(value, tuple) else one(value)


def device_of(store: Any) -> Any:
    """Where a path level keeps its values: its ``device``, else its transfer runtime's kind."""
    if store.device is not None:
        return store.device
    return "cuda" if store.transfer is not None and store.transfer.device_kind == "cuda" else "cpu"


def bytes_view(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def read_generic(store: Any, path: list[ChunkNode], window: list[ChunkNode], target: RestoreTarget) -> bool:
    """Restore from a generic level: every latent and window layer fetched first (any missing:
    False, nothing written), then copied into the targets byte for byte, run by run. A value
    whose size differs from its target is a `LayoutMismatchError`, raised before any copy."""
    latents = []
    for n, dst in zip(path, target.latents):
        lat = store.get_skeleton(n.skeleton.latent_locator)
        if lat is None:
            return False
        if _nbytes(lat) != _nbytes(dst):
            raise LayoutMismatchError(f"latent {n.skeleton.latent_locator} holds {_nbytes(lat)} B, its target "
                                      f"takes {_nbytes(dst)} B")
        latents.append(lat)
    value_nbytes = target.chunk_value_nbytes
    layers: dict[int, list] = {}
    for n in window:
        per = []
        for layer in range(target.n_layers):
            kv = store.get_layer(n.blob, layer)
            if kv is None or kv[0] is None or kv[1] is None:
                return False
            kv = as_tensors(kv)
            for t in kv:
                if _nbytes(t) != value_nbytes:
                    raise LayoutMismatchError(f"{n.blob.locator} layer {layer}: {_nbytes(t)} B, the ring "
                                              f"takes {value_nbytes} B a chunk")
            per.append(kv)
        layers[n.depth] = per
    for lat, dst in zip(latents, target.latents):
        bytes_view(dst).copy_(bytes_view(lat).to(dst.device))
    tb = target.token_bytes
    for layer, (k_ring, v_ring) in enumerate(target.kv):
        rings = (k_ring.view(-1).view(torch.uint8), v_ring.view(-1).view(torch.uint8))
        for run in target.runs:
            src = layers[run.chunk_depth][layer]
            for ring, value in zip(rings, src):
                ring[run.dst_token * tb : (run.dst_token + run.n_tokens) * tb].copy_(
                    bytes_view(value)[run.src_token * tb : (run.src_token + run.n_tokens) * tb].to(ring.device))
    return True


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())
