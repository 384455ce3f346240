"""Copying one blob or one latent from a level of a tiered store into another (`copy_blob`,
`copy_latent`), the step that both promotion (`promote`, into level 0) and demotion (into a level
below) take.

Between two path levels that can (``copy_values_from``: Plan-style levels over one transfer
runtime) the values are copied in one batch; otherwise they are read from the source level layer
by layer and written to the destination (moved to its device when it is a path level). The
record is updated by the caller; these functions only move values.

Promotion: after a restore served by a lower level, the path is copied into level 0 so that the
next restore is served from the top. Latents come from the restore's latent targets. Chunks lying whole in the restored ring go
straight from the ring when level 0 is a path level (device to device, no second read of the
lower level); the others are copied from the serving level (`copy_blob`). A promotion that fails
or finds no room is counted and changes nothing else: the restore has succeeded.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from cacheseek.errors import StoreError, StoreFullError
from cacheseek.kv.handles import BlobHandle, ChunkNode
from cacheseek.kv.locators import blob_keys
from cacheseek.stores.base import RestoreTarget
from cacheseek.stores.tiered.generic_level import as_tensors, device_of
from cacheseek.stores.tiered.residency import Copies, Residency

__all__ = ["copy_blob", "copy_latent", "promote"]

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
        layers.append(as_tensors(value))
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
                value = as_tensors(value)
                b.store.put_skeleton(loc, value.to(device_of(b.store)) if b.path else value.to("cpu", copy=True))
    except Exception as exc:  # noqa: BLE001 - the KV is demoted; the latent may follow later
        log.warning("tiered store: latent %s not copied into %s: %s", loc, b.name, exc)
        return
    if done:
        book.add_latent(loc, dst)


def _to(value: Any, device: Any) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def promote(book: Residency, src: int, path: list[ChunkNode], window: list[ChunkNode], recs: list[Copies],
            target: RestoreTarget) -> None:
    """Copy the path just restored from level ``src`` (``target``: the filled restore target)
    into level 0; ``recs`` are the window's records. Never raises; stops at the first failure."""
    top = book.levels[0]
    whole = {r.chunk_depth: r.dst_token for r in target.runs
             if r.src_token == 0 and r.n_tokens == target.chunk_tokens}
    for node, lat in zip(path, target.latents):
        loc = node.skeleton.latent_locator
        if 0 in book.latent_levels(loc):
            continue
        try:
            top.store.put_skeleton(loc, lat if top.path else lat.to("cpu", copy=True))
            book.add_latent(loc, 0)
        except Exception as exc:  # noqa: BLE001 - counted; the restore stands
            _failed(book, exc, loc)
            return
    for node, rec in zip(window, recs):
        with book.lock:
            if 0 in rec.at:
                continue
        try:
            if node.depth in whole and top.path:
                start, n = whole[node.depth], target.chunk_tokens
                payload = [(k[:, start : start + n], v[:, start : start + n]) for k, v in target.kv]
                h = top.store.put_async(rec.outer.locator, payload, tier=top.tier)
                how = "ring"
            else:
                h = copy_blob(book, src, 0, rec)
                how = "tier"
        except Exception as exc:  # noqa: BLE001 - counted; the restore stands
            _failed(book, exc, rec.outer.locator)
            return
        if h is None:
            continue
        book.settle(rec, 0, h)
        book.count(0, promotions=1, promoted_bytes=rec.outer.nbytes, **{f"promotions_from_{how}": 1})


def _failed(book: Residency, exc: BaseException, what: str) -> None:
    if isinstance(exc, StoreFullError):
        book.count(0, promotion_full=1)
        log.info("tiered store: no room in %s to promote %s", book.levels[0].name, what)
    else:
        book.count(0, promotion_failures=1)
        log.warning("tiered store: promotion of %s failed: %s", what, exc)
