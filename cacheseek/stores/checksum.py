"""Value checksums of the tiers whose media can corrupt a value (LocalDisk files, Fluxon values).

A stored value is a small JSON header (kind, dtype, shape, size) and its raw bytes. `seal` adds
the field ``xxh3``: the xxh3-64 digest (package ``xxhash``) of the value's store key
(length-prefixed), the canonical header (sorted keys, no spaces, without ``xxh3``) and the bytes,
so a flipped bit in the header or in the payload is caught, a header grafted onto another payload
is caught, and so is a whole value under another key: the K of one layer read as its V, one
layer's value as another's, one chunk's or namespace's as another's (a store key names the chunk
by its node key, which chains from the namespace root), as a misdirected write or a restore
from a backup would misplace it. The key is not stored: the reader brings the key it asked for. `Sealed.verify` recomputes
the digest over the bytes the reader actually got (after its copy out of the medium, so a value
changing under the reader is caught too) and raises `CorruptValueError` naming the key.

A corrupt value is treated exactly like a missing one (`KeyValueTier` removes it and reads None;
the manager invalidates the node, frees what is left of it and retries the longest whole shorter
prefix). A value without a checksum (an older format) is corrupt for the same reason: its bytes
cannot be trusted.

The digest field is always 16 hex digits, so a sealed header's length does not depend on the
payload's contents (LocalDisk sizes a file before writing it).

xxh3-64 runs at memory speed (tens of GB/s on one core); the cost on a write or read of a
47.9 MB layer value is a few milliseconds against the tens of milliseconds of the disk or socket.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import xxhash

from cacheseek.errors import CorruptValueError

__all__ = ["FIELD", "seal", "unseal", "Sealed", "digest", "claimed_digest"]

FIELD = "xxh3"


def _canonical(meta: Mapping[str, Any]) -> bytes:
    return json.dumps(dict(meta), sort_keys=True, separators=(",", ":")).encode("utf-8")


def digest(key: str, canonical_header: bytes, *bodies: Any) -> str:
    """The 16-hex-digit xxh3-64 of the key (8-byte little-endian length, then UTF-8), the header
    bytes, then every body (any bytes-like buffer)."""
    h = xxhash.xxh3_64()
    k = key.encode("utf-8")
    h.update(len(k).to_bytes(8, "little"))
    h.update(k)
    h.update(canonical_header)
    for body in bodies:
        if memoryview(body).nbytes:
            h.update(body)
    return h.hexdigest()


def seal(key: str, meta: Mapping[str, Any], body: Any) -> bytes:
    """The header bytes of the value stored under ``key``: ``meta`` plus its checksum over
    ``key``, ``meta`` and ``body``."""
    if FIELD in meta:
        raise ValueError(f"meta already carries a {FIELD!r} field")
    canon = _canonical(meta)
    sealed = dict(meta)
    sealed[FIELD] = digest(key, canon, body)
    return _canonical(sealed)


@attrs.frozen(slots=True)
class Sealed:
    """A parsed header: ``meta`` without the checksum, the ``claimed`` digest, and what it covers
    (``key``: the key the reader asked for, so a value stored under another key fails)."""

    key: str
    meta: dict
    claimed: str
    canonical: bytes

    def verify(self, *bodies: Any) -> None:
        """Raise `CorruptValueError` unless the digest of the key, the header and ``bodies``
        matches (a mismatch: damaged, or a value stored under another key)."""
        got = digest(self.key, self.canonical, *bodies)
        if got != self.claimed:
            raise CorruptValueError(self.key, f"checksum mismatch (stored {self.claimed}, computed {got} for "
                                    "this key): damaged, or another key's value")


def claimed_digest(header: bytes) -> str:
    """The checksum a header `seal` made carries (its ``xxh3`` field)."""
    return json.loads(header)[FIELD]


def unseal(key: str, header: bytes) -> Sealed:
    """Parse a sealed header; `CorruptValueError` when it is unreadable or carries no checksum."""
    try:
        meta = json.loads(bytes(header).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CorruptValueError(key, "unreadable header") from None
    if not isinstance(meta, dict):
        raise CorruptValueError(key, "unreadable header")
    claimed = meta.pop(FIELD, None)
    if not isinstance(claimed, str):
        raise CorruptValueError(key, "no checksum in its header (an older format, or damaged)")
    return Sealed(key, meta, claimed, _canonical(meta))
