"""`FluxonClient`: a thin, time-bounded wrapper around the public fluxon-py 0.2.4 client.

Every call into Fluxon runs on its own daemon thread and is waited for at most ``op_timeout_s``
(``attach_timeout_s`` for attaching): `cacheseek.fluxon.calls`. A call that overruns raises
`StoreTimeoutError` naming the op and key and keeps running in the background; after
``MAX_STUCK_CALLS`` such calls are outstanding, new calls fail at once.

Values are one flat dict per key, the payload zero-copy readable through a `ValueView`
(`cacheseek.fluxon.values`: field names, slot sizes).

Errors (`cacheseek.fluxon.results`). KeyNotFoundError(4000) is a miss (None / False),
StorageFullError(6000) becomes `StoreFullError` with Fluxon's text, a value that cannot fit even
an empty segment `FluxonValueTooLargeError`, anything else `StoreError` with Fluxon's text. No
owner (no ``shared.json``) is `FluxonUnavailableError`, raised before Fluxon is touched: 0.2.4's
``new_store`` blocks forever without an owner (`cacheseek.fluxon.owner`).

Consistency (0.2.4, seen on a 2-core machine). A remove is visible at once to every client,
except to a process that still holds a view of the value: its own gets keep returning the held
value until it releases it. This client hides that for its own removes (a read that returns a
value this client removed while holding it is a miss); a remove by another process stays
invisible to a holder until its views are released. An overwrite of an existing key becomes
visible after up to ~1 s (the old value is returned meanwhile). CacheSeek's keys are
content-addressed, so an overwrite rewrites the same bytes.

Chunk records. ``records`` (`EtcdRecords`): the shared index of the cluster, in the service's own
etcd (its endpoints are read at attach), closed with the client.

Keys. 0.2.4 can count keys by prefix but not list them; with ``key_index`` the client keeps a
`KeyIndex` in the service's etcd (`put_*` adds the key before the value is written, `remove`
drops it after) and `list_keys` reads and repairs it (`cacheseek.fluxon.key_index`).

Lifecycle::

    FluxonClient(...)   attaches (bounded), waits settle_s (an RPC sent within ~1 s of attaching
                        can be lost and stall 30 s), probes, opens the key index
    get_view/read(key)  -> ValueView (holds the Fluxon holder) --release()/with-exit--> released
    close()             releases every open view, waits for calls in flight, closes the native
                        client (~1 s); idempotent; any later call raises StoreClosedError

A DLPack view must not be read after `close`: 0.2.4 unmaps the segment even while views are
alive and a later read crashes the process. `close` therefore releases every `ValueView` first;
arrays a caller derived from a view must be dropped before the view is released.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar

from cacheseek.errors import StoreClosedError, StoreError, StoreTimeoutError
from cacheseek.fluxon.attach import attach_native
from cacheseek.fluxon.calls import MAX_STUCK_CALLS, FluxonCalls
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.fluxon.errors import FluxonImportError, FluxonUnavailableError, FluxonValueTooLargeError
from cacheseek.fluxon.held_views import HeldViews
from cacheseek.fluxon.key_index import KeyIndex
from cacheseek.fluxon.loader import fluxon_runtime_info
from cacheseek.fluxon.native_store import shut_native_store
from cacheseek.fluxon.records import EtcdRecords
from cacheseek.fluxon.results import Miss, unwrap
from cacheseek.fluxon.segment import SegmentMapping, file_generation, mappings_of, zero_copy_mapping
from cacheseek.fluxon.values import (META_FIELD, VALUE_FIELD, ValueView, buffer_address, check_address, slot_bytes,
                                     too_large_text, writable_u8)
from cacheseek.kv.records import NO_RECORDS, ChunkRecords

log = logging.getLogger(__name__)

__all__ = ["FluxonClient", "ValueView", "SegmentMapping", "FluxonUnavailableError", "FluxonValueTooLargeError",
           "FluxonImportError", "fluxon_runtime_info", "VALUE_FIELD", "META_FIELD", "MAX_STUCK_CALLS", "slot_bytes"]

T = TypeVar("T")

_instance_counter = itertools.count(1)


class FluxonClient:
    """A client attached to one Fluxon cluster; see the module docstring for the contract.

    ``endpoint``: `FluxonEndpoint`'s fields (``cluster_name``, ``share_mem_path``,
    ``instance_key``, ``op_timeout_s``, ``attach_timeout_s``, ``settle_s``), positional in that
    order or by name; or `attach` a built endpoint.
    ``instance_key`` is a prefix: the client registers as ``<instance_key>-<pid>-<n>``
    (`instance_key` property) so that several clients and processes never collide.
    ``fluxon_log``: sets FLUXON_LOG for this process if it is not set yet: the level of what the
    native client prints on the terminal. It prints from its own threads at any time (a ``WARN
    ... OTLP log exporter disabled`` seconds after attaching, a ``SystemShutdown`` warning at
    close), past `native_output_to_log` around attach and close, so "error" keeps its warnings
    out of the report; its own log file (under the service's ``large_file_paths``, named in
    ``cacheseek.log`` at attach) keeps them whatever the level.
    """

    def __init__(self, *endpoint: Any, key_index: bool = True, fluxon_log: Optional[str] = "error",
                 **endpoint_kw: Any) -> None:
        self._open(FluxonEndpoint(*endpoint, **endpoint_kw), key_index, fluxon_log)

    @classmethod
    def attach(cls, endpoint: FluxonEndpoint, *, key_index: bool = True,
               fluxon_log: Optional[str] = "error") -> "FluxonClient":
        """A client attached to ``endpoint``'s cluster (what every Fluxon constructor builds)."""
        client = cls.__new__(cls)
        client._open(endpoint, key_index, fluxon_log)
        return client

    def _open(self, endpoint: FluxonEndpoint, key_index: bool, fluxon_log: Optional[str]) -> None:
        self.endpoint = endpoint
        self.cluster_name, self.share_mem_path = endpoint.cluster_name, endpoint.share_mem_path
        self.instance_key = f"{endpoint.instance_key}-{os.getpid()}-{next(_instance_counter)}"
        self.op_timeout_s, self.attach_timeout_s = endpoint.op_timeout_s, endpoint.attach_timeout_s
        self._calls = FluxonCalls(self.op_timeout_s, owner=self.instance_key, cluster_name=self.cluster_name,
                                   share_mem_path=self.share_mem_path)
        self._lock = self._calls.lock  # guards the views below and the call counts together
        self._store: Any = None
        self._index: Optional[KeyIndex] = None
        self._held = HeldViews(self._lock)  # the views handed out, and the removes they hide
        self._records: Optional[EtcdRecords] = None
        self.etcd_endpoints: tuple[str, ...] = ()
        if fluxon_log:
            os.environ.setdefault("FLUXON_LOG", fluxon_log)
        self.segment_bytes, self.owner_id = 0, "?"
        self._attach(key_index)

    # -- attach ---------------------------------------------------------------------------------
    @property
    def segment_dir(self) -> Path:
        return self.endpoint.segment_dir

    native_store = property(lambda self: self._store, doc="The fluxon-py store attached (None once closed): "
                            "for writing a value as another kind of writer would.")
    key_index = property(lambda self: self._index, doc="The etcd index of the keys written through this client.")

    @property
    def open_view_keys(self) -> list[str]:
        """The keys of the value views this client handed out and that are not released yet."""
        with self._lock:
            return [v.key for v in self._held.open_views()]

    def _attach(self, key_index: bool) -> None:
        t0 = time.monotonic()
        try:
            found = attach_native(self.endpoint, self.instance_key, self._run, key_index=key_index,
                                  adopt=lambda store: setattr(self, "_store", store))
        except BaseException:
            self.close()
            raise
        self.segment_bytes, self.owner_id, self.etcd_endpoints = found.segment_bytes, found.owner_id, found.etcd_endpoints
        self._records, self._index = found.records, found.index
        log.info("fluxon client %s attached to cluster %r (owner %s, segment %d bytes at %s) in %.1f s",
                 self.instance_key, self.cluster_name, self.owner_id, self.segment_bytes,
                 self.segment_dir, time.monotonic() - t0)

    # -- bounded calls --------------------------------------------------------------------------
    def _run(self, op: str, key: Optional[str], fn: Callable[[], T], timeout: Optional[float] = None,
             *, ptr_note: bool = False) -> T:
        """Run ``fn`` on a daemon thread; wait at most ``timeout`` (default op_timeout_s)."""
        return self._calls.run(op, fn, key=key, timeout_s=timeout, ptr_note=ptr_note)

    def _unwrap(self, op: str, key: Optional[str], res: Any, *, nbytes: int = 0, miss_ok: bool = False) -> Any:
        """Consume a fluxon Result and map its error; a missing key raises Miss when ``miss_ok``."""
        return unwrap(op, key, res, segment_bytes=self.segment_bytes, nbytes=nbytes, miss_ok=miss_ok)

    def check_fits(self, key: Optional[str], nbytes: int) -> None:
        """Raise `FluxonValueTooLargeError` when a value of ``nbytes`` payload bytes cannot be
        stored even in an empty segment: its power-of-two slot is the whole segment or more."""
        if self.segment_bytes and slot_bytes(nbytes) >= self.segment_bytes:
            raise FluxonValueTooLargeError(too_large_text(key, nbytes, self.segment_bytes))

    # -- writes ---------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: Any, *, meta: bytes = b"") -> None:
        """Store ``data`` (bytes, bytearray or a contiguous memoryview) under ``key`` (overwrites).
        One copy: Fluxon copies from ``data`` into the segment."""
        self._check_key(key)
        ptr, nbytes = buffer_address(data)
        self._put(key, ptr, nbytes, meta, keepalive=data, ptr_note=False)

    def put_from_ptr(self, key: str, ptr: int, nbytes: int, *, meta: bytes = b"") -> None:
        """Store ``nbytes`` read from host address ``ptr`` (valid, readable CPU memory: the caller's
        responsibility) under ``key``. One copy, by Fluxon, into the segment. After a
        StoreTimeoutError keep the memory valid: the call may still be reading it."""
        self._check_key(key)
        check_address(ptr, nbytes)
        self._put(key, ptr, nbytes, meta, keepalive=None, ptr_note=True)

    def _put(self, key: str, ptr: int, nbytes: int, meta: bytes, *, keepalive: Any, ptr_note: bool) -> None:
        if not isinstance(meta, (bytes, bytearray)):
            raise TypeError(f"meta must be bytes, got {type(meta).__name__}")
        total = nbytes + len(meta)
        if self.segment_bytes and total > self.segment_bytes:
            raise FluxonValueTooLargeError(too_large_text(key, total, self.segment_bytes))
        value: dict[str, Any] = {VALUE_FIELD: writable_u8(ptr, nbytes)}
        if meta:
            value[META_FIELD] = bytes(meta)
        if self._index is not None:
            self._index.add(key)

        def _do() -> None:
            _ = keepalive  # the source buffer stays alive as long as the call runs
            self._unwrap("put", key, self._store.put_blocking(key, value), nbytes=total)

        try:
            self._run("put", key, _do, ptr_note=ptr_note)
        except StoreError as exc:
            if not isinstance(exc, StoreTimeoutError) and self._index is not None and not self._calls.closed:
                self._index.drop_if_absent(key, self.exists, exc)
            raise

    # -- reads ----------------------------------------------------------------------------------
    def _hold(self, key: str) -> Optional[ValueView]:
        """On a call thread: get and hold ``key``'s value as a view this client does not track
        yet, or None on a miss."""
        try:
            holder = self._unwrap("get", key, self._store.get_blocking(key), miss_ok=True)
        except Miss:
            return None
        fields = self._unwrap("get", key, holder.access())
        return ValueView(key, holder, fields, self._held.forget)

    def get_view(self, key: str) -> Optional[ValueView]:
        """Hold ``key``'s value and return a `ValueView` of it, or None on a miss. Release it."""
        self._check_key(key)
        view = self._run("get", key, lambda: self._hold(key))
        if view is None:
            return None
        with self._lock:
            if self._calls.closed:
                view._drop()
                raise StoreClosedError(f"fluxon get of key {key!r}: the client closed meanwhile")
            if not self._held.track(view):  # this client removed it while holding it: a miss
                view._drop()
                return None
        return view

    @contextlib.contextmanager
    def read(self, key: str) -> Iterator[Optional[ValueView]]:
        """``with client.read(key) as view:`` -- None on a miss; released at exit."""
        view = self.get_view(key)
        try:
            yield view
        finally:
            if view is not None and not view.released:
                view.release()

    def get_bytes(self, key: str) -> Optional[bytes]:
        """A private copy of ``key``'s payload, or None on a miss (the holder is released)."""
        got = self.get_with_meta(key)  # checks the key
        return None if got is None else got[1]

    def get_with_meta(self, key: str) -> Optional[tuple[bytes, bytes]]:
        """``(meta, payload)`` copies, or None on a miss."""
        self._check_key(key)

        def _do() -> Optional[tuple[bytes, bytes]]:
            view = self._hold(key)
            if view is None:
                return None
            try:
                with self._lock:
                    if self._held.hides(key, view._ptr):
                        return None
                return view.meta, view.tobytes()
            finally:
                view._drop()

        return self._run("get", key, _do)

    def exists(self, key: str) -> bool:
        self._check_key(key)
        return bool(self._run("exists", key, lambda: self._unwrap("exists", key, self._store.is_exist(key))))

    def count_prefix(self, prefix: str = "") -> int:
        """How many keys Fluxon holds under ``prefix`` (every writer's, not only CacheSeek's)."""
        return int(self._run("count_prefix", prefix,
                             lambda: self._unwrap("count_prefix", prefix, self._store.count_prefix(prefix))))

    def remove(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""
        self._check_key(key)

        def _do() -> None:
            try:
                self._unwrap("remove", key, self._store.remove(key), miss_ok=True)
            except Miss:
                pass

        self._run("remove", key, _do)
        self._held.removed(key)
        if self._index is not None:
            self._index.remove(key)

    def list_keys(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` written through CacheSeek clients of this cluster."""
        if self._index is None:
            self._check_open()
            raise StoreError("fluxon list_keys needs the key index (key_index=True): fluxon-py 0.2.4 can "
                             "count keys by prefix (count_prefix) but not list them")
        return self._index.list_keys(prefix, self.count_prefix, self.exists)

    # -- the shared index -----------------------------------------------------------------------
    @property
    def records(self) -> ChunkRecords:
        """The cluster's chunk records (`EtcdRecords`, in the service's etcd): what every worker
        of this cluster finds chunks by; `NO_RECORDS` before attaching."""
        return self._records if self._records is not None else NO_RECORDS

    # -- the segment ----------------------------------------------------------------------------
    def segment_mappings(self) -> list[SegmentMapping]:
        """Every mapping of the owner's segment file in this process, in address order. 0.2.4
        maps it twice: read-only (``r--s``, where DLPack views point) and read-write (``rw-s``,
        where the native client writes a put's payload)."""
        self._check_open()
        return mappings_of(self.segment_dir / "mmap.file")

    def segment_mapping(self) -> Optional[SegmentMapping]:
        """This process's read-only mapping of the owner's segment file, the one zero-copy views
        point into (the largest such; None if not mapped). Falls back to the largest mapping of
        any kind when no read-only one exists."""
        return zero_copy_mapping(self.segment_mappings())

    def segment_generation(self) -> int:
        """An identity of the owner's segment file (its inode and device, folded to 31 bits): it
        changes when a restarted owner recreates the segment."""
        return file_generation(self.segment_dir / "mmap.file")

    # -- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._calls.closed

    def close(self) -> None:
        """Release open views, wait for calls in flight, close the native client. Idempotent."""
        with self._lock:
            if not self._calls.mark_closed():
                return
            views = self._held.open_views()
        for view in views:
            if not view.released:
                view._drop_by_close()
        if views:
            log.warning("fluxon client %s: %d value views were still open at close: released",
                        self.instance_key, len(views))
        if self._records is not None:
            self._records.close()
        drained = self._calls.drain(self.op_timeout_s)
        store, self._store, self._index = self._store, None, None
        if store is not None:
            shut_native_store(store, drained, self._run, who=self.instance_key)

    def __enter__(self) -> "FluxonClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._calls.closed:
            raise StoreClosedError(f"the Fluxon client {self.instance_key} is closed")

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"fluxon keys must be non-empty strings, got {key!r}")
        self._check_open()
