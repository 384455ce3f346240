"""`TieredRecords`: a tiered store's chunk records, the store of record's (its last level).

In a many-worker deployment the upper levels (HBM, an embedded Plan tier) are each process's own
L1, filled on hits; the last level (LocalDisk, Fluxon) is the tier every worker shares. So the
records are the last level's, and a chunk is made findable only once *that* level holds a ready
copy, with that copy's checksums: a record published when only a process-local level held the
chunk would send other workers to values they cannot read. `publish` therefore holds a record
back until the last level's copy is ready (its write-through completing, or a demotion writing it
there), then publishes it; a chunk the last level never gets stays this process's alone. Finding,
retracting and listing are the last level's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Optional

import attrs

from cacheseek.kv.handles import BlobHandle
from cacheseek.kv.locators import kv_locator
from cacheseek.kv.records import ChunkRecord, ChunkRecords, NO_RECORDS

__all__ = ["TieredRecords"]

log = logging.getLogger(__name__)


class TieredRecords(ChunkRecords):
    """The last level's ``records`` (see the module docstring); ``ready_copy(locator)``: that
    level's ready handle of a blob, or None."""

    def __init__(self, inner: ChunkRecords, ready_copy) -> None:
        super().__init__()
        self.inner = inner if inner is not None else NO_RECORDS
        self.stats = self.inner.stats
        self._ready_copy = ready_copy
        self._held: dict[str, ChunkRecord] = {}
        self._held_lock = threading.Lock()

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return self.inner.shared

    def publish(self, record: ChunkRecord) -> bool:
        """Publish now when the last level holds a ready copy; else hold it until it does (False)."""
        if not self.inner.shared:
            return False
        locator = kv_locator(record.node_key)
        with self._held_lock:
            h = self._ready_copy(locator)
            if h is None:
                self._held[locator] = record
                return False
        return self.inner.publish(attrs.evolve(record, digests=h.digests or {}))

    def copy_ready(self, handle: BlobHandle) -> None:
        """The last level's copy of ``handle``'s blob turned ready: a record held for it goes out."""
        with self._held_lock:
            record = self._held.pop(handle.locator, None)
        if record is not None:
            self.inner.publish(attrs.evolve(record, digests=handle.digests or {}))

    def forget(self, locator: str) -> None:
        """The blob left the store before its last level's copy was ready: nothing to publish."""
        with self._held_lock:
            self._held.pop(locator, None)

    def find(self, node_keys: Sequence[bytes]) -> list[Optional[ChunkRecord]]:
        return self.inner.find(node_keys)

    def stats_snapshot(self):
        return self.inner.stats_snapshot()

    def retract(self, node_key: bytes, *, counted: bool = True) -> None:
        self.forget(kv_locator(node_key))
        self.inner.retract(node_key, counted=counted)

    def node_keys(self) -> list[bytes]:
        return self.inner.node_keys()
