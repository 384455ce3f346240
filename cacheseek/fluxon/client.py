"""`FluxonClient`: a thin, time-bounded wrapper around the public fluxon-py 0.2.4 client.

Every call into Fluxon runs on its own daemon thread and is waited for at most ``op_timeout_s``
(``attach_timeout_s`` for attaching): a put issued after the service stopped was seen to return
only after ~450 s. A call that overruns raises `StoreTimeoutError` naming the op and key and keeps
running in the background (its thread is a daemon; process exit is not held up). After
``MAX_STUCK_CALLS`` such calls are outstanding, new calls fail at once.

Value format. CacheSeek writes every value as one flat dict with:
- ``VALUE_FIELD``: the payload, a 1-D uint8 DLPack array. Read back through ``access()`` it is a
  zero-copy, read-only view into the owner's segment file as mapped in this process (see
  `segment_mapping`). The field name is 51 bytes long so that the payload of a value of 4 KiB or
  more starts 64 bytes into its slot: 64-byte aligned (0.2.4 lays the data out 13 + len(name)
  bytes after the slot start).
- ``META_FIELD`` (only when non-empty): small caller metadata (e.g. a tensor header), as bytes.
Reads also accept a bytes field named ``payload`` (what fluxon's own
``put_payload_from_ptr_blocking`` writes); such a value comes back as a private copy.

Errors. KeyNotFoundError(4000) is a miss (None / False), StorageFullError(6000) becomes
`StoreFullError` with Fluxon's text, a value that cannot fit even an empty segment
`FluxonValueTooLargeError`, anything else `StoreError` with Fluxon's text. No owner
(no ``shared.json``) is `FluxonUnavailableError`, raised before Fluxon is touched: 0.2.4's
``new_store`` blocks forever without an owner.

Consistency (0.2.4, seen on a 2-core machine). A remove is visible at once to every client,
except to a process that still holds a view of the value: its own gets keep returning the held
value until it releases it. This client hides that for its own removes (a read that returns a
value this client removed while holding it is a miss); a remove by another process stays
invisible to a holder until its views are released. An overwrite of an existing key becomes
visible after up to ~1 s (the old value is returned meanwhile). CacheSeek's keys are
content-addressed, so an overwrite rewrites the same bytes.

Keys. 0.2.4 can count keys by prefix but not list them, so the client keeps a key index in the
service's etcd (``/cacheseek/key_index/<cluster>/<key>``, ~1 ms a key): `put_*` adds the key
before the value is written, `remove` drops it after. `list_keys` reads the index and checks it
against Fluxon's ``count_prefix``; on a mismatch (values evicted, a crash between the two writes,
keys written by other clients) it checks each key, drops stale entries and warns about keys it
cannot see.

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
import ctypes
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar
import weakref

from cacheseek.errors import (
    CacheSeekError,
    ConfigError,
    HandleStateError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
)
from cacheseek.fluxon.service import DEFAULT_CLUSTER_NAME, DEFAULT_SHARE_MEM_PATH, _endpoint_answers

log = logging.getLogger(__name__)

__all__ = [
    "FluxonClient",
    "ValueView",
    "SegmentMapping",
    "FluxonUnavailableError",
    "FluxonValueTooLargeError",
    "FluxonImportError",
    "fluxon_runtime_info",
    "VALUE_FIELD",
    "META_FIELD",
    "MAX_STUCK_CALLS",
    "slot_bytes",
]

T = TypeVar("T")

VALUE_FIELD = "cacheseek.value." + "_" * 35  # 51 bytes: payload 64-byte aligned (see above)
META_FIELD = "cacheseek.meta"
LEGACY_FIELD = "payload"
MAX_STUCK_CALLS = 4
SLOT_HEADER_ALLOWANCE = 256  # field names, DLPack meta and Fluxon's own header, rounded up
PROBE_KEY = "__cacheseek_probe__"
_KEY_NOT_FOUND, _STORAGE_FULL = 4000, 6000
_instance_counter = itertools.count(1)


class FluxonUnavailableError(StoreError):
    """No Fluxon owner serves the requested cluster (no or stale ``shared.json``)."""


class FluxonValueTooLargeError(StoreError):
    """A value cannot fit the owner's segment even when the segment is empty."""


class FluxonImportError(StoreError):
    """fluxon-py could not be imported through normal package resolution."""


# -- importing fluxon ---------------------------------------------------------------------------

_runtime_info: Optional[dict[str, Any]] = None
_runtime_lock = threading.Lock()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_fluxon() -> Any:
    """Import fluxon_py (normal resolution, lazily) and log what was loaded, once per process."""
    global _runtime_info
    import importlib
    import importlib.util
    import sys

    try:
        fluxon_py = importlib.import_module("fluxon_py")
        from fluxon_py.tool import import_fluxon_pyo3_local

        pyo3 = import_fluxon_pyo3_local()  # the package's own loader (RTLD_LOCAL, bundled libs)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the loader's RuntimeError
        tried = []
        for name in ("fluxon_py", "fluxon_pyo3"):
            try:
                spec = importlib.util.find_spec(name)
                tried.append(f"{name} -> {spec.origin if spec else 'not found'}")
            except (ImportError, ValueError) as e:
                tried.append(f"{name} -> {e}")
        raise FluxonImportError(
            f"cannot import fluxon-py with {sys.executable} (normal package resolution: "
            f"{'; '.join(tried)}): {type(exc).__name__}: {exc}. Install it: pip install -e '.[fluxon]' "
            "from the repository root, or bash tools/install_fluxon_deps.sh (fluxon-py and etcd)") from exc
    with _runtime_lock:
        if _runtime_info is None:
            # The Python extension modules of fluxon_pyo3 (normally one .so) as loaded here, plus
            # the count of native libraries bundled beside them (fluxon_pyo3.libs/).
            exts: dict[str, Optional[str]] = {}
            bundled: set[str] = set()
            for mod in list(sys.modules.values()):
                path = getattr(mod, "__file__", None) or ""
                if "fluxon_pyo3" in path and path.endswith(".so"):
                    exts.setdefault(os.path.realpath(path), None)
            with contextlib.suppress(OSError):
                for line in open("/proc/self/maps"):
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if "fluxon_pyo3" not in path:
                        continue
                    if "fluxon_pyo3.libs" in path:
                        bundled.add(path)
                    elif ".so" in os.path.basename(path):
                        exts.setdefault(path, None)
            for path in exts:
                try:
                    exts[path] = _sha256(path)
                except OSError as exc:
                    exts[path] = f"unreadable: {exc}"
            _runtime_info = {
                "fluxon_py_version": getattr(fluxon_py, "__version__", "unknown"),
                "fluxon_py_path": os.path.dirname(os.path.realpath(fluxon_py.__file__)),
                "fluxon_pyo3_path": os.path.realpath(getattr(pyo3, "__file__", "") or ""),
                "extensions": exts,
                "bundled_libraries": sorted(bundled),
            }
            log.info("fluxon_py %s from %s", _runtime_info["fluxon_py_version"], _runtime_info["fluxon_py_path"])
            for path, digest in exts.items():
                log.info("fluxon_pyo3 extension loaded: %s sha256=%s", path, digest)
            if bundled:
                log.info("fluxon_pyo3 loaded %d bundled native libraries from %s", len(bundled),
                         os.path.dirname(sorted(bundled)[0]))
    return fluxon_py


def fluxon_runtime_info() -> dict[str, Any]:
    """fluxon_py version and path, and the path and SHA256 of each loaded fluxon_pyo3 library."""
    _load_fluxon()
    assert _runtime_info is not None
    return dict(_runtime_info)


# -- value types --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentMapping:
    """The owner's segment file as mapped in this process (from /proc/self/maps)."""

    path: str
    start: int
    end: int
    perms: str  # e.g. "r--s": read-only, shared

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def writable(self) -> bool:
        return "w" in self.perms

    def contains(self, ptr: int, nbytes: int = 0) -> bool:
        return self.start <= ptr and ptr + nbytes <= self.end


class ValueView:
    """One value read back and held: ``ptr``/``nbytes`` address its payload.

    For a value CacheSeek wrote, the payload is a zero-copy, read-only view into the owner's
    segment (``zero_copy`` True); the Fluxon holder keeps it in place until `release`. Use it as
    a context manager, or call `release` exactly once (a second call raises HandleStateError).
    `FluxonClient.close` releases views still open. Made only by `FluxonClient`.
    """

    def __init__(self, client: "FluxonClient", key: str, holder: Any, fields: dict[str, Any]) -> None:
        import numpy as np

        self._client = client
        self.key = key
        self._holder = holder
        self._fields: Optional[dict[str, Any]] = fields
        meta = fields.get(META_FIELD, b"")
        self.meta: bytes = bytes(meta) if isinstance(meta, (bytes, bytearray)) else b""
        raw = fields.get(VALUE_FIELD, fields.get(LEGACY_FIELD))
        if raw is None:
            names = sorted(k for k in fields if not k.startswith("__"))
            raise StoreError(f"fluxon value {key!r} has no payload field ({VALUE_FIELD!r} or "
                             f"{LEGACY_FIELD!r}); its fields: {names}")
        if isinstance(raw, (bytes, bytearray)):
            arr = np.frombuffer(raw, dtype=np.uint8)
            self.zero_copy = False
        elif hasattr(raw, "__dlpack__"):
            arr = np.from_dlpack(raw)
            if not arr.flags.c_contiguous:
                raise StoreError(f"fluxon value {key!r}: DLPack field is not contiguous")
            arr = arr.reshape(-1).view(np.uint8)
            self.zero_copy = True
        else:
            raise StoreError(f"fluxon value {key!r}: payload field has type {type(raw).__name__}")
        self._raw: Any = raw
        self._array: Any = arr
        self.nbytes: int = int(arr.nbytes)
        self._ptr: int = int(arr.ctypes.data) if self.nbytes else 0
        self._released = False
        self._released_by_close = False

    def _check(self) -> None:
        if self._released:
            raise HandleStateError(f"view of fluxon value {self.key!r} was released"
                                   + (" by client.close()" if self._released_by_close else ""))

    @property
    def ptr(self) -> int:
        """Address of the first payload byte (0 for an empty value)."""
        self._check()
        return self._ptr

    @property
    def array(self) -> Any:
        """The payload as a 1-D uint8 numpy array (read-only for zero-copy views)."""
        self._check()
        return self._array

    @property
    def holder(self) -> Any:
        """The fluxon_py MemHolder that keeps the value in place."""
        self._check()
        return self._holder

    @property
    def released(self) -> bool:
        return self._released

    def tobytes(self) -> bytes:
        """A private copy of the payload."""
        self._check()
        return self._array.tobytes()

    def release(self) -> None:
        """Drop the holder; the value may then move or be evicted. A second call raises."""
        if self._released:
            if self._released_by_close:
                return
            raise HandleStateError(f"view of fluxon value {self.key!r} released twice")
        self._drop()
        self._client._forget_view(self)

    def _drop(self) -> None:
        self._released = True
        self._array = self._raw = self._fields = self._holder = None

    def __enter__(self) -> "ValueView":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"ptr=0x{self._ptr:x}"
        return f"ValueView(key={self.key!r}, nbytes={self.nbytes}, zero_copy={self.zero_copy}, {state})"


# -- helpers ------------------------------------------------------------------------------------


def _writable_u8(ptr: int, nbytes: int) -> Any:
    """A writable numpy uint8 array over raw memory (fluxon's DLPack put refuses read-only ones).
    Nothing writes through it: Fluxon only reads it."""
    import numpy as np

    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _buffer_address(data: Any) -> tuple[int, int]:
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)  # zero-copy over bytes, bytearray or memoryview
    return (int(arr.ctypes.data) if arr.nbytes else 0), int(arr.nbytes)


def slot_bytes(nbytes: int) -> int:
    """The power-of-two slot a value of ``nbytes`` payload bytes occupies in the owner's segment
    (field names, DLPack metadata and Fluxon's header included, rounded up)."""
    need = nbytes + SLOT_HEADER_ALLOWANCE
    return 1 << (need - 1).bit_length()


_slot_bytes = slot_bytes


def _error_text(err: Any) -> str:
    msg = getattr(err, "message", None)
    code = None
    with contextlib.suppress(Exception):
        code = err.code()
    name = type(err).__name__
    return f"{name}({code}): {msg if msg is not None else err}"


def _error_code(err: Any) -> Optional[int]:
    with contextlib.suppress(Exception):
        return int(err.code())
    return None


@contextlib.contextmanager
def _native_output_to_log() -> Iterator[None]:
    """While attaching, fluxon-py's native client prints its config and banners straight to file
    descriptors 1 and 2: send them to this module's log (the run's log file) instead."""
    import tempfile

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            for line in sink.read().decode("utf-8", errors="replace").splitlines():
                if line.strip():
                    log.info("fluxon-py: %s", re.sub(r"\x1b\[[0-9;]*m", "", line))


class _Miss(Exception):
    """Internal: the key does not exist."""


# -- the client ---------------------------------------------------------------------------------


class FluxonClient:
    """A client attached to one Fluxon cluster; see the module docstring for the contract.

    ``instance_key`` is a prefix: the client registers as ``<instance_key>-<pid>-<n>``
    (`instance_key` property) so that several clients and processes never collide.
    ``fluxon_log``: sets FLUXON_LOG for this process if it is not set yet (the native client
    logs to stderr and to the owner's log folder; "warn" keeps stderr quiet).
    """

    def __init__(
        self,
        cluster_name: str = DEFAULT_CLUSTER_NAME,
        share_mem_path: str = DEFAULT_SHARE_MEM_PATH,
        instance_key: str = "cacheseek-client",
        *,
        op_timeout_s: float = 30.0,
        attach_timeout_s: float = 30.0,
        settle_s: float = 2.0,
        key_index: bool = True,
        fluxon_log: Optional[str] = "warn",
    ) -> None:
        for field, value in (("op_timeout_s", op_timeout_s), ("attach_timeout_s", attach_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"store.{field}", f"must be a positive number of seconds, got {value!r}")
        if not cluster_name or not isinstance(cluster_name, str):
            raise ConfigError("store.cluster_name", f"must be a non-empty string, got {cluster_name!r}")
        if not isinstance(share_mem_path, str) or not os.path.isabs(share_mem_path):
            raise ConfigError("store.share_mem_path", f"must be an absolute path, got {share_mem_path!r}",
                              "e.g. /dev/shm/cacheseek-fluxon (what the service was started with)")
        if not instance_key or not isinstance(instance_key, str):
            raise ConfigError("store.instance_key", f"must be a non-empty string, got {instance_key!r}")
        self.cluster_name = cluster_name
        self.share_mem_path = os.path.normpath(share_mem_path)
        self.instance_key = f"{instance_key}-{os.getpid()}-{next(_instance_counter)}"
        self.op_timeout_s = float(op_timeout_s)
        self.attach_timeout_s = float(attach_timeout_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._stuck = 0
        self._closed = False
        self._store: Any = None
        self._etcd: Any = None
        self._views: "weakref.WeakSet[ValueView]" = weakref.WeakSet()
        # key -> payload addresses of views this process held when it removed the key (see remove)
        self._removed_held: dict[str, set[int]] = {}
        if fluxon_log:
            os.environ.setdefault("FLUXON_LOG", fluxon_log)
        self._attach(float(settle_s), key_index)

    # -- attach ---------------------------------------------------------------------------------

    @property
    def segment_dir(self) -> Path:
        return Path(self.share_mem_path) / self.cluster_name

    def _read_shared_json(self) -> dict[str, Any]:
        path = self.segment_dir / "shared.json"
        hint = (f"start one with: python tools/fluxon_service.py start --cluster-name {self.cluster_name} "
                f"--share-mem-path {self.share_mem_path} (inside the same network namespace)")
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError:
            raise FluxonUnavailableError(
                f"no Fluxon owner serves cluster {self.cluster_name!r}: {path} does not exist; {hint}") from None
        except (OSError, ValueError) as exc:
            raise FluxonUnavailableError(f"cannot read the owner's {path}: {exc}; {hint}") from None
        if info.get("cluster_name") not in (None, self.cluster_name):
            raise FluxonUnavailableError(
                f"{path} belongs to cluster {info.get('cluster_name')!r}, not {self.cluster_name!r}")
        endpoints = [e for e in info.get("etcd_addresses") or [] if isinstance(e, str)]
        if endpoints and not any(_endpoint_answers(e, 1.0) for e in endpoints):
            raise FluxonUnavailableError(
                f"{path} is stale: the service that wrote it is gone (its etcd {', '.join(endpoints)} "
                f"refuses connections); {hint}")
        return info

    def _attach(self, settle_s: float, key_index: bool) -> None:
        fx = _load_fluxon()  # first: without fluxon-py, starting a service would not help either
        shared = self._read_shared_json()
        self.segment_bytes = int(shared.get("segment_len") or 0)
        self.owner_id = str(shared.get("owner_id", "?"))
        try:
            config = fx.FluxonKvClientConfig({
                "instance_key": self.instance_key,
                "fluxonkv_spec": {"cluster_name": self.cluster_name, "share_mem_path": self.share_mem_path},
            })
        except (ValueError, TypeError) as exc:
            raise ConfigError("store", f"fluxon rejected the client config: {exc}") from None
        t0 = time.monotonic()

        def _new() -> Any:
            res = fx.new_store(config)
            if res.is_ok():
                return res.unwrap()
            raise StoreError(
                f"fluxon new_store failed for cluster {self.cluster_name!r} at {self.share_mem_path} "
                f"(instance {self.instance_key}): {_error_text(res.unwrap_error())}")

        with _native_output_to_log():
            self._store = self._run("attach", None, _new, self.attach_timeout_s)
        try:
            with _native_output_to_log():
                time.sleep(settle_s)
                # the first RPC is part of attaching: bounded by attach_timeout_s, not op_timeout_s
                self._run("exists", PROBE_KEY,
                          lambda: self._unwrap("exists", PROBE_KEY, self._store.is_exist(PROBE_KEY)),
                          self.attach_timeout_s)
            if key_index:
                from fluxon_py.tool import import_fluxon_pyo3_local

                endpoints = self._run("attach", None, lambda: list(self._store.get_etcd_config()))
                self._etcd = import_fluxon_pyo3_local().EtcdKvClient(endpoints)
        except BaseException:
            self.close()
            raise
        log.info("fluxon client %s attached to cluster %r (owner %s, segment %d bytes at %s) in %.1f s",
                 self.instance_key, self.cluster_name, self.owner_id, self.segment_bytes,
                 self.segment_dir, time.monotonic() - t0)

    # -- bounded calls --------------------------------------------------------------------------

    def _run(self, op: str, key: Optional[str], fn: Callable[[], T], timeout: Optional[float] = None,
             *, ptr_note: bool = False) -> T:
        """Run ``fn`` on a daemon thread; wait at most ``timeout`` (default op_timeout_s)."""
        timeout = self.op_timeout_s if timeout is None else timeout
        what = f"fluxon {op}" + (f" of key {key!r}" if key is not None else "")
        with self._lock:
            if self._closed and op != "close":
                raise StoreClosedError(f"{what}: the Fluxon client {self.instance_key} is closed")
            if self._stuck >= MAX_STUCK_CALLS:
                raise StoreTimeoutError(
                    f"{what} not issued: {self._stuck} earlier Fluxon calls are still stuck (the service "
                    f"of cluster {self.cluster_name!r} is probably gone)")
            self._inflight += 1
        box: dict[str, Any] = {}
        done = threading.Event()

        def runner() -> None:
            try:
                box["value"] = fn()
            except (CacheSeekError, _Miss) as exc:
                box["error"] = exc
            except Exception as exc:  # noqa: BLE001 - a raw error from fluxon-py or its etcd client
                err = StoreError(f"{what} raised {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                box["error"] = err
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                with self._lock:
                    done.set()
                    if box.get("abandoned"):
                        self._stuck -= 1
                        box.clear()  # drop a late holder or value at once
                    else:
                        self._inflight -= 1
                        self._idle.notify_all()

        threading.Thread(target=runner, name=f"fluxon-{op}", daemon=True).start()
        if not done.wait(timeout):
            with self._lock:
                if not done.is_set():
                    box["abandoned"] = True
                    self._inflight -= 1
                    self._stuck += 1
                    self._idle.notify_all()
                    note = (" Keep the source memory valid: the call may still read it." if ptr_note else "")
                    raise StoreTimeoutError(
                        f"{what} did not complete within {timeout:.1f} s (cluster {self.cluster_name!r} "
                        f"at {self.share_mem_path}); the service may be stopped or overloaded. The call "
                        f"goes on in the background.{note}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _unwrap(self, op: str, key: Optional[str], res: Any, *, nbytes: int = 0, miss_ok: bool = False) -> Any:
        """Consume a fluxon Result (0.2.4 asserts every Result is consumed) and map its error;
        a missing key raises _Miss when ``miss_ok``."""
        if res.is_ok():
            return res.unwrap()
        err = res.unwrap_error()
        code = _error_code(err)
        name = type(err).__name__
        where = f"fluxon {op}" + (f" of key {key!r}" if key is not None else "")
        if miss_ok and (code == _KEY_NOT_FOUND or name == "KeyNotFoundError"):
            raise _Miss()
        if code == _STORAGE_FULL or name == "StorageFullError":
            if self.segment_bytes and _slot_bytes(nbytes) > self.segment_bytes:
                raise FluxonValueTooLargeError(self._too_large_text(key, nbytes) + f" ({_error_text(err)})")
            raise StoreFullError(f"{where} ({nbytes} bytes): store full: {_error_text(err)}")
        raise StoreError(f"{where} failed: {_error_text(err)}")

    def check_fits(self, key: Optional[str], nbytes: int) -> None:
        """Raise `FluxonValueTooLargeError` when a value of ``nbytes`` payload bytes cannot be
        stored even in an empty segment: its power-of-two slot is the whole segment or more."""
        if self.segment_bytes and slot_bytes(nbytes) >= self.segment_bytes:
            raise FluxonValueTooLargeError(self._too_large_text(key, nbytes))

    def _too_large_text(self, key: Optional[str], nbytes: int) -> str:
        return (f"fluxon value {key!r} of {nbytes} bytes cannot fit: it needs a slot of "
                f"{_slot_bytes(nbytes)} bytes (values take power-of-two slots, header included) and "
                f"the owner's whole segment is {self.segment_bytes} bytes")

    # -- writes ---------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: Any, *, meta: bytes = b"") -> None:
        """Store ``data`` (bytes, bytearray or a contiguous memoryview) under ``key`` (overwrites).
        One copy: Fluxon copies from ``data`` into the segment."""
        self._check_key(key)
        ptr, nbytes = _buffer_address(data)
        self._put(key, ptr, nbytes, meta, keepalive=data, ptr_note=False)

    def put_from_ptr(self, key: str, ptr: int, nbytes: int, *, meta: bytes = b"") -> None:
        """Store ``nbytes`` read from host address ``ptr`` (valid, readable CPU memory: the caller's
        responsibility) under ``key``. One copy, by Fluxon, into the segment. After a
        StoreTimeoutError keep the memory valid: the call may still be reading it."""
        self._check_key(key)
        if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
            raise ValueError(f"ptr must be a non-negative int address, got {ptr!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if nbytes and not ptr:
            raise ValueError("ptr is NULL")
        self._put(key, ptr, nbytes, meta, keepalive=None, ptr_note=True)

    def _put(self, key: str, ptr: int, nbytes: int, meta: bytes, *, keepalive: Any, ptr_note: bool) -> None:
        if not isinstance(meta, (bytes, bytearray)):
            raise TypeError(f"meta must be bytes, got {type(meta).__name__}")
        total = nbytes + len(meta)
        if self.segment_bytes and total > self.segment_bytes:
            raise FluxonValueTooLargeError(self._too_large_text(key, total))
        value: dict[str, Any] = {VALUE_FIELD: _writable_u8(ptr, nbytes)}
        if meta:
            value[META_FIELD] = bytes(meta)
        self._index_add(key)

        def _do() -> None:
            _ = keepalive  # the source buffer stays alive as long as the call runs
            self._unwrap("put", key, self._store.put_blocking(key, value), nbytes=total)

        try:
            self._run("put", key, _do, ptr_note=ptr_note)
        except StoreError as exc:
            if not isinstance(exc, StoreTimeoutError):
                self._index_drop_if_absent(key, exc)
            raise

    # -- reads ----------------------------------------------------------------------------------

    def get_view(self, key: str) -> Optional[ValueView]:
        """Hold ``key``'s value and return a `ValueView` of it, or None on a miss. Release it."""
        self._check_key(key)

        def _do() -> tuple[Any, dict[str, Any]]:
            try:
                holder = self._unwrap("get", key, self._store.get_blocking(key), miss_ok=True)
            except _Miss:
                return None, {}
            fields = self._unwrap("get", key, holder.access())
            return holder, fields

        holder, fields = self._run("get", key, _do)
        if holder is None:
            return None
        view = ValueView(self, key, holder, fields)
        with self._lock:
            if self._closed:
                view._drop()
                raise StoreClosedError(f"fluxon get of key {key!r}: the client closed meanwhile")
            if self._removed_while_held(key, view._ptr):
                view._drop()
                return None
            self._views.add(view)
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
        self._check_key(key)
        got = self.get_with_meta(key)
        return None if got is None else got[1]

    def get_with_meta(self, key: str) -> Optional[tuple[bytes, bytes]]:
        """``(meta, payload)`` copies, or None on a miss."""
        self._check_key(key)

        def _do() -> Optional[tuple[bytes, bytes]]:
            try:
                holder = self._unwrap("get", key, self._store.get_blocking(key), miss_ok=True)
            except _Miss:
                return None
            fields = self._unwrap("get", key, holder.access())
            view = ValueView(self, key, holder, fields)
            try:
                with self._lock:
                    if self._removed_while_held(key, view._ptr):
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
            except _Miss:
                pass

        self._run("remove", key, _do)
        with self._lock:
            held = {v._ptr for v in self._views if v.key == key and not v.released}
            if held:
                self._removed_held.setdefault(key, set()).update(held)
        if self._etcd is not None:
            self._run("index remove", key, lambda: self._etcd.delete(self._index_key(key)))

    def list_keys(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` written through CacheSeek clients of this cluster."""
        if self._etcd is None:
            self._check_open()
            raise StoreError("fluxon list_keys needs the key index (key_index=True): fluxon-py 0.2.4 can "
                             "count keys by prefix (count_prefix) but not list them")
        root = self._index_key(prefix)
        entries = self._run("index list", prefix, lambda: self._etcd.get_prefix(root))
        keys = sorted(k.decode("utf-8")[len(self._index_key("")):] for k, _ in entries)
        count = self.count_prefix(prefix)
        if count == len(keys):
            return keys
        present = [k for k in keys if self.exists(k)]
        for k in set(keys) - set(present):
            self._run("index remove", k, lambda k=k: self._etcd.delete(self._index_key(k)))
        if count > len(present):
            log.warning("fluxon list_keys(%r): %d keys in Fluxon were not written through CacheSeek's key "
                        "index and are not listed", prefix, count - len(present))
        elif len(present) < len(keys):
            log.info("fluxon list_keys(%r): dropped %d stale index entries (values evicted or never "
                     "written)", prefix, len(keys) - len(present))
        return present

    # -- the segment ----------------------------------------------------------------------------

    def segment_mappings(self) -> list[SegmentMapping]:
        """Every mapping of the owner's segment file in this process, in address order. 0.2.4
        maps it twice: read-only (``r--s``, where DLPack views point) and read-write (``rw-s``,
        where the native client writes a put's payload)."""
        self._check_open()
        target = os.path.realpath(self.segment_dir / "mmap.file")
        out: list[SegmentMapping] = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip() == target:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append(SegmentMapping(target, lo, hi, parts[1]))
        return out

    def segment_mapping(self) -> Optional[SegmentMapping]:
        """This process's read-only mapping of the owner's segment file, the one zero-copy views
        point into (the largest such; None if not mapped). Falls back to the largest mapping of
        any kind when no read-only one exists."""
        maps = self.segment_mappings()
        ro = [m for m in maps if not m.writable] or maps
        return max(ro, key=lambda m: m.length, default=None)

    def segment_generation(self) -> int:
        """An identity of the owner's segment file (its inode and device, folded to 31 bits): it
        changes when a restarted owner recreates the segment."""
        st = os.stat(self.segment_dir / "mmap.file")
        return ((st.st_ino * 1_000_003) ^ st.st_dev) & 0x7FFF_FFFF

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stuck_calls(self) -> int:
        return self._stuck

    def close(self) -> None:
        """Release open views, wait for calls in flight, close the native client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            views = list(self._views)
        for view in views:
            if not view.released:
                view._released_by_close = True
                view._drop()
        if views:
            log.warning("fluxon client %s: %d value views were still open at close: released",
                        self.instance_key, len(views))
        deadline = time.monotonic() + self.op_timeout_s
        with self._lock:
            while self._inflight > 0 and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.01, deadline - time.monotonic()))
            stuck, inflight = self._stuck, self._inflight
        store, self._store, self._etcd = self._store, None, None
        if store is None:
            return
        if stuck or inflight:
            log.warning("fluxon client %s: %d calls are still stuck in Fluxon; the native client cannot "
                        "be closed while they run and is left to process exit", self.instance_key,
                        stuck + inflight)
            with contextlib.suppress(Exception):  # fluxon's atexit close would only fail the same way
                from fluxon_py.kvclient.backend_fallback_close import unregister_store_from_cleanup

                unregister_store_from_cleanup(store)
            return

        def _close() -> None:
            res = store.close()
            if res.is_ok():
                res.unwrap()
            else:
                raise StoreError(f"fluxon close failed: {_error_text(res.unwrap_error())}")

        try:
            self._run("close", None, _close)
        except StoreTimeoutError as exc:
            log.warning("fluxon client %s: %s", self.instance_key, exc)
        log.debug("fluxon client %s closed", self.instance_key)

    def __enter__(self) -> "FluxonClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the Fluxon client {self.instance_key} is closed")

    def _check_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"fluxon keys must be non-empty strings, got {key!r}")
        self._check_open()

    def _forget_view(self, view: ValueView) -> None:
        with self._lock:
            self._views.discard(view)
            if view.key in self._removed_held and not any(
                    v.key == view.key and not v.released for v in self._views):
                del self._removed_held[view.key]  # Fluxon answers right again once none is held

    def _removed_while_held(self, key: str, ptr: int) -> bool:
        """Whether a value read back is one this process removed while it held a view of it:
        0.2.4 keeps serving a value to the process that holds it, even after a remove (any
        client's). Such a read is a miss; a value put again lands elsewhere and reads normally.
        Caller holds the lock."""
        return ptr in self._removed_held.get(key, ())

    def _index_key(self, key: str) -> str:
        return f"/cacheseek/key_index/{self.cluster_name}/{key}"

    def _index_add(self, key: str) -> None:
        if self._etcd is not None:
            self._run("index put", key, lambda: self._etcd.put(self._index_key(key), b""))

    def _index_drop_if_absent(self, key: str, cause: BaseException) -> None:
        """After a failed put: drop the index entry unless an older value is still there."""
        if self._etcd is None or self._closed:
            return
        try:
            if not self.exists(key):
                self._run("index remove", key, lambda: self._etcd.delete(self._index_key(key)))
        except StoreError as exc:
            log.debug("fluxon: could not tidy the key index after %s: %s", cause, exc)
