"""Removing a blob or a latent from every level of a tiered store (the manager's ``free`` and
``free_skeleton``).

Every level is tried even when one fails; a level whose removal failed keeps its copy, still
recorded (so a later ``free`` retries it), and the first error is raised after all were tried.
A blob with a write in flight at any level is refused (`WriteNotCompleteError`), nothing freed.
"""

from __future__ import annotations

from cacheseek.errors import WriteNotCompleteError
from cacheseek.kv.handles import BlobHandle
from cacheseek.stores.tiered.residency import Residency

__all__ = ["free_blob", "free_latent"]


def free_blob(book: Residency, handle: BlobHandle) -> None:
    """Remove the blob from every level (idempotent); see the module docstring."""
    rec = book.copies(handle)
    with book.lock:
        if handle.in_flight or any(h.in_flight for h in rec.at.values()):
            raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
        copies = dict(rec.at)
    errors: list[BaseException] = []
    for level, h in sorted(copies.items()):
        try:
            book.levels[level].store.free(h)
        except Exception as exc:  # noqa: BLE001 - raised below, the copy stays recorded
            errors.append(exc)
            continue
        with book.lock:
            rec.at.pop(level, None)
    with book.lock:
        book.refresh(rec)
        if not rec.at and book.blobs.get(handle.locator) is rec:
            del book.blobs[handle.locator]
    if errors:
        raise errors[0]


def free_latent(book: Residency, locator: str) -> None:
    """Remove a latent from every level that can (idempotent); see the module docstring."""
    errors: list[BaseException] = []
    for lv in book.levels:
        if not lv.store.frees_latents:
            continue
        try:
            lv.store.free_skeleton(locator)
        except Exception as exc:  # noqa: BLE001 - raised below, the copy stays recorded
            errors.append(exc)
            continue
        book.discard_latent(locator, lv.index)
    with book.lock:
        if not book.latents.get(locator, True):
            del book.latents[locator]
            book.probed.pop(locator, None)
    if errors:
        raise errors[0]
