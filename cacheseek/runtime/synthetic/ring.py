"""The synthetic runtime's KV ring write: a shift-left buffer with a pinned sink.

One layer's ring is a dict: ``k``, ``v`` of shape ``[1, kv_size, H, D]`` plus integer cursors
``global_end_index`` and ``local_end_index`` (tokens), as the TeleFuser LingBot-World runtime keeps
it (docs/design.md section 1). Each chunk is written once per denoising step and once more from
the clean latent; only the first write of a chunk advances the cursors (and shifts), so the final
contents are the clean rewrite.
"""

from __future__ import annotations


import torch

from cacheseek.errors import CacheSeekError, GeometryError
from cacheseek.kv.ring import append_tokens, shift_after_sink

__all__ = ["RingCursorError", "ring_write"]


class RingCursorError(CacheSeekError):
    """A KV write at a token position the ring's cursors do not allow (neither the next chunk nor
    a rewrite of the last one), or one that cannot fit after the sink: the cursors are corrupt."""


def ring_write(
    cache: dict, k: torch.Tensor, v: torch.Tensor, *, start_token: int, sink_tokens: int
) -> bool:
    """Write n tokens of K/V (`[1, n, H, D]`) for the chunk that starts at absolute token
    `start_token`, into one layer's ring `cache` (`k`, `v`: `[1, kv_size, H, D]`; int cursors).

    First call of a chunk (`start_token == global_end_index`): the cursors advance by n; if the
    ring would overflow, the tokens after the pinned sink (`sink_tokens`) shift left by the overflow
    and `local_end_index = kv_size`. Later calls for the same chunk
    (`start_token + n == global_end_index`) neither shift nor advance. Either way the tokens land at
    `[local_end - n, local_end)`. Returns True on a first call.
    """
    n = k.shape[1]
    g, le = cache["global_end_index"], cache["local_end_index"]
    size = cache["k"].shape[1]
    if start_token + n == g and n <= le:
        first = False
    elif start_token == g:
        first = True
        try:
            overflow, new_end = append_tokens(le, n, size, sink_tokens)
        except GeometryError as exc:
            raise RingCursorError(str(exc)) from None
        if overflow:
            for name in ("k", "v"):
                shift_after_sink(cache[name], le, overflow, sink_tokens)
        le = new_end
        cache["global_end_index"] = start_token + n
        cache["local_end_index"] = le
    else:
        raise RingCursorError(f"write of {n} tokens at {start_token}: global_end_index is {g}, local_end_index {le}")
    cache["k"][:, le - n : le] = k
    cache["v"][:, le - n : le] = v
    return first
