"""The file names of a LocalDisk root: a value's shard and escaped name, and the temp files of
writes in flight (named for their writer, so a sweep removes only a gone writer's).

``{root}/{sha256(key)[:2]}/{escaped key}``: the escape keeps ``[A-Za-z0-9_-]`` and writes every
other UTF-8 byte as ``%XX``, so it is reversible and an escaped name never contains a dot; a temp
file (``.{name}.w{pid}x{random}.tmp``) always does, so it is never mistaken for a value.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from urllib.parse import unquote_to_bytes
from typing import Optional

from cacheseek.kv.claims import process_alive

__all__ = ["encode_key", "decode_key", "key_in", "place", "temp_name", "writer_gone", "TEMP_GRACE_S"]

_MAX_NAME = 200  # escaped key length limit; leaves room for the temp-file decoration in 255
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def encode_key(key: str) -> str:
    """The file name of ``key``: safe bytes kept, every other UTF-8 byte as ``%XX``."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store keys must be non-empty strings, got {key!r}")
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in key.encode("utf-8"))
    if len(name) > _MAX_NAME:
        raise ValueError(f"store key too long for a file name ({len(name)} > {_MAX_NAME}): {key!r}")
    return name


def decode_key(name: str) -> str:
    """Inverse of `encode_key`."""
    return unquote_to_bytes(name).decode("utf-8")


_ESCAPED = re.compile(r"[A-Za-z0-9_-]*(?:%[0-9A-F]{2}[A-Za-z0-9_-]*)*")
_PLAIN = re.compile(r"[A-Za-z0-9_-]+(?:%3A[A-Za-z0-9_-]*)*")
_SAFE_ESCAPED = re.compile(r"%(?:2D|3[0-9]|4[1-9A-F]|5[0-9AF]|6[1-9A-F]|7[0-9A])")  # an escape of a _SAFE byte


def key_in(shard: str, name: str) -> Optional[str]:
    """The key of the value file ``name`` found in folder ``shard``, or None when the store
    would not have written it there: not a value's name, not the escape `encode_key` writes, or a
    value's name in another key's shard (a file moved or planted: not a value, never counted,
    read or removed as one). ~2 µs a name (a root's listing calls it per file)."""
    if _PLAIN.fullmatch(name) is not None:  # the usual name: {hex}:kv:L0:k, only ':' escaped
        key = name.replace("%3A", ":")
        return key if hashlib.sha256(key.encode("ascii")).hexdigest()[:2] == shard else None
    if not name or "." in name or _ESCAPED.fullmatch(name) is None:
        return None
    raw = unquote_to_bytes(name)
    if "%" in name and _SAFE_ESCAPED.search(name) is not None:
        return None  # an escaped byte encode_key keeps as it is: another spelling of a key
    if hashlib.sha256(raw).hexdigest()[:2] != shard:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


# .{value}.{token}.tmp; the token of this version is w{pid}x{random} (its writer's process)
_TEMP_NAME = re.compile(r"\A\.[A-Za-z0-9_%-]+\.([A-Za-z0-9_]{6,32})\.tmp\Z")
_WRITER = re.compile(r"\Aw(\d{1,10})x[0-9a-f]{8,16}\Z")
TEMP_GRACE_S = 3600.0  # a temp file whose writer cannot be told from its name is kept this long


def temp_name(name: str) -> str:
    """The temp file a write of value file ``name`` goes through, named for this process."""
    return f".{name}.w{os.getpid()}x{secrets.token_hex(6)}.tmp"


def writer_gone(name: str, age_s: float) -> bool:
    """Whether the temp file ``name`` is an interrupted write: its writer (named in it) is no
    longer running on this host, or, for a name without a writer, older than `TEMP_GRACE_S`.
    Never another live process's write in flight."""
    m = _TEMP_NAME.match(name)
    if m is None:
        return False
    w = _WRITER.match(m.group(1))
    if w is None:
        return age_s > TEMP_GRACE_S
    pid = int(w.group(1))
    return pid != os.getpid() and not process_alive(pid)


def place(key: str) -> tuple[str, str]:
    """``(shard folder, file name)`` of ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:2], encode_key(key)
