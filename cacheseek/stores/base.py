"""The store contract: one base class every store subclasses, and `as_store` for a caller's own.

Required of every store (`TierStore`)::

    put_async(locator, payload, tier=..., on_ready=cb) -> BlobHandle (PENDING)
        success: every value committed -> cb(handle) (the manager sets it ready: `BlobHandle.publish`)
        failure: nothing of the blob stays in the store, handle.error set, counted in stats
    get_layer(handle, layer) -> (k, v) | value | None    a partial layer is a miss, never a crash
    put_skeleton(locator, latent); get_skeleton(locator, like=None, *, nbytes=None) -> latent | None
    free(handle): removes the values (idempotent); raises if removal fails (the caller keeps the blob)

Generic tiers keep the per-layer path: ``put_async`` receives a caller-owned CPU snapshot of each
layer (the runtime overwrites its ring right after the hook returns). A generic tier also takes
layers that are not ``(k, v)`` pairs (any object, as upstream CacheSeek's tests store strings)
and returns each as it was stored (``BlobHandle.pairs`` is then False).

Everything else is optional, with a default here that means "not offered", so callers call and
never probe. What a store offers beyond the defaults is a capability flag, fixed by its class:

- ``reads_paths`` (`PathReadStore`): it moves bytes itself: takes detached views of the live ring
  on write and restores a whole window path into the runtime's buffers (``read_path``).
- ``knows_contents``: ``contains(keys)`` says which values exist without reading them.
- ``frees_latents``: ``free_skeleton(locator)`` removes a latent.
- ``lists_values``: ``keys()`` and ``delete_values(keys)`` (reconcile removes orphans).
- ``copies_values``: ``copy_values_from(source, keys, lengths)`` between two path stores.

Defaults that are already the right behaviour for a store without the operation: ``get_layers``
(every layer in turn, none after the first miss), ``usage`` (None: unbounded), ``tier_usages``
(none: not tiered), ``served_tier`` (None: the store itself), ``flush``/``close``/
``session_starting``/``wait_ready`` (nothing to wait for), ``records`` (`NO_RECORDS`),
``codec_id`` (None: raw bytes), ``storage_format`` (the class's path), ``ready`` (True).

Every store has, from the base, ``write_beside(capture, kind=, limit=)``: a value kept beside a chunk
(its frames, its decoder's state) finished and stored on the store's own writer thread
(`BesideWrites`), bounded, refused when busy. A store's ``flush`` waits for it first
(``flush_beside``) and its ``close`` stops it (``close_beside``), so that what a session wrote is
in the store once flushed and a closed store never sees a write arrive.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Optional

from cacheseek.eviction.base import StoreUsage
from cacheseek.kv.handles import BlobHandle, ChunkNode, Tier
from cacheseek.kv.payload import LayerPayload, RestoreTarget
from cacheseek.kv.records import NO_RECORDS, ChunkRecords
from cacheseek.registry import STORES
from cacheseek.stores.beside_writes import FLUSH_S, BesideWrites
from cacheseek.stores.startup import NO_TOKEN, StartToken

__all__ = ["TierStore", "PathReadStore", "RestoreTarget", "LayerPayload", "as_store"]

_BESIDE_LOCK = threading.Lock()  # makes each store's `BesideWrites` once


class TierStore:
    """The base of every store (see the module docstring): required calls raise, optional ones
    do what a store without them means, capabilities are class flags."""

    reads_paths: ClassVar[bool] = False
    accepts_device_views: ClassVar[bool] = False
    knows_contents: ClassVar[bool] = False
    frees_latents: ClassVar[bool] = False
    lists_values: ClassVar[bool] = False
    copies_values: ClassVar[bool] = False
    resizable: ClassVar[bool] = False  # ``capacity_bytes`` may be set at run time
    tier: ClassVar[Tier] = Tier.CPU
    capacity_fix: ClassVar[str] = "give the store more room"
    records: ChunkRecords = NO_RECORDS
    codec_id: Optional[str] = None
    stats: Any = None
    read_parallelism: int = 1  # layers `get_layers` reads at once
    transfer: Any = None  # the transfer runtime a path store copies with
    device: Any = None  # where a path store keeps its values (None: its transfer runtime's kind)

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[Any]:
        """The size fields (`SizeField`) of its config that the orchestrator fits to the workload: none."""
        return []

    # -- required -------------------------------------------------------------------------------
    def put_async(self, locator: str, payload: Sequence[Any], *, tier: Tier,
                  on_ready: Optional[Callable[[BlobHandle], None]] = None) -> BlobHandle:
        raise NotImplementedError(f"{type(self).__name__}.put_async")

    def get_layer(self, handle: BlobHandle, layer: int) -> Optional[Any]:
        raise NotImplementedError(f"{type(self).__name__}.get_layer")

    def put_skeleton(self, locator: str, latent: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.put_skeleton")

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.get_skeleton")

    def free(self, handle: BlobHandle) -> None:
        raise NotImplementedError(f"{type(self).__name__}.free")

    # -- optional, with the meaning of "not offered" ----------------------------------------------
    def get_layers(self, requests: Sequence[tuple[BlobHandle, int]]) -> list[Optional[Any]]:
        """`get_layer` of every ``(handle, layer)``, in order, up to ``read_parallelism`` layers
        at once (network-bound backends overlap them). After the first miss (or error) no new
        read starts; the layers not read are None. The first error, in request order, is raised
        once every started read is done."""
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

        with ThreadPoolExecutor(min(self.read_parallelism, len(requests)), thread_name_prefix=f"{self.label}-read") as pool:
            futures = [pool.submit(one, handle, layer) for handle, layer in requests]
        return [f.result() for f in futures]

    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        """Only where ``reads_paths``: see `PathReadStore`."""
        raise NotImplementedError(f"{type(self).__name__} does not read whole paths")

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Only where ``knows_contents``: which of ``keys`` hold a value, in order."""
        raise NotImplementedError(f"{type(self).__name__} cannot say which values it holds")

    def free_skeleton(self, locator: str) -> None:
        """Only where ``frees_latents``: remove a latent (idempotent)."""
        raise NotImplementedError(f"{type(self).__name__} does not free latents")

    def keys(self) -> list[str]:
        """Only where ``lists_values``: every key it holds."""
        raise NotImplementedError(f"{type(self).__name__} does not list its values")

    def delete_values(self, keys: list[str]) -> None:
        """Only where ``lists_values``: remove these values."""
        raise NotImplementedError(f"{type(self).__name__} does not list its values")

    def copy_values_from(self, source: Any, keys: Sequence[str], lengths: Optional[Sequence[int]] = None) -> Any:
        """Only where ``copies_values``: copy ``keys`` from another such store of one transfer
        runtime in one batch; None when ``source`` no longer holds them."""
        raise NotImplementedError(f"{type(self).__name__} does not copy values between stores")

    def orphans(self) -> list[str]:
        """Values no chunk record names and no writer can still be writing (shared records)."""
        return []

    def usage(self) -> Optional[StoreUsage]:
        """Bytes in use and the capacity; None: unbounded (it cannot say)."""
        return None

    def tier_usages(self) -> Sequence[Any]:
        """Each level's `TierUsage`, fastest first (a tiered store); none otherwise."""
        return ()

    def served_tier(self) -> Optional[str]:
        """The level that served this thread's last restore; None: the store itself."""
        return None

    def promoted_last_read(self) -> bool:
        """Whether this thread's last restore copied what it read into a faster level (a tiered
        store's promotion), which may have filled that level."""
        return False

    def flush(self) -> None:
        self.flush_beside()

    def close(self) -> None:
        self.close_beside()

    # -- values beside a chunk, written off the request path (every store: not overridden) ------
    def write_beside(self, capture: Callable[[], Callable[[], Any]], *, kind: str, limit: int) -> bool:
        """Store a value kept beside a chunk off the caller's thread: once the writer has a place
        for it, ``capture()`` runs here (what cannot wait) and returns the job that finishes the
        value and stores it (``put_skeleton``) on this store's writer thread. False, nothing
        captured, when ``limit`` jobs of ``kind`` are in flight or the store was closed.
        ``limit`` 0 runs both now, in the caller's thread (`BesideWrites`)."""
        return self._beside_writes().submit(capture, kind=kind, limit=limit)

    def flush_beside(self, bound_s: Optional[float] = None) -> None:
        """Wait for the values `write_beside` has in flight, at most ``bound_s`` (None: `FLUSH_S`;
        `StoreTimeoutError` past it). Every store's ``flush`` calls it first."""
        self._beside_writes().flush(FLUSH_S if bound_s is None else bound_s)

    def close_beside(self, bound_s: Optional[float] = None) -> None:
        """Refuse further `write_beside` jobs, wait for those in flight, stop the writer (bounded
        as `flush_beside`). Every store's ``close`` calls it before tearing anything down."""
        self._beside_writes().close(FLUSH_S if bound_s is None else bound_s)

    def _beside_writes(self) -> BesideWrites:
        with _BESIDE_LOCK:
            writes = self.__dict__.get("_beside")
            if writes is None:
                writes = self.__dict__["_beside"] = BesideWrites(self.label)
            return writes

    @property
    def ready(self) -> bool:
        """False only while a background warm-up keeps it from serving."""
        return True

    def session_starting(self) -> StartToken:
        """A session is starting: background work yields until the token is released."""
        return NO_TOKEN

    def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        return True

    @property
    def storage_format(self) -> str:
        """How it encodes values (the namespace's ``store_format``): by default its class."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    @property
    def label(self) -> str:
        """Its tier label on the metrics: its registry name, else its class name in lower case."""
        return STORES.name_of(type(self)) or type(self).__name__.lower()


class PathReadStore(TierStore):
    """A store that moves bytes itself (``reads_paths``): it takes detached views of the live ring
    on write (``accepts_device_views``) and restores a whole window path in one call."""

    reads_paths: ClassVar[bool] = True
    accepts_device_views: ClassVar[bool] = True

    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        """Fill ``target.latents`` from every node of ``path`` (depth 0..K-1), then the KV of the
        ``window`` nodes into ``target.kv`` following ``target.runs``; synchronize; release
        every view. Returns False (a miss) when a value is missing or only a partial prefix is
        transferable; raises on a store or transfer error. Publishes nothing."""
        raise NotImplementedError(f"{type(self).__name__}.read_path")


_REQUIRED = ("put_async", "get_layer", "put_skeleton", "get_skeleton", "free")
_OPTIONAL = ("get_layers", "read_path", "contains", "free_skeleton", "keys", "delete_values", "orphans",
             "copy_values_from",
             "usage", "tier_usages", "served_tier", "promoted_last_read", "session_starting", "wait_ready")


class _CallerStore(TierStore):
    """A caller's own duck-typed store behind the contract: what it has is resolved once, here
    (the only place that looks at a foreign store's attributes); the rest keeps the defaults."""

    def __init__(self, obj: Any) -> None:
        self.wrapped = obj
        found = {name: getattr(obj, name, None) for name in _REQUIRED + _OPTIONAL}
        for name, fn in found.items():
            if callable(fn):
                setattr(self, name, fn)
        views = bool(getattr(obj, "accepts_device_views", False))
        self.accepts_device_views = views  # type: ignore[misc]
        self.reads_paths = views and callable(found["read_path"])  # type: ignore[misc]
        self.knows_contents = callable(found["contains"])  # type: ignore[misc]
        self.frees_latents = callable(found["free_skeleton"])  # type: ignore[misc]
        self.lists_values = callable(found["keys"]) and callable(found["delete_values"])  # type: ignore[misc]
        self.copies_values = self.reads_paths and callable(found["copy_values_from"])  # type: ignore[misc]
        if not callable(found["usage"]):
            self.usage = lambda: _usage_of_stats(obj)  # type: ignore[method-assign]
        size = getattr(type(obj), "capacity_bytes", None)
        self.resizable = isinstance(size, property) and size.fset is not None  # type: ignore[misc]
        self.tier = getattr(obj, "tier", Tier.CPU)  # type: ignore[misc]
        self.capacity_fix = getattr(obj, "capacity_fix", TierStore.capacity_fix)  # type: ignore[misc]
        self.records = getattr(obj, "records", None) or NO_RECORDS
        self.codec_id = getattr(obj, "codec_id", None)
        self.transfer = getattr(obj, "transfer", None)
        self.device = getattr(obj, "device", None)
        fmt = getattr(obj, "storage_format", None)
        self._format = fmt or f"{type(obj).__module__}.{type(obj).__qualname__}"
        self._label = STORES.name_of(type(obj)) or type(obj).__name__.lower()

    def flush(self) -> None:
        self.flush_beside()
        flush = getattr(self.wrapped, "flush", None)
        if callable(flush):
            flush()

    def close(self) -> None:
        self.close_beside()
        close = getattr(self.wrapped, "close", None)
        if callable(close):
            close()

    def __getattr__(self, name: str) -> Any:  # anything else the caller's store has (its own calls)
        if name in ("wrapped", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    @property
    def ready(self) -> bool:
        return bool(getattr(self.wrapped, "ready", True))

    @property
    def stats(self) -> Any:  # type: ignore[override]
        return getattr(self.wrapped, "stats", None)

    @property
    def capacity_bytes(self) -> Any:
        return self.wrapped.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: Any) -> None:
        self.wrapped.capacity_bytes = value

    @property
    def storage_format(self) -> str:
        return self._format

    @property
    def label(self) -> str:
        return self._label

    def __repr__(self) -> str:
        return f"as_store({self.wrapped!r})"


def _usage_of_stats(obj: Any) -> Optional[Any]:
    """A caller's store without ``usage()``: its ``stats`` when they carry used and capacity bytes."""
    stats = getattr(obj, "stats", None)
    if getattr(stats, "capacity_bytes", None) is None or getattr(stats, "used_bytes", None) is None:
        return None
    return stats


def as_store(obj: Any) -> Any:
    """``obj`` when it is a `TierStore` (or None), else the caller's own store behind the contract
    (resolved once). Every entry point that takes a store calls it once."""
    if obj is None or isinstance(obj, TierStore):
        return obj
    return _CallerStore(obj)
