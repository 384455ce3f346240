"""Demotion in a tiered store: dropping an upper level's copy of a blob (or a latent) while a
level below keeps one.

Which blobs to demote is the manager's decision (`cacheseek.eviction`): per upper level whose
usage is above the high watermark, leaf-first LRU among the nodes held at that level. Each victim
goes through `demote`::

    a level below holds a ready copy --> free this level's copy (and its latent, `drop_latent`)
    none does --> write one into the nearest level that takes it, then free this level's copy:
        the level is full (`StoreFullError`) and the caller gave ``make_room``
            --> make_room(level below, bytes): the manager moves victims out of that level
                (leaf-first LRU there: demoted further down, or evicted from the lowest level)
                and says how many left; at least one --> the write is retried once
        the write (or its retry) fails --> the next level down is tried
        no level took it --> False: nothing changed, the copy stays (nothing is lost);
            counted as ``demotion_failures`` (``demotion_no_room`` when the level was full)

The store moves bytes only: which victims leave a full level is the manager's choice, since the
trie knows which nodes are held where and which are in use. `evict_copy` is the store's part of
evicting a victim from the lowest level while another level keeps a copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional

from cacheseek.errors import StoreFullError
from cacheseek.kv.handles import BlobHandle
from cacheseek.stores.tiered.moves import copy_blob, copy_latent
from cacheseek.stores.tiered.residency import Copies, Residency, latent_of

__all__ = ["MakeRoom", "demote", "drop_latent"]

# make_room(level, nbytes) -> how many blobs left ``level`` to make room there for ``nbytes``.
MakeRoom = Callable[[int, int], int]

log = logging.getLogger(__name__)


def demote(book: Residency, handle: BlobHandle, level: int, make_room: Optional[MakeRoom] = None) -> bool:
    """Drop ``level``'s copy of a blob, keeping (or first writing) a ready copy in a level
    below; a full level below is asked for room through ``make_room`` (see the module
    docstring). False when ``level`` does not hold it, a write is in flight, it is the last
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
            out = _write_below(book, level, dst, rec, make_room)
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


def _write_below(book: Residency, level: int, dst: int, rec: Copies,
                 make_room: Optional[MakeRoom]) -> Optional[BlobHandle]:
    """``level``'s copy of a blob written into ``dst`` (a ready handle), or None with nothing
    written: ``level`` no longer holds it, or the write failed (counted at ``level``). A full
    ``dst`` is made room in by ``make_room`` and the write retried once."""
    try:
        return copy_blob(book, level, dst, rec)
    except StoreFullError as exc:
        error: BaseException = exc
    except Exception as exc:  # noqa: BLE001 - the caller tries the next level down
        _failed(book, level, dst, rec, exc)
        return None
    moved = 0
    if make_room is not None:
        try:
            moved = make_room(dst, rec.outer.nbytes)
        except Exception as exc:  # noqa: BLE001 - no room made; the copy stays
            log.warning("tiered store: making room in %s failed: %s", book.levels[dst].name, exc)
    if moved:
        book.count(dst, evictions_for_demotion=moved)
        try:
            return copy_blob(book, level, dst, rec)
        except Exception as exc:  # noqa: BLE001 - retried once; the caller tries the next level
            error = exc
    _failed(book, level, dst, rec, error)
    return None


def _failed(book: Residency, level: int, dst: int, rec: Copies, exc: BaseException) -> None:
    full = isinstance(exc, StoreFullError)
    book.count(level, demotion_failures=1, **({"demotion_no_room": 1} if full else {}))
    log.log(logging.INFO if full else logging.WARNING, "tiered store: demoting %s from %s into %s failed: %s",
            rec.outer.locator, book.levels[level].name, book.levels[dst].name, exc)


def evict_copy(book: Residency, handle: BlobHandle, level: int) -> bool:
    """Free ``level``'s copy of a blob while another level keeps a ready one (the manager
    evicting a victim from the lowest level to make room there; a sole copy is evicted through
    ``free``, which the trie claims). False when ``level`` holds no ready copy, no other level
    does, or a write is in flight. Raises when the free fails (the copy is kept, still recorded)."""
    rec = book.copies(handle)
    with book.lock:
        h = rec.at.get(level)
        if h is None or not h.ready or any(x.in_flight for x in rec.at.values()):
            return False
        if not any(x.ready for i, x in rec.at.items() if i != level):
            return False
    book.levels[level].store.free(h)
    book.drop(rec, level)
    book.count(level, evicted_copies=1, evicted_copy_bytes=handle.nbytes)
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
    store = book.levels[level].store
    if not store.frees_latents:
        return
    try:
        store.free_skeleton(loc)
    except Exception as exc:  # noqa: BLE001 - kept; freed with the chunk later
        log.warning("tiered store: latent %s not freed from %s: %s", loc, book.levels[level].name, exc)
        return
    book.discard_latent(loc, level)
