"""The forest snapshot on disk: a checksummed file, its previous generation, no stale temp files.

A file is the snapshot's JSON (`cacheseek.reuse.exact_prefix.snapshot`) with one last top-level
field, ``"xxh3"``: 16 hex digits of xxh3-64 over the file's bytes without that field (the JSON as
if it ended one field earlier). The file stays plain JSON, so upstream CacheSeek still reads it; a
file without the field (upstream's, this project's earlier ones) is read unchecked.

Saving writes a temp file ``.{name}.{random}`` in the same folder, fsyncs it, keeps the current
file (when it verifies) as ``{name}.prev`` through a hard link, then renames the temp file over
the current one: the newest name always holds a whole generation. Loading reads the newest; a
damaged newest (checksum, UTF-8, JSON, any field refused) falls back to ``{name}.prev`` (logged).
Temp files of an interrupted save are removed when a snapshot is loaded. Every problem is a
`ConfigError` naming the file and the field. A file above `MAX_FILE_BYTES` is refused unread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import attrs
import xxhash

from cacheseek.errors import ConfigError
from cacheseek.reuse.exact_prefix import snapshot as snapshot_format

log = logging.getLogger(__name__)

__all__ = ["MAX_FILE_BYTES", "Loaded", "encode_file", "save", "load", "previous", "sweep_temps"]

MAX_FILE_BYTES = 1 << 30
_TRAILER = re.compile(rb',"xxh3":"([0-9a-f]{16})"\}\s*\Z')
_FIX = "restore the file from a backup, or remove it (the store's values it named are then unreachable)"


@attrs.frozen(slots=True)
class Loaded:
    """What `load` found: ``records`` (None: no usable file), the file they came from, and the
    problems of the generations that were refused (newest first)."""

    records: Optional[list[Any]]
    source: Optional[Path]
    problems: tuple[ConfigError, ...] = ()


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def encode_file(data: Any) -> bytes:
    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return body[:-1] + b',"xxh3":"' + xxhash.xxh3_64(body).hexdigest().encode() + b'"}'


def save(data: Any, path: Path) -> None:
    """Write ``data`` as the newest generation of ``path`` (see the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = encode_file(data)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        _keep_previous(path)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _keep_previous(path: Path) -> None:
    """The current file becomes ``.prev`` where it verifies (a damaged one keeps the older .prev)."""
    try:
        _verify(path, path.read_bytes())
    except FileNotFoundError:  # a first save: a .prev of an earlier, removed snapshot is not its past
        previous(path).unlink(missing_ok=True)
        return
    except (OSError, ConfigError) as exc:
        log.warning("forest snapshot %s does not verify (%s): %s keeps the older generation",
                    path, exc, previous(path))
        return
    prev = previous(path)
    prev.unlink(missing_ok=True)
    try:
        os.link(path, prev)
    except OSError:  # a file system without hard links: a copy
        shutil.copyfile(path, prev)


def load(path: Path) -> Loaded:
    """The newest generation of ``path`` that decodes, its previous one when the newest is damaged;
    ``records`` None when the newest does not exist or neither decodes."""
    if not path.exists():
        return Loaded(None, None)
    problems = []
    for gen in (path, previous(path)):
        if gen is not path and not gen.exists():
            break
        try:
            records = read(gen)
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
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(str(path), f"{size} bytes, above the {MAX_FILE_BYTES} a snapshot may have", _FIX)
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read it: {exc}", _FIX) from None
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


def sweep_temps(path: Path) -> int:
    """Remove the temp files ``.{name}.*`` an interrupted save left next to ``path``; how many."""
    removed = 0
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(f".{path.name}.") and not entry.is_dir(follow_symlinks=False):
            log.warning("forest snapshot: removing the temp file of an interrupted save: %s", entry.path)
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
