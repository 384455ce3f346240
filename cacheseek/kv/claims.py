"""Chunk claims: "a live process is computing this chunk now", so another waits for its record
instead of computing it too.

Workers started at once run sessions on the same popular paths at the same moments. A chunk's
record (`cacheseek.kv.records`) appears only once the chunk is committed, so two sessions that
reach the same uncached chunk together would both compute and write it, and N concurrent workers
would hit less than one process running the same sessions one after another. A claim closes
that gap, as Mooncake's two-phase put (start, then end once the bytes are in) and Fluxon's
``reject_if_inflight_same_key`` do: the first live session to miss a chunk stores a small claim
under ``{node hex}:claim`` (create-if-absent: one wins), computes the chunk and removes the
claim once its record is published; a session that finds a claim waits, bounded, for the record
and restores the chunk instead.

A claim is only a hint: it never makes a chunk findable and never blocks anyone for long. It is
*stale* (ignored and removed) once it is older than the waiter's bound, or at once when its
holder ran on this host and that process is gone (a killed worker). A waiter that gives up
computes the chunk itself, as it would have without claims.

Torch-free; no CacheSeek imports.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Optional

import attrs

__all__ = ["ChunkClaim", "CLAIM_SUFFIX", "claim_name", "this_host", "process_alive"]

CLAIM_SUFFIX = ":claim"
_HOST = socket.gethostname()


def claim_name(node_key: bytes) -> str:
    """The store name of a chunk's claim: ``{node hex}:claim``."""
    return node_key.hex() + CLAIM_SUFFIX


def this_host() -> str:
    return _HOST


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@attrs.frozen(slots=True)
class ChunkClaim:
    """Who claimed a chunk's write: ``host`` and ``pid`` of the process, a random ``token``,
    ``created`` (seconds since the epoch, this host's clock)."""

    host: str
    pid: int
    token: str
    created: float

    @classmethod
    def mine(cls) -> "ChunkClaim":
        return cls(_HOST, os.getpid(), secrets.token_hex(8), time.time())

    def encode(self) -> bytes:
        return json.dumps({"host": self.host, "pid": self.pid, "token": self.token, "created": self.created},
                          sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> Optional["ChunkClaim"]:
        """The claim in ``data``; None when it is not one (read as stale: it is removed)."""
        try:
            d = json.loads(bytes(data).decode("utf-8"))
            return cls(str(d["host"]), int(d["pid"]), str(d["token"]), float(d["created"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def stale(self, lease_s: float, now: Optional[float] = None) -> bool:
        """Whether nobody is computing the chunk any more: the claim is older than ``lease_s``,
        or its holder ran on this host and has exited."""
        age = (time.time() if now is None else now) - self.created
        if age > lease_s:
            return True
        return self.host == _HOST and self.pid != os.getpid() and not process_alive(self.pid)
