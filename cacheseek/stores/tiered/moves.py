"""Copying one blob or one latent from a level of a tiered store into another, the step that both
promotion (into level 0) and demotion (into a level below) take.

Between two path levels that can (``copy_values_from``: Plan-style levels over one transfer
runtime) the values are copied in one batch; otherwise they are read from the source level layer
by layer and written to the destination (moved to its device when it is a path level). The
record is updated by the caller; these functions only move values.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from cacheseek.errors import StoreError, StoreFullError
from cacheseek.kv.handles import BlobHandle
from cacheseek.kv.locators import blob_keys
from cacheseek.stores.tiered.generic_level import as_tensors, device_of
from cacheseek.stores.tiered.residency import Copies, Residency

__all__ = ["copy_blob", "copy_latent"]

log = logging.getLogger(__name__)


def copy_blob(book: Residency, src: int, dst: int, rec: Copies) -> Optional[BlobHandle]:
    """Write level ``src``'s copy of a blob into level ``dst``; the new (ready) handle, or None
    when ``src`` no longer holds it. Raises on failure, having written nothing (`StoreFullError`
    when ``dst`` has no room)."""
    a, b = book.levels[src], book.levels[dst]
    h = rec.at.get(src)
    if h is None or not h.ready:
        return None
    outer = rec.outer
    keys = blob_keys(outer.locator, outer.n_layers, pairs=outer.pairs)
    if a.store.copies_values and b.store.copies_values:
        size = outer.nbytes // len(keys)
        if b.store.copy_values_from(a.store, keys, [size] * len(keys)) is None:
            return None
        return BlobHandle(b.tier, outer.locator, outer.nbytes, outer.n_layers, ready=True, pairs=outer.pairs)
    layers = []
    for layer in range(outer.n_layers):
        value = a.store.get_layer(h, layer)
        if value is None:
            return None
        layers.append(value)
    layers = [as_tensors(v, outer.nbytes // max(1, len(keys))) for v in layers]
    device = device_of(b.store) if b.path else "cpu"  # a generic level takes CPU values (a codec's decode may run on a GPU)
    layers = [tuple(_to(t, device) for t in layer) if isinstance(layer, tuple) else _to(layer, device)
              for layer in layers]
    out = b.store.put_async(outer.locator, layers, tier=b.tier)
    if out is None or not out.ready:
        b.store.flush()
    if out is not None and not out.ready:
        kind = StoreFullError if isinstance(out.error, StoreFullError) else StoreError
        raise kind(f"copy of {outer.locator} into {b.name} failed: {out.error}")
    return out


def copy_latent(book: Residency, src: int, dst: int, loc: Optional[str]) -> None:
    """Give level ``dst`` the latent ``loc`` from level ``src`` when it lacks it (a chunk
    demoted into a level that was full when the latent was written); failures are logged."""
    if loc is None or dst in book.latent_levels(loc) or src not in book.latent_levels(loc):
        return
    a, b = book.levels[src], book.levels[dst]
    try:
        if a.store.copies_values and b.store.copies_values:
            done = b.store.copy_values_from(a.store, [loc]) is not None
        else:
            value = a.store.get_skeleton(loc)
            done = value is not None
            if done:
                value = as_tensors(value, 0)
                b.store.put_skeleton(loc, value.to(device_of(b.store)) if b.path else value.to("cpu", copy=True))
    except Exception as exc:  # noqa: BLE001 - the KV is demoted; the latent may follow later
        log.warning("tiered store: latent %s not copied into %s: %s", loc, b.name, exc)
        return
    if done:
        book.add_latent(loc, dst)


def _to(value: Any, device: Any) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value
