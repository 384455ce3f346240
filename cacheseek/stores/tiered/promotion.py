"""Promotion in a tiered store: after a restore served by a lower level, the path is copied into
level 0 so that the next restore is served from the top.

Latents come from the restore's latent targets. Chunks lying whole in the restored ring go
straight from the ring when level 0 is a path level (device to device, no second read of the
lower level); the others are copied from the serving level (`copy_blob`). A promotion that fails
or finds no room is counted and changes nothing else: the restore has succeeded.
"""

from __future__ import annotations

import logging

from cacheseek.errors import StoreFullError
from cacheseek.kv.handles import ChunkNode
from cacheseek.stores.base import RestoreTarget
from cacheseek.stores.tiered.moves import copy_blob
from cacheseek.stores.tiered.residency import Copies, Residency

__all__ = ["promote"]

log = logging.getLogger(__name__)


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
