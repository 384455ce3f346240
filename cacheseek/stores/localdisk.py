"""The LocalDisk tier: a `KeyValueTier` whose values are real files under one root folder.

Layout: one file per value, ``{root}/{sha256(key)[:2]}/{escaped key}``. The escape keeps
``[A-Za-z0-9_-]`` and writes every other UTF-8 byte as ``%XX``, so it is reversible (`keys`) and
an escaped name never contains a dot; temporary files (``.{name}.w{pid}x{random}.tmp``, named for
the process writing them) always do, so they are never mistaken for values.

File format (`cacheseek.stores.disk_values`): ``MAGIC`` (8 bytes), header length (u32 little-endian), a JSON header, the raw
payload. The header says the kind (``tensor``, ``bytes``, ``str`` or ``json``: plain data such as a
number or a list, for layers that are not tensors; tuples read back as lists), the payload size,
for tensors dtype and shape, and the xxh3 checksum of header and payload
(`cacheseek.stores.checksum`). Tensors are written byte for byte through a ``uint8`` view (bf16
included, no numpy dtype needed) and read back as contiguous CPU tensors.

Writes are atomic: a temp file in the value's folder, ``fsync``, ``os.replace``, ``fsync`` of the
folder. A reader sees the old value, the new one or none, never a partial file.

One root, many processes (issue 31: one worker per GPU): any number of stores, in this process
or others, open one root at once (each holds a shared ``flock`` on ``{root}/.lock``, never
written). The root is its own index: after every value of a chunk is written, its *record*
(`DiskRecords`, ``{node hex}:rec``: the chunk's geometry and each value's checksum) is created
where none is, by hard-linking a complete temp file: the commit point, last, and the first writer
wins. Any process finds a chunk by its key in the records (`cacheseek.kv.records`); a read checks
each value against the record's checksum, so a chunk is never mixed from two writers' bytes.
``free`` removes the record first, then the values: a process that found the record and reads a
value already gone gets a miss. No forest snapshot is loaded or saved; a ``forest.json`` in the
root is never opened.

Durable commit is the default (``fsync=True``): every value of a blob, and then its record, is on
the device before the blob's handle is ready, so a record never names a value a power loss can
take. ``fsync=False`` is the explicit weaker mode (faster on slow disks): after a crash a record
may name values that are gone or torn; they read as missing or corrupt and the manager
invalidates those nodes (data lost, never wrong). A temp file is invisible to reads and
``keys()``; one whose writer is gone (its pid, on this host) is removed when the root is next
opened, never another live process's write in flight.

Reads return None for a missing value. A file that exists but is truncated, fails its checksum
or is not in this format raises `CorruptValueError` naming the key and the file; `KeyValueTier`
removes it and reads it as missing, so the manager invalidates the node and retries the longest
whole shorter prefix (a poisoned file never outlives the read that found it).

A full disk (``ENOSPC``, ``EDQUOT``) is `StoreFullError`: the tier caps itself at the bytes it
holds and the manager evicts (`KeyValueTier`). Usage is counted in file bytes (header included)
at write time and at reopen alike (``stored_nbytes``); ``usage()`` is the root's, every process's
files included (a periodic scan), so the capacity is the cache's, not one process's. A full
disk's lowered cap rises again once the disk has room (``usage()`` re-probes it).

Opening a root lists it once, shard by shard (`LISTING_THREADS` shards at once, each listing
bounded by ``op_timeout_s``): the usage seed and the sweep of gone writers' temp files in one pass,
no file opened. A file whose name is not one this store would write in that shard (a value's name
in another key's shard, an escape `encode_key` never writes) is not a value: never listed,
counted, read or removed as one. experiments/root_open measures the open of 100k and 1M chunks.

Values of a chunk that was never committed (no record names it: a killed writer's half chunk)
and older than ``orphan_grace_s`` are garbage: `WorldKVManager.reconcile` removes them
(``orphans`` and ``delete_values`` here), so a reopened root does not fill with unreachable values;
a younger one may be another process's write in flight and stays. ``delete`` unlinks the file, so
freeing a blob gives its disk space back at once.

Links and other files nobody here wrote (`cacheseek.stores.root_files`): the root is created
``0700`` and must be this user's and writable by nobody else; every file is reached through the
root's descriptor without following links (a shard folder that is a link is refused, at open a
`ConfigError`; a value file that is a link, a FIFO or a folder reads as corrupt, never blocks and
is not counted in usage); only value and temp names this store writes are ever removed.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from cacheseek.errors import ConfigError, CorruptValueError, StoreError, StoreFullError
from cacheseek.eviction.base import StoreUsage
from cacheseek.kv.handles import Tier
from cacheseek.kv.claims import CLAIM_SUFFIX
from cacheseek.kv.records import RECORD_SUFFIX
from cacheseek.registry import STORES
from cacheseek.stores.root_files import NotRegularError, RootFolder
from cacheseek.sizes import AUTO, Size, disk_total_bytes, free_bytes
from cacheseek.sizing import SizeField
from cacheseek.stores.disk_names import TEMP_GRACE_S, decode_key, encode_key, key_in, place, temp_name, writer_gone
from cacheseek.stores import disk_values
from cacheseek.stores.disk_records import DiskRecords
from cacheseek.stores.disk_values import MAGIC
from cacheseek.codecs.tier import TierCodec
from cacheseek.stores.kv_tier import KeyValueTier

log = logging.getLogger(__name__)

__all__ = ["LocalDiskTierStore", "DiskBackend", "encode_key", "decode_key", "TEMP_GRACE_S", "MAGIC"]

_LOCK_NAME = ".lock"
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
LISTING_THREADS = 4  # shard listings in flight at once (a root's open, usage and orphan scans)
_ROOT_FIX = "set store.root to a writable folder, e.g. +store=localdisk store.root=/tmp/kv"


class DiskBackend:
    """`ValueBackend` over files under ``root``; see the module docstring for the format."""

    full_caps_tier = True  # ENOSPC caps the tier at what it holds (`KeyValueTier`)
    checks_digests = True  # write returns each value's checksum; read checks one (`KeyValueTier`)

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self.folder = RootFolder(root, _ROOT_FIX)
        self._lock_fd: Optional[int] = None
        self._close_lock = threading.Lock()

    # -- paths --------------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """Where ``key``'s file is (for messages and tests; every access goes through `RootFolder`)."""
        shard, name = place(key)
        return self.root / shard / name

    def shard_files(self, shard: str, *, sweep: bool = False) -> list[tuple[str, int, float]]:
        """``(key, file size, mtime)`` of every value file in the shard folder ``shard`` (regular
        files the store would have written there, `key_in`); ``sweep``: remove the temp files of
        writers that are gone on the way (logged). One listing, no file opened."""
        out = []
        now = time.time()
        with self.folder.shard(shard) as fd:
            for name, size, mtime in self.folder.files_aged(fd) if fd is not None else ():
                key = key_in(shard, name)
                if key is not None:
                    out.append((key, size, mtime))
                elif sweep and writer_gone(name, now - mtime) and RootFolder.remove(fd, name):
                    log.warning("localdisk: removed the temp file of an interrupted write: %s", self.root / shard / name)
        return out

    def listing(self) -> list[tuple[str, int, float]]:
        """`shard_files` of every shard (unbounded: the store bounds each shard's listing)."""
        return [f for shard in self.folder.shard_names() for f in self.shard_files(shard)]

    # -- ValueBackend -------------------------------------------------------------------------
    def write(self, key: str, value: Any) -> str:
        """Write ``key``'s file atomically (replacing one that is there); the value's checksum."""
        return self._put(key, value, replace=True)[1]

    def write_raw_new(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        """Write ``data`` as ``key``'s whole file unless one is there (the first writer wins: a
        chunk record, which carries its own seal, or a claim); whether it was written. ``durable``
        False skips the fsyncs (a chunk claim: a hint no crash must keep)."""
        return self._put_file(key, (data,), replace=False, durable=durable)

    def read_raw(self, key: str, limit: int = 1 << 20) -> Optional[bytes]:
        """The bytes of ``key``'s file, written by `write_raw_new` (None: absent). A file that is
        not a regular one, or larger than ``limit``, is `CorruptValueError`."""
        fd, path = self._open(key)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CorruptValueError(key, f"file {path}: larger than {limit} bytes")
        return data

    def _put(self, key: str, value: Any, *, replace: bool) -> tuple[bool, str]:
        header, body, digest = disk_values.encode(key, value)
        return self._put_file(key, (header, body), replace=replace), digest

    def _put_file(self, key: str, parts: tuple, *, replace: bool, durable: bool = True) -> bool:
        shard, name = place(key)
        path = self.root / shard / name
        tmp: Optional[str] = None
        stored = True
        try:
            with self.folder.shard(shard, create=True) as sfd:
                try:
                    tmp = temp_name(name)
                    with os.fdopen(RootFolder.create_file(sfd, tmp), "wb") as f:
                        for part in parts:
                            f.write(part)
                        if self.fsync and durable:
                            f.flush()
                            os.fsync(f.fileno())
                    if replace:
                        os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
                        tmp = None
                    else:
                        try:
                            os.link(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd, follow_symlinks=False)
                        except FileExistsError:
                            stored = False
                    if self.fsync and durable and stored:
                        os.fsync(sfd)
                finally:
                    if tmp is not None:
                        try:
                            os.unlink(tmp, dir_fd=sfd)
                        except FileNotFoundError:
                            pass
                        except OSError:
                            log.warning("localdisk: could not remove temp file %s", path.parent / tmp)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise StoreFullError(f"localdisk: disk full writing {path}: {exc}") from exc
            raise StoreError(f"localdisk: cannot write {path}: {exc}") from exc
        except NotRegularError as exc:
            raise StoreError(f"localdisk: cannot write {path}: {exc}") from exc
        return stored

    def _open(self, key: str) -> tuple[Optional[int], Path]:
        """A read descriptor of ``key``'s file (None: absent) and its path; a link, FIFO or
        folder in its place is `CorruptValueError`, never followed or waited on."""
        shard, name = place(key)
        path = self.root / shard / name
        try:
            with self.folder.shard(shard) as sfd:
                return (None if sfd is None else RootFolder.open_file(sfd, name)), path
        except NotRegularError as exc:
            raise CorruptValueError(key, f"file {path}: {exc}") from None
        except (OSError, StoreError) as exc:
            raise StoreError(f"localdisk: cannot read {path}: {exc}") from exc

    def read(self, key: str, expect: Optional[str] = None) -> Optional[Any]:
        fd, path = self._open(key)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            try:
                return disk_values.decode(key, path, f, expect)
            except CorruptValueError as exc:
                if str(path) in exc.problem:
                    raise
                raise CorruptValueError(key, f"file {path}: {exc.problem}") from None
            except OSError as exc:
                raise StoreError(f"localdisk: cannot read {path}: {exc}") from exc

    def delete(self, key: str) -> None:
        """Remove ``key``'s file (or a link or FIFO in its place; a folder there is left alone)."""
        shard, name = place(key)
        try:
            with self.folder.shard(shard) as sfd:
                if sfd is not None:
                    RootFolder.remove(sfd, name)
        except NotRegularError as exc:
            log.warning("localdisk: %s (under %s)", exc, self.root / shard)
        except OSError as exc:
            raise StoreError(f"localdisk: cannot delete {self.root / shard / name}: {exc}") from exc

    def keys(self, older_than_s: float = 0.0) -> list[str]:
        """Every value's key; with ``older_than_s``, only files at least that old."""
        cutoff = time.time() - older_than_s
        return sorted(key for key, _, mtime in self.listing() if older_than_s <= 0 or mtime <= cutoff)

    def exists(self, key: str) -> bool:
        shard, name = place(key)
        try:
            with self.folder.shard(shard) as sfd:
                return sfd is not None and RootFolder.is_regular(sfd, name)
        except NotRegularError:
            return False

    def key_sizes(self) -> dict[str, int]:
        """Every stored key with its file size (bytes on disk, header included)."""
        return {key: size for key, size, _ in self.listing()}

    def free_bytes(self) -> Optional[int]:
        """Bytes free on the file system under root (None when unknown)."""
        return self.folder.free_bytes()

    def disk_usage_bytes(self) -> int:
        """Sum of the sizes of every regular file in the shards (values and temp files in flight)."""
        total = 0
        for shard in self.folder.shard_names():
            with self.folder.shard(shard) as fd:
                if fd is not None:
                    total += sum(size for _, size, _ in self.folder.files_aged(fd))
        return total

    def close(self) -> None:
        with self._close_lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None
            self.folder.close()

    # -- opening ------------------------------------------------------------------------------
    def open(self) -> None:
        """Create or check the root, probe it, take its lock, refuse planted shards (`RootFolder`;
        the store's first listing sweeps stale temp files). ConfigError naming ``store.root`` on
        failure, the lock released."""
        self.folder.open()
        try:
            self.folder.probe(f".probe-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")
            self._lock_fd = self.folder.lock(_LOCK_NAME)
            self.folder.refuse_planted()
        except ConfigError:
            self.close()
            raise
        except (OSError, StoreError) as exc:
            self.close()
            raise ConfigError("store.root", f"cannot scan {self.root}: {exc}", _ROOT_FIX) from None

    def stored_nbytes(self, key: str, value: Any) -> int:
        """The size of the file ``write(key, value)`` makes (the unit of the tier's usage)."""
        return disk_values.stored_nbytes(key, value)


@STORES.register("localdisk")
class LocalDiskTierStore(KeyValueTier):
    """`KeyValueTier` over a `DiskBackend` under ``root`` (None: the orchestrator fills in
    ``kvstore`` under the run folder).

    ``write_back``: writes run on a background thread fed by a queue of ``queue_depth`` blobs
    (``put_async`` blocks when it is full); otherwise ``put_async`` returns after the files are
    in place. ``fsync`` (default True, durable commit): flush each file and its folder to the device
    before publishing; False is the weaker, faster mode (after a crash, values a snapshot names may
    be gone: read as misses). ``capacity_bytes``: as `InMemoryTierStore`'s, files already under
    root counted by size, ``"auto"`` fitted to the disk under root. ``op_timeout_s``: the bound of
    every file operation (`KeyValueTier`, "Stalled media"): past it a miss or a dropped write.
    A bad root raises `ConfigError` naming ``store.root`` here, not at the first write.
    ``codec``/``codec_device``: how K and V are encoded in the files (`cacheseek.codecs`); the
    checksum covers the encoded bytes.
    """

    tier = Tier.DISK
    lists_values = True
    usage_scan_s = 1.0  # how old the root's usage scan may be (other processes write the root too) ...
    usage_scan_share = 0.1  # ... or, for a large root, ten times as long as a scan takes (<= 10% of the time)

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        write_back: bool = False,
        queue_depth: int = 4,
        fsync: bool = True,
        capacity_bytes: Optional[Size] = AUTO,
        op_timeout_s: float = 30.0,
        orphan_grace_s: float = 600.0,
        codec: str = "none",
        codec_device: str = "auto",
    ) -> None:
        TierCodec(codec, codec_device)  # a bad codec is refused before the root is opened
        if root is None or (isinstance(root, str) and not root.strip()):
            raise ConfigError("store.root", "no folder given (the orchestrator fills it with <run folder>/kvstore)",
                              _ROOT_FIX)
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError("store.root", f"must be a path, got {type(root).__name__}", _ROOT_FIX)
        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1:
            raise ConfigError("store.queue_depth", f"must be an integer >= 1, got {queue_depth!r}")
        if isinstance(orphan_grace_s, bool) or not isinstance(orphan_grace_s, (int, float)) or orphan_grace_s < 0:
            raise ConfigError("store.orphan_grace_s", f"must be a number of seconds >= 0, got {orphan_grace_s!r}",
                              "store.orphan_grace_s=600 (the default: longer than any chunk's write)")
        self.orphan_grace_s = float(orphan_grace_s)
        disk = DiskBackend(Path(root).expanduser().absolute(), fsync=bool(fsync))
        disk.open()
        self.disk = disk
        try:
            super().__init__(disk, write_back=bool(write_back), queue_depth=queue_depth, name="localdisk",
                             capacity_bytes=capacity_bytes, op_timeout_s=op_timeout_s, records=DiskRecords(self),
                             codec=codec, codec_device=codec_device)
            t0 = time.monotonic()
            for files in self._per_shard(lambda s: disk.shard_files(s, sweep=True)):  # no list of the root
                with self._lock:
                    self.ledger.seed({key: size for key, size, _ in files})
            self._scan_total = self._scan_mine = self.stats.used_bytes
            self._scanned_at = time.monotonic()
            self._scan_cost_s = self._scanned_at - t0
        except BaseException:
            disk.close()
            raise

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]:
        """`SizedStore`: ``capacity_bytes`` against the free disk under ``root``."""
        root = config.get("root")
        room = free_bytes(Path(str(root)).expanduser()) if root else None
        room = room or None  # 0: a pseudo file system (/proc) or a full disk: opening the root says which
        total = disk_total_bytes(Path(str(root)).expanduser()) if root else None
        return [SizeField("capacity_bytes", "capacity", room=room, room_label=f"free disk under {root}",
                          total=total or None)]

    @property
    def root(self) -> Path:
        return self.disk.root

    def keys(self, older_than_s: float = 0.0) -> list[str]:
        """Every stored key (values and records; temp files of writes in flight are not listed);
        ``older_than_s``: only those whose files were written at least that long ago."""
        self._check_open()
        cutoff = time.time() - older_than_s
        return sorted(key for key, _, mtime in self._listing() if older_than_s <= 0 or mtime <= cutoff)

    def _listing(self, *, sweep: bool = False) -> list[tuple[str, int, float]]:
        """`DiskBackend.shard_files` of every shard, each shard's listing bounded like any other
        file operation (a root of millions of files takes many short calls, a stalled medium
        fails one of them)."""
        out = []
        for files in self._per_shard(lambda s: self.disk.shard_files(s, sweep=sweep)):
            out.extend(files)
        return out

    def _per_shard(self, fn: Any) -> Iterator[Any]:
        """``fn(shard)`` for every shard folder, `LISTING_THREADS` shards at once (a listing
        waits on the file system's metadata, in the kernel, not on the GIL), each call bounded;
        the results in shard order, as they come."""
        shards = self.calls.run("scan", self.disk.folder.shard_names)
        with ThreadPoolExecutor(LISTING_THREADS, thread_name_prefix="localdisk-scan") as pool:
            yield from pool.map(lambda s: self.calls.run("scan", lambda: fn(s)), shards)

    def orphans(self) -> list[str]:
        """Values of chunks that were never committed (no record names their chunk) and are older
        than ``orphan_grace_s``: a killed writer's half chunk, never another live process's write
        in flight; and chunk claims that old (`cacheseek.kv.claims`: a killed writer's).
        `WorldKVManager.reconcile` removes them."""
        self._check_open()
        listing = self._listing()  # one listing for both questions
        cutoff = time.time() - self.orphan_grace_s
        committed = {k.partition(":")[0] for k, _, _ in listing if k.endswith(RECORD_SUFFIX)}
        return sorted(k for k, _, mtime in listing if mtime <= cutoff and (
            k.endswith(CLAIM_SUFFIX) or (not k.endswith(RECORD_SUFFIX) and k.partition(":")[0] not in committed)))

    def usage(self) -> StoreUsage:
        """The root's usage, every process's writes included (the capacity is the cache's): the
        bytes of the files found by a scan at most ``usage_scan_s`` old (for a root whose listing
        takes longer than a tenth of that, ten times the listing's time: 1M chunks list in tens of
        seconds), plus what this process wrote and freed since that scan."""
        now = time.monotonic()
        with self._lock:
            every = max(self.usage_scan_s, self._scan_cost_s / self.usage_scan_share)
            mine, stale = self.stats.used_bytes, now - self._scanned_at > every
        if stale and not self._closed:
            try:
                total = sum(self._per_shard(lambda s: sum(f[1] for f in self.disk.shard_files(s))))
                self._scan_cost_s = time.monotonic() - now
            except StoreError as exc:
                log.warning("localdisk: usage scan failed (%s); counting this process's writes only", exc)
                total = None
            with self._lock:
                if total is not None:
                    self._scan_total, self._scan_mine, self._scanned_at = total, mine, now
        with self._lock:
            self.ledger.refresh(self.name, now)  # a full disk's cap rises again once it has room
            used = max(0, self._scan_total + self.stats.used_bytes - self._scan_mine)
            return StoreUsage(used, self.stats.capacity_bytes, max(self.stats.peak_bytes, used), len(self.ledger))

    def disk_usage_bytes(self) -> int:
        self._check_open()
        return self.calls.run("scan", self.disk.disk_usage_bytes)

    def delete_values(self, keys: list[str]) -> None:
        """Remove these values (idempotent), giving their bytes back; `WorldKVManager.reconcile`
        uses it for the values of chunks never committed (`orphans`)."""
        self._check_open()
        for key in keys:
            self.calls.delete(key)
            with self._lock:
                self.ledger.forget(key)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["root"] = str(self.root)
        if not self._closed:
            out["disk_usage_bytes"] = self.disk_usage_bytes()
        return out
