"""The forest snapshot on disk: a checksummed file, its previous generation, no stale temp files.

A file is the snapshot's JSON (`cacheseek.reuse.exact_prefix.snapshot`) with one last top-level
field, ``"xxh3"``: 16 hex digits of xxh3-64 over the file's bytes without that field (the JSON as
if it ended one field earlier). The file stays plain JSON, so upstream CacheSeek still reads it; a
file without the field (upstream's, this project's earlier ones) is read unchecked.

The snapshot's folder is opened once per call and every name in it is reached through that
descriptor (never through a path again, so a parent swapped for a link mid-call changes nothing),
never following a link and never waiting on a FIFO: the newest file, ``{name}.prev`` or a temp
file that is a link, a FIFO, a folder or a device is refused as unreadable, never opened for
reading or written through; no link is ever created.

Saving writes a temp file ``.{name}.cstmp-w{pid}x{random}`` (the marker ``cstmp`` and its
writer's pid: unique per save, so any number of processes and threads save at once), fsyncs it,
copies the current file (when it verifies) into ``{name}.prev`` the same way, then renames the
temp file over the current one and fsyncs the folder: the newest name always holds a whole
generation, and of concurrent saves the last rename (a complete snapshot) wins. A save is bounded
(``timeout_s``, `cacheseek.bounded_calls`): past it, or on any OS error (``ENOSPC``, ``.prev`` a
folder), it raises one `StoreError` naming the file; a ``.prev`` that cannot be written is logged
and the newest is saved anyway.

Loading reads the newest; a damaged newest (checksum, UTF-8, JSON, any field refused, not a
regular file) falls back to ``{name}.prev`` (logged). Temp files of an interrupted save are
removed when a snapshot is loaded: only regular files with this module's marker whose writer
(named in them) no longer runs on this host; a user's ``.{name}.bak`` or ``.orig`` never
carries the marker and stays. Every problem is a `ConfigError` naming the file and the field. A
file above `MAX_FILE_BYTES` is refused unread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import attrs
import xxhash

from cacheseek.bounded_calls import BoundedCalls
from cacheseek.errors import ConfigError, StoreError
from cacheseek.kv.claims import process_alive
from cacheseek.reuse.exact_prefix import snapshot as snapshot_format

log = logging.getLogger(__name__)

__all__ = ["MAX_FILE_BYTES", "SAVE_TIMEOUT_S", "Loaded", "encode_file", "save", "load", "previous",
           "sweep_temps", "temp_name"]

MAX_FILE_BYTES = 1 << 30
SAVE_TIMEOUT_S = 30.0  # the default bound of a save or a load (as ``store.op_timeout_s``)
_TRAILER = re.compile(rb',"xxh3":"([0-9a-f]{16})"\}\s*\Z')
_FIX = "restore the file from a backup, or remove it (the store's values it named are then unreachable)"
_MARKER = "cstmp"
_TEMP = re.compile(r"\A\.(.+)\.cstmp-w(\d{1,10})x[0-9a-f]{12}\Z")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@attrs.frozen(slots=True)
class Loaded:
    """What `load` found: ``records`` (None: no usable file), the file they came from, and the
    problems of the generations that were refused (newest first)."""

    records: Optional[list[Any]]
    source: Optional[Path]
    problems: tuple[ConfigError, ...] = ()


class _NotAFile(OSError):
    """The name is a link, a FIFO, a folder or a device: nothing a save wrote."""


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def temp_name(name: str) -> str:
    """A new temp file name for a save of ``name`` by this process (marked, unique)."""
    return f".{name}.{_MARKER}-w{os.getpid()}x{secrets.token_hex(6)}"


def encode_file(data: Any) -> bytes:
    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return body[:-1] + b',"xxh3":"' + xxhash.xxh3_64(body).hexdigest().encode() + b'"}'


def _bounded(timeout_s: float, op: str, path: Path, fn: Any) -> Any:
    calls = BoundedCalls(timeout_s, name="forest snapshot", field="store.op_timeout_s",
                         hint=" (a stalled disk or file system?)")
    return calls.run(op, fn, key=str(path))


@contextlib.contextmanager
def _folder(path: Path, *, missing_ok: bool = False) -> Iterator[Optional[int]]:
    """A descriptor of ``path``'s folder; None when it does not exist and ``missing_ok``."""
    try:
        fd = os.open(path.parent, _DIR)
    except (FileNotFoundError, NotADirectoryError):
        if not missing_ok:
            raise
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def save(data: Any, path: Path, *, timeout_s: float = SAVE_TIMEOUT_S) -> None:
    """Write ``data`` as the newest generation of ``path`` (see the module docstring); one
    `StoreError` naming the file when it cannot (an OS error, or ``timeout_s`` passed)."""
    raw = encode_file(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _bounded(timeout_s, "save", path, lambda: _save(raw, path))
    except StoreError as exc:
        raise type(exc)(f"forest snapshot {path} not saved: {exc}") from None
    except OSError as exc:
        raise StoreError(f"forest snapshot {path} not saved: {exc.strerror or exc}") from None


def _save(raw: bytes, path: Path) -> None:
    with _folder(path) as dfd:
        try:
            current = _read_at(dfd, path.name, path)
            _verify(path, current)
        except FileNotFoundError:  # a first save: a .prev of an earlier, removed snapshot is not its past
            current = None
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                _unlink_file(dfd, previous(path).name)
        except (OSError, ConfigError) as exc:
            log.warning("forest snapshot %s does not verify (%s): %s keeps the older generation",
                        path, exc, previous(path))
            current = None
        if current is not None:
            try:
                _write_new(dfd, previous(path).name, current)
            except OSError as exc:
                log.warning("forest snapshot: could not keep the previous generation %s (%s); saving the "
                            "newest anyway", previous(path), exc.strerror or exc)
        _write_new(dfd, path.name, raw)
        os.fsync(dfd)


def _write_new(dfd: int, name: str, raw: bytes) -> None:
    """``raw`` as ``name`` in the folder ``dfd``: a marked temp file, fsynced, renamed over it."""
    tmp = temp_name(name)
    try:
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if stat.S_ISDIR(_lstat(dfd, name)):
            raise IsADirectoryError(errno.EISDIR, f"{name} is a folder")
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)


def _lstat(dfd: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0


def _unlink_file(dfd: int, name: str) -> None:
    if stat.S_ISDIR(_lstat(dfd, name)):
        raise IsADirectoryError(errno.EISDIR, name)
    os.unlink(name, dir_fd=dfd)


def _read_at(dfd: int, name: str, path: Path) -> bytes:
    """The bytes of regular file ``name`` (FileNotFoundError: absent); a link, FIFO, folder or
    device is `_NotAFile`, never followed or waited on; above `MAX_FILE_BYTES` a `ConfigError`."""
    try:
        fd = os.open(name, _READ, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise _NotAFile(errno.ELOOP, "a symbolic link: not followed") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotAFile(errno.EINVAL, f"not a regular file (mode {st.st_mode:o}): not read")
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError(str(path), f"{st.st_size} bytes, above the {MAX_FILE_BYTES} a snapshot may have", _FIX)
        os.set_blocking(fd, True)
        return f.read(MAX_FILE_BYTES + 1)


def load(path: Path, *, timeout_s: float = SAVE_TIMEOUT_S, sweep: bool = False) -> Loaded:
    """The newest generation of ``path`` that decodes, its previous one when the newest is damaged;
    ``records`` None when the newest does not exist or neither decodes. ``sweep``: first remove
    the temp files of interrupted saves (`sweep_temps`). Bounded by ``timeout_s``."""
    def run() -> Loaded:
        if sweep:
            sweep_temps(path)
        return _load(path)

    try:
        return _bounded(timeout_s, "load", path, run)
    except StoreError as exc:
        problem = ConfigError(str(path), f"cannot read it: {exc}", _FIX)
        return Loaded(None, None, (problem,))


def _load(path: Path) -> Loaded:
    with _folder(path, missing_ok=True) as dfd:
        if dfd is None:
            return Loaded(None, None)
        problems = []
        for gen in (path, previous(path)):
            try:
                records = _records(gen, _read_at(dfd, gen.name, gen))
            except FileNotFoundError:
                if gen is path:
                    return Loaded(None, None)
                break
            except OSError as exc:
                problems.append(ConfigError(str(gen), f"cannot read it: {exc.strerror or exc}", _FIX))
                log.warning("forest snapshot %s cannot be used: %s", gen, problems[-1])
                continue
            except ConfigError as exc:
                log.warning("forest snapshot %s cannot be used: %s", gen, exc)
                problems.append(exc)
                continue
            if problems:
                log.warning("forest snapshot: loaded the previous generation %s (the newest is damaged)", gen)
            return Loaded(records, gen, tuple(problems))
        return Loaded(None, None, tuple(problems))


def read(path: Path) -> list[Any]:
    """One generation's namespace records, checked whole; `ConfigError` naming the file."""
    try:
        with _folder(path) as dfd:
            raw = _read_at(dfd, path.name, path)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read it: {exc.strerror or exc}", _FIX) from None
    return _records(path, raw)


def _records(path: Path, raw: bytes) -> list[Any]:
    _verify(path, raw)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text (byte {exc.start})", _FIX) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", _FIX) from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(str(path), f"not a snapshot: {type(exc).__name__}: {exc}", _FIX) from None
    try:
        return snapshot_format.decode(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.field}", exc.problem, exc.fix) from None


def _verify(path: Path, raw: bytes) -> None:
    m = _TRAILER.search(raw)
    if m is None:
        if b'"xxh3"' in raw[-64:]:
            raise ConfigError(f"{path}: xxh3", "the checksum field is damaged", _FIX)
        return  # a file without a checksum: upstream's or an earlier one
    body = raw[: m.start()] + b"}"
    if xxhash.xxh3_64(body).hexdigest().encode() != m.group(1):
        raise ConfigError(f"{path}: xxh3", "checksum mismatch: the file is damaged", _FIX)


def _interrupted(name: str, names: tuple[str, ...]) -> bool:
    """Whether ``name`` is a temp file of a save of one of ``names`` whose writer is gone."""
    m = _TEMP.match(name)
    if m is None or m.group(1) not in names:
        return False
    pid = int(m.group(2))
    return pid != os.getpid() and not process_alive(pid)


def sweep_temps(path: Path) -> int:
    """Remove the temp files an interrupted save of ``path`` (or of its ``.prev``) left next to
    it: regular files with this module's marker whose writer is gone; how many."""
    names = (path.name, previous(path).name)
    removed = 0
    with _folder(path, missing_ok=True) as dfd:
        if dfd is None:
            return 0
        with os.scandir(dfd) as it:
            entries = [e.name for e in it if e.is_file(follow_symlinks=False)]
        for name in entries:
            if _interrupted(name, names):
                log.warning("forest snapshot: removing the temp file of an interrupted save: %s", path.parent / name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
                    removed += 1
    return removed
