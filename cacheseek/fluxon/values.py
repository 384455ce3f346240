"""How CacheSeek lays out a Fluxon value, and `ValueView`, one value read back and held.

Value format. CacheSeek writes every value as one flat dict with:
- ``VALUE_FIELD``: the payload, a 1-D uint8 DLPack array. Read back through ``access()`` it is a
  zero-copy, read-only view into the owner's segment file as mapped in this process (see
  `cacheseek.fluxon.segment`). The field name is 51 bytes long so that the payload of a value of
  4 KiB or more starts 64 bytes into its slot: 64-byte aligned (0.2.4 lays the data out
  13 + len(name) bytes after the slot start).
- ``META_FIELD`` (only when non-empty): small caller metadata (e.g. a tensor header), as bytes.
A value without ``VALUE_FIELD`` (one another writer put under a CacheSeek key) is refused.

Sizes. A value takes a power-of-two slot of the owner's segment, header included (`slot_bytes`);
one whose slot is the whole segment or more can never be stored (`too_large_text` says why).

Importing this module needs no numpy: the helpers import it when called.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import HandleStateError, StoreError

__all__ = ["VALUE_FIELD", "META_FIELD", "SLOT_HEADER_ALLOWANCE", "ValueView", "slot_bytes", "too_large_text",
           "writable_u8", "buffer_address", "check_address"]

VALUE_FIELD = "cacheseek.value." + "_" * 35  # 51 bytes: payload 64-byte aligned (see above)
META_FIELD = "cacheseek.meta"
SLOT_HEADER_ALLOWANCE = 256  # field names, DLPack meta and Fluxon's own header, rounded up


def slot_bytes(nbytes: int) -> int:
    """The power-of-two slot a value of ``nbytes`` payload bytes occupies in the owner's segment
    (field names, DLPack metadata and Fluxon's header included, rounded up)."""
    need = nbytes + SLOT_HEADER_ALLOWANCE
    return 1 << (need - 1).bit_length()


def too_large_text(key: Optional[str], nbytes: int, segment_bytes: int) -> str:
    """Why a value of ``nbytes`` cannot fit a segment of ``segment_bytes``."""
    return (f"fluxon value {key!r} of {nbytes} bytes cannot fit: it needs a slot of "
            f"{slot_bytes(nbytes)} bytes (values take power-of-two slots, header included) and "
            f"the owner's whole segment is {segment_bytes} bytes")


def writable_u8(ptr: int, nbytes: int) -> Any:
    """A writable numpy uint8 array over raw memory (fluxon's DLPack put refuses read-only ones).
    Nothing writes through it: Fluxon only reads it."""
    import numpy as np

    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def check_address(ptr: Any, nbytes: Any) -> None:
    """A host address and length a put reads from: non-negative ints, not NULL when not empty."""
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
        raise ValueError(f"ptr must be a non-negative int address, got {ptr!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if nbytes and not ptr:
        raise ValueError("ptr is NULL")


def buffer_address(data: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of bytes, a bytearray or a contiguous memoryview (0 when empty)."""
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)  # zero-copy over bytes, bytearray or memoryview
    return (int(arr.ctypes.data) if arr.nbytes else 0), int(arr.nbytes)


class ValueView:
    """One value read back and held: ``ptr``/``nbytes`` address its payload.

    For a value CacheSeek wrote, the payload is a zero-copy, read-only view into the owner's
    segment (``zero_copy`` True); the Fluxon holder keeps it in place until `release`. Use it as
    a context manager, or call `release` exactly once (a second call raises HandleStateError).
    `FluxonClient.close` releases views still open. Made only by `FluxonClient`, which passes
    ``on_release`` (called once, after a caller's `release`).
    """

    def __init__(self, key: str, holder: Any, fields: dict[str, Any],
                 on_release: Callable[["ValueView"], None]) -> None:
        import numpy as np

        self._on_release = on_release
        self.key = key
        self._holder = holder
        self._fields: Optional[dict[str, Any]] = fields
        meta = fields.get(META_FIELD, b"")
        self.meta: bytes = bytes(meta) if isinstance(meta, (bytes, bytearray)) else b""
        raw = fields.get(VALUE_FIELD)
        if raw is None:
            names = sorted(k for k in fields if not k.startswith("__"))
            raise StoreError(f"fluxon value {key!r} has no payload field {VALUE_FIELD!r} (not written by "
                             f"CacheSeek); its fields: {names}")
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
        self._on_release(self)

    def _drop(self) -> None:
        """Drop the holder without telling the client (the client's own bookkeeping calls it)."""
        self._released = True
        self._array = self._raw = self._fields = self._holder = None

    def _drop_by_close(self) -> None:
        """Released by the client's close: a later `release` is then a no-op."""
        self._released_by_close = True
        self._drop()

    def __enter__(self) -> "ValueView":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"ptr=0x{self._ptr:x}"
        return f"ValueView(key={self.key!r}, nbytes={self.nbytes}, zero_copy={self.zero_copy}, {state})"
