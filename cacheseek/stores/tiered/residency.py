"""What each level of a tiered store holds: the record every role of the store reads and updates.

Per blob, a `Copies` record: the outer handle the trie sees (`TieredHandle`) and, per level, that
level's own handle. Per latent, the set of levels holding it (and the levels already asked about
a latent this store did not write). One re-entrant lock guards all of it.

Lifecycle of one level's copy of a blob::

    written (that level's put_async) --> PENDING: recorded in ``at``, the record in ``pending``
    PENDING --(the level's on_ready: `on_level_ready`)--> READY: counted as a write; the first
        ready copy makes the outer handle ready and calls its on_ready, once
    PENDING --(the write failed; seen by `reap`)--> dropped from ``at`` (it stored nothing); the
        outer handle fails when no copy is left and it never turned ready
    READY --(free, demotion, a miss its level no longer confirms)--> dropped from ``at``

The outer handle's ``tier`` is the nearest level holding a ready copy, ``tiers`` every such
level's, nearest first (`refresh`). A blob known only from a forest snapshot (a plain
`BlobHandle`) is located on first use by asking each level's ``contains`` (`copies`).

Removal (`free_blob`, `free_latent`: the manager's ``free`` and ``free_skeleton``): every level is tried even when one fails; a level whose removal failed keeps its copy, still
recorded (so a later ``free`` retries it), and the first error is raised after all were tried.
A blob with a write in flight at any level is refused (`WriteNotCompleteError`), nothing freed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import attrs

from cacheseek.errors import WriteNotCompleteError
from cacheseek.kv.handles import BlobHandle, BlobState
from cacheseek.kv.locators import blob_keys
from cacheseek.stores.tiered.levels import Level

__all__ = ["Copies", "Residency", "TieredHandle", "free_blob", "free_latent", "latent_of"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TieredHandle(BlobHandle):
    """A blob of a `TieredStore`: ``tier`` is the `Tier` of the nearest level holding a ready
    copy, ``tiers`` those of every level holding one, nearest first (kept by the store)."""

    tiers: tuple = field(default=())


@attrs.define(eq=False)
class Copies:
    """What the levels hold of one blob: level -> that level's handle (pending, ready or failed)."""

    outer: BlobHandle
    at: dict = attrs.field(factory=dict)
    on_ready: Optional[Callable[[BlobHandle], None]] = None
    notified: bool = False


def latent_of(kv_locator: str) -> Optional[str]:
    """The latent key of the chunk whose KV locator is ``{hex}:kv``."""
    return kv_locator[: -len(":kv")] + ":lat" if kv_locator.endswith(":kv") else None


class _Served(threading.local):
    """``name``: the level that served this thread's last read_path (None: none)."""

    name: Optional[str] = None


class Residency:
    """The record of what ``levels`` hold. ``blobs`` (locator -> `Copies`), ``latents`` (latent
    -> levels holding it), ``probed`` (latent -> levels asked), ``pending`` (records with a write
    in flight, by id) and the counters are guarded by ``lock``; ``count`` adds to the store's
    totals (``level=None``) or to one level's counters."""

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = list(levels)
        self.lock = threading.RLock()
        self.served = _Served()
        self.blobs: dict[str, Copies] = {}
        self.latents: dict[str, set] = {}
        self.probed: dict[str, set] = {}  # latents this store did not write
        self.pending: dict[int, Copies] = {}
        self.counters: dict[str, Any] = {}
        # the last level's copy of a blob turned ready (the tier other processes share): `TieredRecords`
        self.on_shared_copy: Callable[[BlobHandle], None] = lambda handle: None

    def count(self, level: Optional[int] = None, **deltas: Any) -> None:
        with self.lock:
            target = self.counters if level is None else self.levels[level].counters
            for k, v in deltas.items():
                target[k] = target.get(k, 0) + v

    # -- blobs ----------------------------------------------------------------------------------
    def copies(self, handle: BlobHandle) -> Copies:
        """The record of ``handle``'s blob; a blob known only from a snapshot is located now."""
        with self.lock:
            rec = self.blobs.get(handle.locator)
            if rec is not None:
                return rec
        keys = blob_keys(handle.locator, handle.n_layers, pairs=handle.pairs)
        rec = Copies(handle)
        for lv in self.levels:
            try:
                whole = lv.store.knows_contents and all(lv.store.contains(keys))
            except Exception as exc:  # noqa: BLE001 - cannot tell: not held there
                log.warning("tiered store: %s cannot say whether it holds %s: %s", lv.name, handle.locator, exc)
                whole = False
            if whole:
                rec.at[lv.index] = BlobHandle(lv.tier, handle.locator, handle.nbytes, handle.n_layers,
                                              ready=True, pairs=handle.pairs)
        with self.lock:
            rec = self.blobs.setdefault(handle.locator, rec)
            self.refresh(rec)
        return rec

    def refresh(self, rec: Copies) -> None:
        """Under the lock: the outer handle's ``tier``/``tiers`` from the ready copies."""
        ready = sorted(i for i, h in rec.at.items() if h.ready)
        tiers = tuple(self.levels[i].tier for i in ready)
        if ready:
            rec.outer.tier = tiers[0]
        if isinstance(rec.outer, TieredHandle):
            rec.outer.tiers = tiers

    def levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels holding a ready copy of ``handle``'s blob, nearest first."""
        rec = self.copies(handle)
        with self.lock:
            return tuple(sorted(i for i, h in rec.at.items() if h.ready))

    def pending_levels_of(self, handle: BlobHandle) -> tuple[int, ...]:
        """The levels whose write of ``handle``'s blob is still in flight."""
        rec = self.copies(handle)
        with self.lock:
            return tuple(sorted(i for i, h in rec.at.items() if h.in_flight))

    def settle(self, rec: Copies, level: int, handle: BlobHandle) -> None:
        """Record ``level``'s new copy of a blob (a write, a promotion or a demotion): tracked as
        pending while in flight, the outer handle refreshed."""
        with self.lock:
            rec.at[level] = handle
            if handle.in_flight:
                self.pending[id(rec)] = rec
            self.refresh(rec)
        if handle.ready and level == len(self.levels) - 1:
            self.on_shared_copy(handle)

    def drop(self, rec: Copies, level: int) -> None:
        """``level`` no longer holds the blob."""
        with self.lock:
            rec.at.pop(level, None)
            self.refresh(rec)

    def reap(self) -> None:
        """Settle writes that finished since the last look: a failed level's copy is dropped
        from the record (it stored nothing); an outer handle whose every copy failed fails."""
        with self.lock:
            pending, self.pending = self.pending, {}
            for rec in pending.values():
                for i, h in list(rec.at.items()):
                    if h.state is BlobState.FAILED:
                        del rec.at[i]
                        self.levels[i].counters["write_failures"] = self.levels[i].counters.get("write_failures", 0) + 1
                        log.warning("tiered store: write of %s to %s failed: %s", rec.outer.locator,
                                    self.levels[i].name, h.error)
                        if rec.outer.error is None and not rec.outer.ready and not rec.at:
                            rec.outer.fail(h.error)
                if any(h.in_flight for h in rec.at.values()):
                    self.pending[id(rec)] = rec
                if not rec.at and self.blobs.get(rec.outer.locator) is rec:
                    del self.blobs[rec.outer.locator]
                self.refresh(rec)

    def on_level_ready(self, rec: Copies, level: int, handle: Optional[BlobHandle]) -> None:
        """A level's write of the blob completed: its copy turns ready; the first ready copy
        makes the outer handle ready and calls its ``on_ready`` (outside the lock, once)."""
        notify = None
        with self.lock:
            h = handle if handle is not None else rec.at.get(level)
            if h is not None:
                h.publish()
                rec.at[level] = h
            self.count(level, writes=1, write_bytes=rec.outer.nbytes)
            self.refresh(rec)
            if not rec.notified and rec.outer.error is None:
                rec.notified = True
                rec.outer.publish()
                notify = rec.on_ready
        if notify is not None:
            notify(rec.outer)
        if h is not None and level == len(self.levels) - 1:
            self.on_shared_copy(h)

    def ready_counts(self) -> list[int]:
        """The number of ready copies each level holds."""
        with self.lock:
            counts = [0] * len(self.levels)
            for rec in self.blobs.values():
                for i, h in rec.at.items():
                    counts[i] += bool(h.ready)
        return counts

    # -- latents --------------------------------------------------------------------------------
    def latent_levels(self, locator: str) -> tuple[int, ...]:
        with self.lock:
            return tuple(sorted(self.latents.get(locator, ())))

    def add_latent(self, locator: str, *levels: int) -> None:
        with self.lock:
            self.latents.setdefault(locator, set()).update(levels)

    def discard_latent(self, locator: str, level: int) -> None:
        with self.lock:
            self.latents.get(locator, set()).discard(level)


def free_blob(book: Residency, handle: BlobHandle) -> None:
    """Remove the blob from every level (idempotent; removal: the module docstring)."""
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
