"""Reads in a tiered store: a whole path from the nearest level holding it, single values from
the nearest level holding them.

A restore of depth K (`read_path`): the nearest level that holds every latent of the path and the
KV of every window node restores it (a path level by its own ``read_path``, a generic level by
`read_generic`). A level that turns out to miss a value is skipped, its records that its
``contains`` no longer confirms are dropped, and the next level is tried; a level that fails with
a `CacheSeekError` is skipped too (the last such error is raised when no level served), a
`LayoutMismatchError` is raised at once. On a hit from a lower level, with ``promote``, the path
is copied into level 0 (`promote`). Latents this store did not write (a forest snapshot) are
looked up once per level by ``contains`` and recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Optional

from cacheseek.errors import CacheSeekError, LayoutMismatchError
from cacheseek.kv.handles import BlobHandle, ChunkNode
from cacheseek.kv.locators import blob_keys
from cacheseek.stores.base import RestoreTarget
from cacheseek.stores.tiered.generic_level import read_generic
from cacheseek.stores.tiered.moves import promote as promote_path
from cacheseek.stores.tiered.residency import Copies, Residency

__all__ = ["read_path", "get_latent", "get_layer", "contains"]

log = logging.getLogger(__name__)


def read_path(book: Residency, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget,
              *, promote: bool) -> bool:
    """Restore ``path`` (its ``window`` nodes' KV) into ``target`` from the nearest level
    holding all of it; then, with ``promote``, copy it into level 0. False when no level can."""
    path, window = list(path), list(window)
    book.served.name = None
    if any(n.blob is None or n.skeleton is None for n in window) or any(n.skeleton is None for n in path):
        return False
    recs = [book.copies(n.blob) for n in window]
    error: Optional[BaseException] = None
    for lv in book.levels:
        if not _holds_path(book, lv.index, path, recs):
            continue
        t0 = time.perf_counter()
        try:
            ok = (lv.store.read_path(path, window, target) if lv.path
                  else read_generic(lv.store, path, window, target))
        except LayoutMismatchError:
            raise
        except CacheSeekError as exc:  # a level's failure: the next one may serve
            log.warning("tiered store: restore from %s failed: %s", lv.name, exc)
            book.count(lv.index, read_errors=1)
            error = exc
            continue
        if not ok:
            book.count(lv.index, read_misses=1)
            _forget_missing(book, lv.index, path, window)
            continue
        book.count(lv.index, hits=1, hit_seconds=time.perf_counter() - t0)
        book.served.name = lv.name
        if lv.index > 0 and promote:
            promote_path(book, lv.index, path, window, recs, target)
        return True
    if error is not None:
        raise error
    return False


def _holds_path(book: Residency, level: int, path: list[ChunkNode], recs: list[Copies]) -> bool:
    with book.lock:
        if not all(level in book.latents.get(n.skeleton.latent_locator, ()) for n in path):
            if not _probe_latents(book, level, path):
                return False
        return all(rec.at.get(level) is not None and rec.at[level].ready for rec in recs)


def _probe_latents(book: Residency, level: int, path: list[ChunkNode]) -> bool:
    """Latents not recorded at ``level`` (a forest snapshot): ask the level, record them."""
    keys = [n.skeleton.latent_locator for n in path if level not in book.latents.get(n.skeleton.latent_locator, ())]
    store = book.levels[level].store
    if not store.knows_contents or any(level in book.probed.get(k, ()) for k in keys):
        return False  # asked before, or written here: recorded where it is
    try:
        present = store.contains(keys)
    except Exception:  # noqa: BLE001
        return False
    for k, ok in zip(keys, present):
        book.probed.setdefault(k, set()).add(level)
        if ok:
            book.latents.setdefault(k, set()).add(level)
    return all(present)


def _forget_missing(book: Residency, level: int, path: list[ChunkNode], window: list[ChunkNode]) -> None:
    """A level missed a value it was recorded to hold (lost behind our back): drop the
    records of that level that its ``contains`` no longer confirms."""
    store = book.levels[level].store
    if not store.knows_contents:
        return
    try:
        for n in window:
            if not all(store.contains(blob_keys(n.blob.locator, n.blob.n_layers, pairs=n.blob.pairs))):
                book.drop(book.copies(n.blob), level)
        for n in path:
            loc = n.skeleton.latent_locator
            if not all(store.contains([loc])):
                book.discard_latent(loc, level)
    except Exception as exc:  # noqa: BLE001 - records stay; the next read tries again
        log.warning("tiered store: could not check %s after a miss: %s", book.levels[level].name, exc)


def get_latent(book: Residency, locator: str, *args: Any, **kwargs: Any) -> Any:
    """The latent from the nearest level holding it (None when none does)."""
    for level in book.latent_levels(locator) or range(len(book.levels)):
        value = book.levels[level].store.get_skeleton(locator, *args, **kwargs)
        if value is not None:
            return value
    return None


def get_layer(book: Residency, handle: BlobHandle, layer: int, **kwargs: Any) -> Any:
    """One layer from the nearest level holding the blob (None when none does)."""
    for level in book.levels_of(handle):
        value = book.levels[level].store.get_layer(book.copies(handle).at[level], layer, **kwargs)
        if value is not None:
            return value
    return None


def contains(book: Residency, keys: Sequence[str]) -> list[bool]:
    """Which keys some level holds (a lost value in one level is served by another)."""
    keys = list(keys)
    out = [False] * len(keys)
    for lv in book.levels:
        if not lv.store.knows_contents:
            continue
        rest = [i for i, ok in enumerate(out) if not ok]
        if not rest:
            break
        for i, ok in zip(rest, lv.store.contains([keys[i] for i in rest])):
            out[i] = out[i] or bool(ok)
    return out
