"""Handles to a chunk's stored values: the tier, the blob of its KV and the skeleton of its latent.

A trie node (`cacheseek.reuse.exact_prefix.types.TrieNode`) owns one `BlobHandle` (the chunk's KV
for every layer, ~3.57 GiB at 480p, evictable) and one `Skeleton` (its denoised latent, cheap and
kept). ``BlobHandle.ready`` is the publication bit: true only once every value of the chunk is
durably committed in the store. Stores see a node only through `ChunkNode`, the three fields
they read, so this module (and every store) stays below the reuse layer.

Handle lifecycle (``BlobHandle.state``)::

    PENDING --(store completion callback)--> READY --(evict/free)--> dropped from the node
    PENDING --(write failed)--> FAILED                                (droppable, never ready)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

__all__ = ["Tier", "BlobState", "BlobHandle", "Skeleton", "ChunkNode", "kv_pairs"]


class Tier(str, enum.Enum):
    """Where a blob lives. String values are persisted in snapshots. Every store class declares
    the one it is (its ``tier`` class attribute); a tiered store's handles carry their level's,
    a plain store's the label its caller passes (``put_async(..., tier=)``, upstream's contract)."""

    HBM_STAGING = "hbm_staging"
    CPU = "cpu"
    FLUXON_DRAM = "fluxon_dram"
    DISK = "disk"


class BlobState(str, enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class BlobHandle:
    """A chunk's KV in a store: ``n_layers`` layers of (K, V), ``nbytes`` in total.

    Mutable by design (the store's completion callback flips it ready). ``error`` holds the
    exception of a failed write; such a handle never becomes ready. ``pairs``: every layer is a
    ``(k, v)`` pair, stored as two values; False when the layers are other objects (upstream's
    tests store a string per layer), stored as one value each. ``digests``: each value's
    checksum, where the store checksums its values: set by the store's write before the handle
    is ready (the chunk's record carries them), or from the record a handle was adopted from (a
    read checks each value against it); None where the store keeps none. ``recorded``: the
    chunk is findable by other processes through its record in the store (its record was
    published, or the handle was adopted from it), so another process may free it.
    """

    tier: Tier
    locator: str
    nbytes: int
    n_layers: int
    ready: bool = False
    error: Optional[BaseException] = None
    pairs: bool = True
    digests: Optional[dict[str, str]] = None
    recorded: bool = False  # the store holds the chunk's record (published here, or adopted from it)

    @property
    def state(self) -> BlobState:
        if self.ready:
            return BlobState.READY
        if self.error is not None:
            return BlobState.FAILED
        return BlobState.PENDING

    @property
    def in_flight(self) -> bool:
        return self.state is BlobState.PENDING

    def publish(self) -> None:
        """Every value is written: ready (the publication bit), unless the write failed. The
        one place a handle turns ready."""
        if self.error is None:
            self.ready = True

    def fail(self, error: BaseException) -> None:
        """The write failed, or the values were lost: never ready again. The one place a handle
        takes an error."""
        self.ready, self.error = False, error


def kv_pairs(payload: Sequence[Any]) -> bool:
    """Whether a blob's layers are ``(k, v)`` pairs (each a 2-tuple), the binding's payload."""
    return all(isinstance(layer, tuple) and len(layer) == 2 for layer in payload)


@dataclass(frozen=True)
class Skeleton:
    latent_locator: str


class ChunkNode(Protocol):
    """What a store reads of a trie node on a whole-path restore: the chunk index (``depth``),
    its KV blob and its latent skeleton. `TrieNode` satisfies it."""

    depth: int
    blob: Optional[BlobHandle]
    skeleton: Optional[Skeleton]
