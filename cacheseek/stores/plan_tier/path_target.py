"""What a Plan-tier path read copies, decided before any Plan call: the path checked against the
runtime's `RestoreTarget` (`check_path`: a miss, or a layout mismatch), and the target's copy runs
as int64 arrays (`run_arrays`, cached per window shape: a runtime restores the same few shapes)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

from cacheseek.errors import LayoutMismatchError
from cacheseek.kv.handles import BlobHandle, ChunkNode
from cacheseek.kv.payload import RestoreTarget
from cacheseek.transfer.lazy import LazyModule

__all__ = ["check_path", "runs_as_arrays", "run_arrays"]

np = LazyModule("numpy")


def check_path(
    path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget
) -> Optional[tuple[list[str], list[BlobHandle]]]:
    """The path's latent keys and the window's blob handles; None on a miss (a node without
    latent or ready blob). Raises `LayoutMismatchError` when sizes, depths or runs disagree
    with the target."""
    n_layers, value_nbytes = target.n_layers, target.chunk_value_nbytes
    if n_layers == 0 or len(target.latents) != len(path):
        raise LayoutMismatchError(
            f"{len(target.latents)} latent targets and {n_layers} layers for a path of {len(path)}"
        )
    depths = [n.depth for n in window]
    if depths != list(target.window_depths):
        raise LayoutMismatchError(
            f"window depths {depths} differ from the target's {list(target.window_depths)}"
        )
    latent_keys = [n.skeleton.latent_locator for n in path if n.skeleton is not None]
    blobs = [n.blob for n in window if n.blob is not None and n.blob.ready]
    if len(latent_keys) != len(path) or len(blobs) != len(window):
        return None
    for blob in blobs:
        if blob.n_layers != n_layers or blob.nbytes != 2 * n_layers * value_nbytes:
            raise LayoutMismatchError(
                f"blob {blob.locator} holds {blob.n_layers} layers in {blob.nbytes} B; the "
                f"runtime expects {n_layers} layers of K and V of {value_nbytes} B each"
            )
    for run in target.runs:
        if run.chunk_depth not in depths or run.src_token + run.n_tokens > target.chunk_tokens:
            raise LayoutMismatchError(
                f"copy run {run} is outside the window or a {target.chunk_tokens}-token chunk"
            )
    return latent_keys, blobs


@functools.lru_cache(maxsize=64)
def runs_as_arrays(runs: tuple, window_depths: tuple, token_bytes: int) -> tuple:
    """A restore's runs as four read-only int64 arrays of length n_runs (window slot, source and
    destination byte offsets, bytes), cached per window shape: every restore of that shape shares them."""
    slot = {depth: j for j, depth in enumerate(window_depths)}
    tokens = np.array([(r.src_token, r.dst_token, r.n_tokens) for r in runs], dtype=np.int64).reshape(-1, 3)
    arrays = [np.array([slot[r.chunk_depth] for r in runs], dtype=np.int64)]
    arrays += [np.ascontiguousarray(tokens[:, i]) * token_bytes for i in range(3)]
    for a in arrays:
        a.flags.writeable = False  # shared by every restore of this shape
    return tuple(arrays)


def run_arrays(target: RestoreTarget) -> tuple:
    """``(window slot, source offset, ring offset, bytes)`` of each copy run of ``target``, int64
    ``[n_runs]`` each (cached: a runtime restores the same few shapes of window)."""
    return runs_as_arrays(tuple(target.runs), tuple(target.window_depths), int(target.token_bytes))
