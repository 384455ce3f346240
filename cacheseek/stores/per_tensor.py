"""The per-tensor baseline (store ``per_tensor``): the path CacheSeek replaced, kept to measure
against in the same run.

It is a generic tier (`KeyValueTier` over the in-process `DictBackend`), so the binding hands it
what every generic tier gets, and the manager reads it the generic way:

- write: the binding copies each ring-tail tensor to an owned, pageable CPU tensor, one at a time
  (``tensor.to("cpu", copy=True)``, a synchronous device-to-host copy per tensor); ``put_async``
  then puts the 2 x n_layers values one at a time;
- read: the manager fetches every latent, then every layer's K and V of every window chunk, one
  value at a time (``get_skeleton`` / ``get_layer``); the binding copies each copy run and latent
  to the GPU one at a time (pageable host-to-device copies).

Nothing here is batched, pinned or overlapped, which is the point. It differs from the ``memory``
store only in name and intent (and its stats name it); both share `KeyValueTier` and the dict
backend. A put stores the caller's snapshot itself (no second copy into store memory), so this
baseline is, if anything, faster than the old path that also copied into a store's own memory.
"""

from __future__ import annotations

from typing import Optional

from cacheseek.registry import STORES
from cacheseek.stores.kv_tier import KeyValueTier
from cacheseek.stores.memory import DictBackend

__all__ = ["PerTensorTierStore"]


@STORES.register("per_tensor")
class PerTensorTierStore(KeyValueTier):
    """`KeyValueTier` over a `DictBackend`, named ``per_tensor`` (see the module docstring).
    ``write_back``/``queue_depth``/``capacity_bytes``: as `KeyValueTier` (write-back off: the old
    path was synchronous)."""

    def __init__(self, write_back: bool = False, queue_depth: int = 4, capacity_bytes: Optional[int] = None) -> None:
        super().__init__(DictBackend(), write_back=write_back, queue_depth=queue_depth, name="per_tensor",
                         capacity_bytes=capacity_bytes)

    def keys(self) -> list[str]:
        return self.backend.keys()
