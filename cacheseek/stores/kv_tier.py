"""`KeyValueTier`: the shared mechanism of every generic (per-layer) tier store.

A generic tier stores each chunk as ``2 * n_layers`` values under ``{locator}:L{i}:k|v`` plus the
latent under ``{hex}:lat``, in any key-value backend (a dict, files, Fluxon). A payload whose
layers are not all ``(k, v)`` pairs (upstream CacheSeek's tests store a string per layer) is
stored as one value per layer, ``{locator}:L{i}``, and its handle says so (``pairs=False``); each
layer must then be a value the backend can hold (the dict: any object but None). The backend is the
policy; this class is the mechanism that all of them share:

- ``put_async`` takes caller-owned CPU snapshots, writes every value, and only then marks the
  handle ready and calls ``on_ready``. With ``write_back=True`` the writes run on one background
  thread fed by a bounded queue (`WriteBackWorker`: ``put_async`` blocks when ``queue_depth``
  blobs are pending: backpressure, not unbounded memory).
- A failed write removes what it wrote of the blob, leaves the handle unready with ``error`` set,
  counts and logs the failure (`TierStats.failed_writes`). Neither ``put_async`` (write-through)
  nor `flush` (write-back) raises it (a full LocalDisk excepted, see "A full medium"): both
  modes report a failure the same way, on the handle and in the stats, and the caller runs on
  without caching that chunk.
- ``get_layer`` returns ``(k, v)`` (or the layer's single value) or None when a value is missing.
  A value the backend reports corrupt (`CorruptValueError`: checksum mismatch, truncated,
  unreadable) is removed, counted (`TierStats.corrupt_values`) and read as missing, so the
  manager treats it exactly like a value that is gone: it invalidates the node and retries the
  longest whole shorter prefix.
- ``free`` refuses a blob whose write is still in flight (`WriteNotCompleteError`), removes the
  values otherwise (idempotent) and lets backend errors surface.

Capacity (``capacity_bytes``: bytes or a size such as ``"512MiB"``, None = unbounded; settable at
run time; ``auto`` in a config is fitted to the workload by `cacheseek.sizing`): the tier counts the bytes
of the values it holds, KV and latents, a write in flight included from the moment ``put_async``
or ``put_skeleton`` reserves it. A write that would go above the capacity raises `StoreFullError`
at once, before anything is written or queued (the manager evicts and retries once); so usage
never exceeds the capacity. ``usage()`` reports used, capacity and peak bytes; a failed write
or a removal gives its bytes back (the accounting is `ValueLedger`'s). Bytes are counted in the
backend's unit when it has one (``stored_nbytes(key, value)``: LocalDisk counts file bytes, header
included, the same unit it reads back from the files on reopen), else in payload bytes.

Optional capabilities for the manager: ``contains(keys)``, ``free_skeleton`` and ``get_layers``
(a restore's layers in one call, ``read_parallelism`` reads at once: network-bound backends
overlap them; after the first missing value no new read starts). A full or stalled medium: how
a backend says so and what the tier does, `cacheseek.stores.value_backend`.

Chunk records (`cacheseek.kv.records`, the shared index): ``records`` is what the tier's medium
offers other processes (none by default; LocalDisk keeps them as files, the in-memory tier in a
dict its managers share, the Fluxon tier in the service's etcd). A backend that checksums its
values (``checks_digests``: LocalDisk, Fluxon) returns each value's checksum from ``write``; the
tier puts them on the handle (``BlobHandle.digests``) before it is ready, the manager copies them
into the chunk's record, and a read of a blob whose handle carries them (adopted from a record)
passes each to ``read(key, expect)``: a value another writer replaced with other bytes is a
corrupt value, so a chunk is never mixed from two writers. ``free`` retracts the chunk's record
before it removes a value.

Codecs (``codec``, ``codec_device``; `cacheseek.codecs`): each K and V value is encoded before
the backend writes it (capacity and usage count the encoded bytes; a backend's checksum covers
them) and decoded after the backend read it, on ``codec_device``; a value the codec cannot decode
is a corrupt value like one that fails its checksum. Latents and non-pair layers are stored as
they are.

``flush`` and ``close`` are bounded (``flush_timeout_s``; `PendingWrites`): past the bound they
raise `StoreTimeoutError`. Latent writes (``put_skeleton``) count as pending writes like blobs.
``close`` waits for every write and every backend call still running, stuck ones included,
before it closes the backend (a LocalDisk root's lock is released only then); past the bound it
leaves the backend open under them and raises `StoreTimeoutError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional


from cacheseek.codecs.tier import TierCodec
from cacheseek.errors import CorruptValueError, StoreClosedError, StoreError, StoreTimeoutError, WriteNotCompleteError
from cacheseek.eviction.base import StoreUsage
from cacheseek.kv.handles import BlobHandle, Tier, kv_pairs
from cacheseek.kv.locators import blob_keys, layer_keys, node_key_of, object_key
from cacheseek.kv.payload import layer_nbytes, payload_nbytes
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.sizes import available_memory, total_memory
from cacheseek.sizing import SizeField
from cacheseek.stores.backend_calls import BackendCalls
from cacheseek.stores.base import TierStore
from cacheseek.stores.value_backend import TierStats, ValueBackend, _check_capacity, check_read_parallelism
from cacheseek.stores.value_ledger import ValueLedger
from cacheseek.stores.write_back import PendingWrites

log = logging.getLogger(__name__)

__all__ = ["ValueBackend", "KeyValueTier", "TierStats", "check_read_parallelism"]


class KeyValueTier(TierStore):
    """A `TierStore` over a `ValueBackend`; see the module docstring for the contract."""

    knows_contents = True
    frees_latents = True
    resizable = True
    storage_format = "cacheseek.tier.objects.v1"  # a value per layer and key, as the backend encodes it
    tier = Tier.CPU
    flush_timeout_s: float = 300.0  # the bound of `flush` and `close`; settable per store
    capacity_fix = "raise store.capacity_bytes, or let the manager evict"  # in StoreFullError

    def __init__(
        self,
        backend: ValueBackend,
        *,
        write_back: bool = False,
        queue_depth: int = 4,
        name: str = "tier",
        capacity_bytes: Optional[int] = None,
        op_timeout_s: Optional[float] = None,
        records: ChunkRecords = NO_RECORDS,
        read_parallelism: int = 1,
        codec: str = "none",
        codec_device: str = "auto",
    ) -> None:
        self.read_parallelism = check_read_parallelism(read_parallelism)
        self._codec = TierCodec(codec, codec_device)
        self.codec = self._codec.codec
        self.codec_id = self._codec.codec_id  # the namespace's codec field (`cacheseek.codecs`)
        self.records = records
        self.name = name
        self.stats = TierStats(capacity_bytes=_check_capacity(capacity_bytes))
        self.calls = BackendCalls(backend, name=name, op_timeout_s=op_timeout_s, reserved=self._reserved,
                                  on_corrupt=self._corrupt)
        # bytes of every value this tier holds or is writing; a backend that knows its medium's free
        # bytes lets a full medium's cap rise again
        self.ledger = ValueLedger(self.stats, free_bytes=self.calls.free_bytes if self.calls.knows_free_bytes else None)
        self._lock = threading.Lock()  # guards stats and the ledger
        self._closed = False  # to callers
        self._backend_closed = False  # once nothing runs in it any more (`close`)
        self.pending = PendingWrites(self._lock, self.stats, self._run_write, write_back=write_back,
                                      depth=queue_depth, name=name)

    @property
    def backend(self) -> ValueBackend:
        return self.calls.backend

    @backend.setter
    def backend(self, backend: ValueBackend) -> None:
        self.calls.backend = backend

    def _reserved(self, key: str) -> bool:
        with self._lock:
            return key in self.ledger.sizes

    def _corrupt(self, key: str, exc: CorruptValueError, *, removed: bool) -> None:
        with self._lock:
            self.stats.corrupt_values += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            if removed:
                self.ledger.forget(key)

    @property
    def write_back(self) -> bool:
        """Whether writes run on the write-back thread (``put_async`` returns before they land)."""
        return self.pending.worker is not None

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]:
        """`SizedStore`: ``capacity_bytes`` where the config has it, against the free memory."""
        if "capacity_bytes" not in config:
            return []
        return [SizeField("capacity_bytes", "capacity", room=available_memory(), total=total_memory())]

    # -- writes -------------------------------------------------------------------------------
    def put_async(self, locator: str, payload: Sequence[Any], *, tier: Tier,
                  on_ready: Optional[Callable[[BlobHandle], None]] = None) -> BlobHandle:
        self._check_open()
        pairs = kv_pairs(payload)
        items: list[tuple[str, Any]] = []
        for i, layer in enumerate(payload):
            if pairs:
                items += zip(layer_keys(locator, i), layer)
            elif layer is None:
                raise ValueError(f"{locator}: layer {i} is None (a stored None would read as a miss)")
            else:
                items.append((object_key(locator, i), layer))
        nbytes = sum(payload_nbytes(value) for _, value in items)
        handle = BlobHandle(tier=tier, locator=locator, nbytes=nbytes, n_layers=len(payload), pairs=pairs)
        if pairs:
            items = self._codec.encode_items(items)  # the stored (and counted) values are the encoded ones
        sizes = [(key, self.calls.stored_nbytes(key, value)) for key, value in items]
        with self._lock:
            old = self._reserve(sizes)
            self.stats.pending_writes += 1
        self.pending.submit((handle, items, on_ready, old))
        return handle

    def _write_blob(
        self, handle: BlobHandle, items: list[tuple[str, Any]], on_ready, old: dict[str, Optional[int]]
    ) -> None:
        t0 = time.perf_counter()
        touched: list[str] = []
        digests: dict[str, str] = {}
        try:
            for key, value in items:
                touched.append(key)  # before the write: a failed write may leave part of it
                digest = self.calls.write(key, value)
                if self.calls.checks_digests and isinstance(digest, str):
                    digests[key] = digest
        except BaseException as exc:  # noqa: BLE001 - every failure is surfaced on the handle
            removed = self.calls.remove_partial(touched)
            handle.fail(exc)
            with self._lock:
                self.ledger.refund(old, removed, exc, caps=self.calls.caps_on_full(exc), name=self.name)
                self.stats.failed_writes += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                self.pending.done()
            log.error("%s: write of %s failed: %s", self.name, handle.locator, exc)
            if not self.write_back and (self.calls.caps_on_full(exc) or not isinstance(exc, Exception)):
                raise  # a full medium (the caller evicts and retries); KeyboardInterrupt and the like
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.put_bytes += handle.nbytes
            self.stats.put_seconds += time.perf_counter() - t0
        handle.digests = digests or None
        handle.publish()
        try:
            if on_ready is not None:
                on_ready(handle)
        finally:
            with self._lock:
                self.pending.done()

    def _run_write(self, job: tuple) -> None:
        """A write; on the write-back thread a failed write is on its handle already, and only
        ``on_ready``'s failure is left to log."""
        if not self.write_back:
            self._write_blob(*job)
            return
        try:
            self._write_blob(*job)
        except Exception:  # noqa: BLE001 - the write succeeded; on_ready raised
            log.exception("%s: on_ready callback of %s failed", self.name, job[0].locator)

    def put_skeleton(self, locator: str, latent: Any) -> None:
        """Write a latent (synchronously). `StoreFullError` when it does not fit; any backend
        failure is a `StoreError` (what it wrote is not counted)."""
        self._check_open()
        size = self.calls.stored_nbytes(locator, latent)
        with self._lock:
            old = self._reserve([(locator, size)])
            self.stats.pending_writes += 1  # close waits for it like for a blob
        try:
            self.calls.write(locator, latent)
        except BaseException as exc:
            with self._lock:
                self.ledger.refund(old, [], exc, caps=self.calls.caps_on_full(exc), name=self.name)
            if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                raise
            raise StoreError(f"{self.name}: write of {locator} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self.pending.done()

    # -- accounting ---------------------------------------------------------------------------
    def _reserve(self, sizes: list[tuple[str, int]]) -> dict[str, Optional[int]]:
        """Under ``_lock``: `ValueLedger.reserve`, the refusal naming this tier and its fix."""
        return self.ledger.reserve(sizes, name=self.name, fix=self.capacity_fix)


    @property
    def capacity_bytes(self) -> Optional[int]:
        return self.stats.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: Optional[int]) -> None:
        """Resize at run time; values above a lowered capacity stay until freed (the manager's
        next eviction pass brings usage down), new writes are refused meanwhile."""
        with self._lock:
            self.stats.capacity_bytes = _check_capacity(value)

    def usage(self) -> StoreUsage:
        with self._lock:
            return self.ledger.usage(self.name, time.monotonic())

    # -- reads --------------------------------------------------------------------------------
    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        """The small value under ``locator`` (a latent, a chunk's frames), or None. ``like`` and
        ``nbytes`` are for stores that read raw bytes by length (the Plan tier): a value here
        carries its own size, so a tiered store may pass them to every level."""
        self._check_open()
        return self._read(locator)

    def _read(self, key: str, expect: Optional[str] = None, *, decode: bool = False) -> Optional[Any]:
        """The value, or None when it is missing or corrupt (`BackendCalls.read`); ``decode``: a
        K or V value, decoded by the tier's codec."""
        return self.calls.read(key, expect, (lambda v: self._codec.decode(key, v)) if decode else None)

    def get_layer(self, handle: BlobHandle, layer: int) -> Optional[Any]:
        self._check_open()
        if not 0 <= layer < handle.n_layers:
            raise IndexError(f"layer {layer} out of range for a blob of {handle.n_layers} layers")
        t0 = time.perf_counter()
        out: Any
        expect = handle.digests or {}
        if handle.pairs:
            kk, vk = layer_keys(handle.locator, layer)
            k = self._read(kk, expect.get(kk), decode=True)
            v = self._read(vk, expect.get(vk), decode=True) if k is not None else None
            out = None if k is None or v is None else (k, v)
        else:
            key = object_key(handle.locator, layer)
            out = self._read(key, expect.get(key))
        if out is None:
            return None
        with self._lock:
            self.stats.gets += 1
            self.stats.get_bytes += layer_nbytes(out)
            self.stats.get_seconds += time.perf_counter() - t0
        return out

    def get_layers(self, requests: Sequence[tuple[BlobHandle, int]]) -> list[Optional[Any]]:
        """`TierStore.get_layers`: up to ``read_parallelism`` layers at once."""
        self._check_open()
        return super().get_layers(requests)

    # -- lifetime -----------------------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        self._check_open()
        if handle.in_flight:
            raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
        self.records.retract(node_key_of(handle.locator))  # unfindable first, then its values go
        for key in blob_keys(handle.locator, handle.n_layers, pairs=handle.pairs):
            self.calls.delete(key)
            with self._lock:
                self.ledger.forget(key)
        with self._lock:
            self.stats.frees += 1

    def free_skeleton(self, locator: str) -> None:
        """Remove a latent (idempotent); backend errors surface."""
        self._check_open()
        self.calls.delete(locator)
        with self._lock:
            self.ledger.forget(locator)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` hold a value, in order (the backend's ``exists`` when it has one,
        else a read)."""
        self._check_open()
        return self.calls.contains(keys)

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every queued write has completed (successfully or not), at most
        ``timeout_s`` seconds (default ``flush_timeout_s``); `StoreTimeoutError` past it, naming
        how many writes are still pending (they go on; a later flush may succeed). The values
        written beside chunks first (`TierStore.flush_beside`)."""
        bound = self.flush_timeout_s if timeout_s is None else timeout_s
        self.flush_beside(bound)
        self.pending.flush(bound)

    def close(self) -> None:
        """Flush pending writes, stop the write-back thread, wait for backend calls still running
        (stuck ones included), close the backend. Idempotent; after a `StoreTimeoutError` a later
        call waits again and closes the backend once nothing runs in it.

        Bounded: when the writes do not drain within ``flush_timeout_s``, the write-back thread
        does not stop or a backend call is still running, the store is closed to callers but the
        backend is left open under them (never torn down under a call: a LocalDisk root stays
        locked) and `StoreTimeoutError` is raised."""
        if self._backend_closed:
            return
        if not self._closed:  # a close that timed out before goes on from here when called again
            try:
                self.close_beside(self.flush_timeout_s)
                self.flush()
            except StoreTimeoutError:
                self._closed = True
                self.pending.stop(0.0)
                raise
            self._closed = True
        if not self.pending.stop(self.flush_timeout_s):
            raise StoreTimeoutError(f"{self.name}: the write-back thread did not stop; backend left open")
        self.calls.close(self.flush_timeout_s)
        self._backend_closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.name} store is closed")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stats": self.stats.as_dict()}
