"""Write-through in a tiered store: one chunk's KV, one latent.

A chunk (`put_chunk`)::

    the first level that has room takes the chunk (a level that refuses with `StoreFullError` is
    skipped; the manager's next demotion pass makes room there), then, with ``write_through``,
    every level below it, each through its own put_async (the Plan tier overlaps its copies with
    compute as always; a generic level gets one owned CPU snapshot, shared by all of them)
    the outer handle turns ready (on_ready called once) when the first level's copy is ready;
    it fails only when every level's write failed; a level whose write failed holds nothing

A latent (`put_latent`) goes to every level that has room: latents are small and every level's
restore reads the whole path's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

from cacheseek.errors import StoreError, StoreFullError
from cacheseek.kv.handles import BlobHandle, kv_pairs
from cacheseek.kv.payload import layer_nbytes
from cacheseek.stores.tiered.demotion import drop_latent
from cacheseek.stores.tiered.generic_level import cpu_snapshot
from cacheseek.stores.tiered.residency import Copies, Residency, TieredHandle, latent_of

__all__ = ["put_chunk", "put_latent"]

log = logging.getLogger(__name__)


def put_chunk(book: Residency, locator: str, payload: Sequence[Any], *, write_through: bool,
              on_ready: Optional[Callable[[BlobHandle], None]] = None, stream: Any = None) -> TieredHandle:
    """Write one chunk (see the module docstring); the PENDING or READY outer handle. Raises
    `StoreFullError` when no level has room, a `StoreError` when every level refused."""
    layers = list(payload)
    nbytes = sum(layer_nbytes(layer) for layer in layers)
    outer = TieredHandle(book.levels[0].tier, locator, nbytes, len(layers), pairs=kv_pairs(layers))
    rec = Copies(outer, on_ready=on_ready)
    with book.lock:
        book.blobs[locator] = rec
    cpu: list = []  # one owned CPU snapshot for every generic level
    errors: list[BaseException] = []
    for lv in book.levels:
        if rec.at and not write_through:
            break
        try:
            data = layers if lv.path else cpu_snapshot(layers, cpu)
            kwargs = {"stream": stream} if lv.path and stream is not None else {}
            h = lv.store.put_async(locator, data, tier=lv.tier,
                                   on_ready=lambda h, lv=lv: book.on_level_ready(rec, lv.index, h), **kwargs)
        except StoreFullError as exc:
            book.count(lv.index, full_skips=1)
            errors.append(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - the next level may still take it
            book.count(lv.index, write_failures=1)
            log.warning("tiered store: write of %s to %s failed: %s", locator, lv.name, exc)
            errors.append(exc)
            continue
        with book.lock:
            if h is None:
                h = BlobHandle(lv.tier, locator, nbytes, len(layers), pairs=outer.pairs)
            rec.at.setdefault(lv.index, h)  # on_ready may have recorded it already
            if h.in_flight:
                book.pending[id(rec)] = rec
            book.refresh(rec)
    with book.lock:
        if not rec.at:
            del book.blobs[locator]
            outer.fail(errors[-1] if errors else StoreError(f"{locator}: no tier took it"))
    if outer.error is None:
        for level in range(min(rec.at)):  # levels that refused the KV need not keep its latent
            drop_latent(book, level, latent_of(locator))
    if outer.error is not None:
        if all(isinstance(e, StoreFullError) for e in errors):
            raise StoreFullError(f"no tier has room for {locator} ({nbytes} B): "
                                 + "; ".join(str(e) for e in errors))
        raise StoreError(f"every tier refused {locator}: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors))
    book.count(puts=1)
    return outer


def put_latent(book: Residency, locator: str, latent: Any, *, stream: Any = None) -> None:
    """Write a latent to every level that has room. Raises `StoreFullError` when every level
    was full, a `StoreError` when no level took it for another reason."""
    took: set = set()
    errors: list[BaseException] = []
    cpu: list = []
    for lv in book.levels:
        try:
            if lv.path:
                if stream is not None:
                    lv.store.put_skeleton(locator, latent, stream=stream)
                else:
                    lv.store.put_skeleton(locator, latent)
            else:
                lv.store.put_skeleton(locator, cpu_snapshot([latent], cpu)[0])
            took.add(lv.index)
        except Exception as exc:  # noqa: BLE001 - other levels may take it
            if not isinstance(exc, StoreFullError):
                log.warning("tiered store: latent %s not written to %s: %s", locator, lv.name, exc)
            errors.append(exc)
    if not took:
        if errors and all(isinstance(e, StoreFullError) for e in errors):
            raise StoreFullError(f"no tier has room for latent {locator}")
        raise StoreError(f"every tier refused latent {locator}: {errors[-1] if errors else '?'}")
    with book.lock:
        book.latents.setdefault(locator, set()).update(took)
        book.probed[locator] = set(range(len(book.levels)))  # every level was tried
