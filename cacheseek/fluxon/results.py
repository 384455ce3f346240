"""fluxon-py Results, consumed and mapped to CacheSeek's errors.

Every fluxon-py 0.2.4 call returns a Result that must be consumed (the native side asserts it).
`unwrap` returns the value of an ok Result and maps an error by its code or class name:

    KeyNotFoundError (4000)   `Miss` when the caller allows a miss (a get, a remove), else StoreError
    StorageFullError (6000)   `FluxonValueTooLargeError` when the value's slot exceeds the whole
                              segment, else `StoreFullError`, with Fluxon's text
    anything else             `StoreError` with Fluxon's text (`error_text`)
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from cacheseek.errors import StoreError, StoreFullError
from cacheseek.fluxon.errors import FluxonValueTooLargeError
from cacheseek.fluxon.values import slot_bytes, too_large_text

__all__ = ["Miss", "KEY_NOT_FOUND", "STORAGE_FULL", "error_code", "error_text", "unwrap"]

KEY_NOT_FOUND, STORAGE_FULL = 4000, 6000


class Miss(Exception):
    """Internal: the key does not exist (raised by `unwrap` with ``miss_ok``)."""


def error_text(err: Any) -> str:
    """``ClassName(code): message`` of a fluxon error."""
    msg = getattr(err, "message", None)
    code = None
    with contextlib.suppress(Exception):
        code = err.code()
    name = type(err).__name__
    return f"{name}({code}): {msg if msg is not None else err}"


def error_code(err: Any) -> Optional[int]:
    with contextlib.suppress(Exception):
        return int(err.code())
    return None


def unwrap(op: str, key: Optional[str], res: Any, *, segment_bytes: int = 0, nbytes: int = 0,
           miss_ok: bool = False) -> Any:
    """Consume ``res`` and return its value, or raise the mapped error (see the module docstring).
    ``segment_bytes``: the owner's segment (0 when unknown); ``nbytes``: the value's size."""
    if res.is_ok():
        return res.unwrap()
    err = res.unwrap_error()
    code = error_code(err)
    name = type(err).__name__
    where = f"fluxon {op}" + (f" of key {key!r}" if key is not None else "")
    if miss_ok and (code == KEY_NOT_FOUND or name == "KeyNotFoundError"):
        raise Miss()
    if code == STORAGE_FULL or name == "StorageFullError":
        if segment_bytes and slot_bytes(nbytes) > segment_bytes:
            raise FluxonValueTooLargeError(too_large_text(key, nbytes, segment_bytes) + f" ({error_text(err)})")
        raise StoreFullError(f"{where} ({nbytes} bytes): store full: {error_text(err)}")
    raise StoreError(f"{where} failed: {error_text(err)}")
