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

``flush`` and ``close`` are bounded (``flush_timeout_s``; `wait_drained`): past the bound they
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional


from cacheseek.bounded_calls import BoundedCalls
from cacheseek.codecs.tier import TierCodec
from cacheseek.errors import (
    CorruptValueError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
    WriteNotCompleteError,
)
from cacheseek.eviction.base import StoreUsage
from cacheseek.kv.handles import BlobHandle, Tier, kv_pairs
from cacheseek.kv.locators import blob_keys, layer_keys, node_key_of, object_key
from cacheseek.kv.payload import layer_nbytes, payload_nbytes
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.sizes import available_memory, total_memory
from cacheseek.sizing import SizeField
from cacheseek.stores.flush import wait_drained
from cacheseek.stores.value_backend import TierStats, ValueBackend, _check_capacity, check_read_parallelism
from cacheseek.stores.value_ledger import ValueLedger
from cacheseek.stores.write_back import WriteBackWorker

log = logging.getLogger(__name__)

__all__ = ["ValueBackend", "KeyValueTier", "TierStats", "check_read_parallelism"]


class KeyValueTier:
    """A `TierStore` over a `ValueBackend`; see the module docstring for the contract."""

    accepts_device_views = False
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
        self.backend = backend
        self.records = records
        self._digests = bool(getattr(backend, "checks_digests", False))  # decided once, here
        self._calls = None if op_timeout_s is None else BoundedCalls(
            op_timeout_s, name=name, field="store.op_timeout_s", hint=" (a stalled disk or file system?)")
        self.name = name
        self.stats = TierStats(capacity_bytes=_check_capacity(capacity_bytes))
        # bytes of every value this tier holds or is writing; a backend that knows its medium's free
        # bytes lets a full medium's cap rise again
        self._ledger = ValueLedger(self.stats, free_bytes=self._medium_free if hasattr(backend, "free_bytes") else None)
        self._lock = threading.Lock()  # guards stats and the ledger
        self._closed = False  # to callers
        self._backend_closed = False  # once nothing runs in it any more (`close`)
        self._idle = threading.Condition(self._lock)  # notified when a pending write completes
        self._worker: Optional[WriteBackWorker] = None
        if write_back:
            self._worker = WriteBackWorker(self._run_queued, depth=queue_depth, name=name)

    def _medium_free(self) -> Optional[int]:
        """The backend medium's free bytes now (the backend may be replaced: asked each time)."""
        return self.backend.free_bytes()

    def _io(self, op: str, fn: Callable[[], Any], key: Optional[str] = None, on_late=None) -> Any:
        """``fn()``, a backend call: bounded when the tier has ``op_timeout_s`` (module docstring)."""
        if self._calls is None:
            return fn()
        return self._calls.run(op, fn, key=key, on_late=on_late)

    def _write(self, key: str, value: Any) -> Any:
        """One bounded backend write (its checksum, where the backend has one); one that lands
        after its caller gave up is removed again unless a later write reserved the key meanwhile."""
        def late(_: Any, error: Optional[BaseException]) -> None:
            if error is None:
                with self._lock:
                    if key not in self._ledger.sizes:
                        self.backend.delete(key)

        return self._io("write", lambda: self.backend.write(key, value), key, on_late=late)

    def _delete(self, key: str) -> None:
        self._io("delete", lambda: self.backend.delete(key), key)

    @property
    def write_back(self) -> bool:
        """Whether writes run on the write-back thread (``put_async`` returns before they land)."""
        return self._worker is not None

    write_back_worker = property(lambda self: self._worker, doc="The `WriteBackWorker` (None without write_back).")

    def counted_keys(self) -> set[str]:
        """The keys whose bytes the tier counts (held or being written): what `usage` sums."""
        with self._lock:
            return set(self._ledger.sizes)

    def wait_calls_quiet(self, timeout_s: float) -> int:
        """Wait at most ``timeout_s`` until no backend call runs, stuck ones included (a late one's
        clean-up done); how many still run (0 without ``op_timeout_s``)."""
        return self._calls.wait_quiet(timeout_s) if self._calls is not None else 0

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]:
        """`SizedStore`: ``capacity_bytes`` where the config has it, against the free memory."""
        if "capacity_bytes" not in config:
            return []
        return [SizeField("capacity_bytes", "capacity", room=available_memory(), total=total_memory())]

    # -- writes -------------------------------------------------------------------------------

    def put_async(
        self,
        locator: str,
        payload: Sequence[Any],
        *,
        tier: Tier,
        on_ready: Optional[Callable[[BlobHandle], None]] = None,
    ) -> BlobHandle:
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
        sizes = [(key, self._value_nbytes(key, value)) for key, value in items]
        with self._lock:
            old = self._reserve(sizes)
            self.stats.pending_writes += 1
        job = (handle, items, on_ready, old)
        if self._worker is None:
            self._write_blob(*job)
        else:
            self._worker.submit(job)
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
                digest = self._write(key, value)
                if self._digests and isinstance(digest, str):
                    digests[key] = digest
        except BaseException as exc:  # noqa: BLE001 - every failure is surfaced on the handle
            removed = []
            for key in touched:
                try:
                    self._delete(key)
                    removed.append(key)
                except Exception:  # noqa: BLE001
                    log.exception("%s: could not remove %s after a failed write", self.name, key)
            handle.error = exc
            with self._lock:
                self._ledger.unreserve(old, removed=removed)
                if self._caps_on_full(exc):
                    self._ledger.cap_at_used(exc, name=self.name)
                self.stats.failed_writes += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                self.stats.pending_writes -= 1
                self._idle.notify_all()
            log.error("%s: write of %s failed: %s", self.name, handle.locator, exc)
            if self._worker is None and (self._caps_on_full(exc) or not isinstance(exc, Exception)):
                raise  # a full medium (the caller evicts and retries); KeyboardInterrupt and the like
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.put_bytes += handle.nbytes
            self.stats.put_seconds += time.perf_counter() - t0
        handle.digests = digests or None
        handle.ready = True
        try:
            if on_ready is not None:
                on_ready(handle)
        finally:
            with self._lock:
                self.stats.pending_writes -= 1
                self._idle.notify_all()

    def _run_queued(self, job: tuple) -> None:
        """A write on the write-back thread: a failed write is on its handle already."""
        try:
            self._write_blob(*job)
        except Exception:  # noqa: BLE001 - the write succeeded; on_ready raised
            log.exception("%s: on_ready callback of %s failed", self.name, job[0].locator)

    def put_skeleton(self, locator: str, latent: Any) -> None:
        """Write a latent (synchronously). `StoreFullError` when it does not fit; any backend
        failure is a `StoreError` (what it wrote is not counted)."""
        self._check_open()
        size = self._value_nbytes(locator, latent)
        with self._lock:
            old = self._reserve([(locator, size)])
            self.stats.pending_writes += 1  # close waits for it like for a blob
        try:
            self._write(locator, latent)
        except BaseException as exc:
            with self._lock:
                self._ledger.unreserve(old, removed=[])
                if self._caps_on_full(exc):
                    self._ledger.cap_at_used(exc, name=self.name)
            if isinstance(exc, StoreError) or not isinstance(exc, Exception):
                raise
            raise StoreError(f"{self.name}: write of {locator} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            with self._lock:
                self.stats.pending_writes -= 1
                self._idle.notify_all()

    # -- accounting ---------------------------------------------------------------------------

    def _reserve(self, sizes: list[tuple[str, int]]) -> dict[str, Optional[int]]:
        """Under ``_lock``: `ValueLedger.reserve`, the refusal naming this tier and its fix."""
        return self._ledger.reserve(sizes, name=self.name, fix=self.capacity_fix)

    def _value_nbytes(self, key: str, value: Any) -> int:
        sized = getattr(self.backend, "stored_nbytes", None)
        if callable(sized):
            try:
                return int(sized(key, value))
            except StoreError:  # a value the backend cannot store: its write fails on the handle
                pass
        return payload_nbytes(value)

    def _caps_on_full(self, exc: BaseException) -> bool:
        """A full medium this tier accounts for alone (``backend.full_caps_tier``: LocalDisk). A
        shared store that evicts by itself (Fluxon) reports full without capping the tier."""
        return isinstance(exc, StoreFullError) and bool(getattr(self.backend, "full_caps_tier", False))

    def _forget(self, key: str) -> None:
        """Under ``_lock``: ``key`` was removed from the backend."""
        self._ledger.forget(key)

    def _seed_usage(self, sizes: dict[str, int]) -> None:
        """Count values that already exist in the backend (a reopened persistent tier)."""
        with self._lock:
            self._ledger.seed(sizes)

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
            self._ledger.refresh(self.name, time.monotonic())  # a full medium's cap rises again
            return StoreUsage(self.stats.used_bytes, self.stats.capacity_bytes, self.stats.peak_bytes,
                              len(self._ledger))

    # -- reads --------------------------------------------------------------------------------

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        """The small value under ``locator`` (a latent, a chunk's frames), or None. ``like`` and
        ``nbytes`` are for stores that read raw bytes by length (the Plan tier): a value here
        carries its own size, so a tiered store may pass them to every level."""
        self._check_open()
        return self._read(locator)

    def _read(self, key: str, expect: Optional[str] = None, *, decode: bool = False) -> Optional[Any]:
        """The backend's value, or None when it is missing or corrupt (then it is removed);
        ``expect``: the checksum the chunk's record names (a backend with ``checks_digests``);
        ``decode``: a K or V value, decoded by the tier's codec (a value it cannot decode is corrupt)."""
        if expect is not None and self._digests:
            read = lambda: self.backend.read(key, expect)  # noqa: E731
        else:
            read = lambda: self.backend.read(key)  # noqa: E731
        try:
            value = self._io("read", read, key)
            return self._codec.decode(key, value) if decode else value
        except CorruptValueError as exc:
            log.error("%s: %s; removing it and reading it as missing", self.name, exc)
            with self._lock:
                self.stats.corrupt_values += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
            try:
                self._delete(key)
            except Exception:  # noqa: BLE001 - the manager's free of the blob retries the removal
                log.exception("%s: could not remove corrupt value %s", self.name, key)
            else:
                with self._lock:
                    self._forget(key)
            return None

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
        """`get_layer` of every ``(handle, layer)``, in order, up to ``read_parallelism`` layers
        at once. After the first miss (or error) no new read starts; the layers not read are
        None. The first error, in request order, is raised once every started read is done."""
        self._check_open()
        if self.read_parallelism == 1 or len(requests) < 2:
            out: list[Optional[Any]] = []
            for handle, layer in requests:
                out.append(self.get_layer(handle, layer) if all(x is not None for x in out[-1:]) else None)
            return out
        stop = threading.Event()

        def one(handle: BlobHandle, layer: int) -> Optional[Any]:
            if stop.is_set():
                return None
            try:
                got = self.get_layer(handle, layer)
            except BaseException:
                stop.set()
                raise
            if got is None:
                stop.set()
            return got

        with ThreadPoolExecutor(min(self.read_parallelism, len(requests)), thread_name_prefix=f"{self.name}-read") as pool:
            futures = [pool.submit(one, handle, layer) for handle, layer in requests]
        return [f.result() for f in futures]

    # -- lifetime -----------------------------------------------------------------------------

    def free(self, handle: BlobHandle) -> None:
        self._check_open()
        if handle.in_flight:
            raise WriteNotCompleteError(f"{handle.locator}: write still in flight; cannot free")
        self.records.retract(node_key_of(handle.locator))  # unfindable first, then its values go
        for key in blob_keys(handle.locator, handle.n_layers, pairs=handle.pairs):
            self._delete(key)
            with self._lock:
                self._forget(key)
        with self._lock:
            self.stats.frees += 1

    def free_skeleton(self, locator: str) -> None:
        """Remove a latent (idempotent); backend errors surface."""
        self._check_open()
        self._delete(locator)
        with self._lock:
            self._forget(locator)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` hold a value, in order (the backend's ``exists`` when it has one,
        else a read)."""
        self._check_open()
        exists = getattr(self.backend, "exists", None)
        if callable(exists):
            return self._io("exists", lambda: [bool(exists(key)) for key in keys])
        return self._io("read", lambda: [self.backend.read(key) is not None for key in keys])

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every queued write has completed (successfully or not), at most
        ``timeout_s`` seconds (default ``flush_timeout_s``); `StoreTimeoutError` past it, naming
        how many writes are still pending (they go on; a later flush may succeed)."""
        bound = self.flush_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            wait_drained(self._idle, lambda: self.stats.pending_writes, bound,
                         lambda n: StoreTimeoutError(f"{self.name}: {n} writes still pending after {bound} s "
                                                     "(a stuck backend?)"))

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
                self.flush()
            except StoreTimeoutError:
                self._closed = True
                if self._worker is not None:
                    self._worker.stop(wait_s=0.0)
                raise
            self._closed = True
        if self._worker is not None and not self._worker.stop(wait_s=self.flush_timeout_s):
            raise StoreTimeoutError(f"{self.name}: the write-back thread did not stop; backend left open")
        running = self.wait_calls_quiet(self.flush_timeout_s)
        if running:
            raise StoreTimeoutError(f"{self.name}: {running} backend calls still running after "
                                    f"{self.flush_timeout_s} s (a stalled medium?); backend left open")
        self.backend.close()
        self._backend_closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.name} store is closed")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stats": self.stats.as_dict()}
