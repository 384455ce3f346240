"""`DiskRecords`: a LocalDisk root's chunk records (`cacheseek.kv.records`), files beside the values."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from cacheseek.errors import CorruptValueError
from cacheseek.kv.claims import CLAIM_SUFFIX
from cacheseek.kv.records import RECORD_SUFFIX, ChunkRecords

if TYPE_CHECKING:
    from cacheseek.stores.localdisk import LocalDiskTierStore

log = logging.getLogger("cacheseek.stores.localdisk")

__all__ = ["DiskRecords"]


class DiskRecords(ChunkRecords):
    """A LocalDisk root's chunk records: one file each, ``{node hex}:rec``, the record's own bytes
    (`encode_record`, sealed with its name: no value header around it), created only where none is (a hard link of a complete temp
    file: the first writer wins, a reader never sees half a record). Every process on the root
    sees them; each call is bounded like the root's other file operations."""

    shared = True

    def __init__(self, tier: "LocalDiskTierStore") -> None:
        super().__init__()
        self._tier = tier

    def _put_new(self, name: str, data: bytes) -> bool:
        disk = self._tier.disk
        durable = not name.endswith(CLAIM_SUFFIX)  # a claim is a hint: no fsync
        stored = self._tier.calls.run("write", lambda: disk.write_raw_new(name, data, durable=durable), name)
        if stored:
            with self._tier._lock:
                self._tier.ledger.seed({name: len(data)})
        return stored

    def _get_many(self, names: Sequence[str]) -> list[Optional[bytes]]:
        disk = self._tier.disk

        def read_all() -> list[Optional[bytes]]:
            out = []
            for n in names:
                try:
                    out.append(disk.read_raw(n))
                except CorruptValueError as exc:
                    log.warning("localdisk: %s", exc)
                    out.append(b"")  # present but unreadable: the record's checks reject it
            return out

        return self._tier.calls.run("read", read_all)

    def _delete(self, name: str) -> None:
        self._tier.calls.delete(name)
        with self._tier._lock:
            self._tier.ledger.forget(name)

    def _names(self) -> list[str]:
        return [k for k in self._tier.keys() if k.endswith(RECORD_SUFFIX)]
