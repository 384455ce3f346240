"""Demotion in a tiered store: dropping an upper level's copy of a blob (or a latent) while a
level below keeps one.

Which blobs to demote is the manager's decision (`cacheseek.eviction`): per upper level whose
usage is above the high watermark, leaf-first LRU among the nodes held at that level. Each victim
goes through `demote`: when no level below holds a ready copy, one is written first, into the
nearest level that takes it (if every write fails the copy stays: nothing is lost); then the
level's copy is freed, and its latent too once a level below holds it (`drop_latent`).
"""

from __future__ import annotations

import logging
from typing import Optional

from cacheseek.kv.handles import BlobHandle
from cacheseek.stores.tiered.moves import copy_blob, copy_latent
from cacheseek.stores.tiered.residency import Residency, latent_of

__all__ = ["demote", "drop_latent"]

log = logging.getLogger(__name__)


def demote(book: Residency, handle: BlobHandle, level: int) -> bool:
    """Drop ``level``'s copy of a blob, keeping (or first writing) a ready copy in a level
    below. False when ``level`` does not hold it, a write is in flight, it is the last
    level's only copy (that is eviction, not demotion) or no level below could take it
    (then nothing changed: nothing is lost). Raises when freeing the copy fails (kept)."""
    rec = book.copies(handle)
    with book.lock:
        h = rec.at.get(level)
        if h is None or not h.ready or any(x.in_flight for x in rec.at.values()):
            return False
        below = [i for i, x in rec.at.items() if i > level and x.ready]
    if not below:
        for dst in range(level + 1, len(book.levels)):
            try:
                out = copy_blob(book, level, dst, rec)
            except Exception as exc:  # noqa: BLE001 - try the next level down
                book.count(level, demotion_failures=1)
                log.warning("tiered store: demoting %s from %s into %s failed: %s", handle.locator,
                            book.levels[level].name, book.levels[dst].name, exc)
                continue
            if out is not None:
                book.settle(rec, dst, out)
                book.count(dst, demoted_in=1)
                copy_latent(book, level, dst, latent_of(handle.locator))
                below = [dst]
                break
        if not below:
            return False
    book.levels[level].store.free(h)
    book.drop(rec, level)
    book.count(level, demotions=1, demoted_bytes=handle.nbytes)
    drop_latent(book, level, latent_of(handle.locator))
    return True


def drop_latent(book: Residency, level: int, loc: Optional[str]) -> None:
    """Free ``level``'s copy of a latent whose chunk's KV it no longer holds, once a level
    below holds the latent too (a restore from ``level`` reads the whole path's latents; a
    promotion puts back the ones it lacks). Failures are logged: the latent stays."""
    if loc is None or level not in book.latent_levels(loc):
        return
    if not any(i > level for i in book.latent_levels(loc)):
        for dst in range(level + 1, len(book.levels)):
            copy_latent(book, level, dst, loc)
            if dst in book.latent_levels(loc):
                break
        else:
            return
    fn = getattr(book.levels[level].store, "free_skeleton", None)
    if not callable(fn):
        return
    try:
        fn(loc)
    except Exception as exc:  # noqa: BLE001 - kept; freed with the chunk later
        log.warning("tiered store: latent %s not freed from %s: %s", loc, book.levels[level].name, exc)
        return
    book.discard_latent(loc, level)
