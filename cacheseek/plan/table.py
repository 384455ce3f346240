"""FXPLANV1 plan tables: how a Plan call hands its value pointers to the caller.

A table is a run of little-endian u64 words in real memory::

    word[0]        = 0x4658504c414e5631   ("FXPLANV1")
    word[1]        = n
    word[2 .. 2+n] = value pointers, in key order

`decode_plan_table` checks the address (non-null, 8-byte aligned, and inside the client's table
arena when one is known), then the magic, then the count, before reading any pointer; a null value
pointer is rejected too. Any failure is a `PlanTableError`, never a guess.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Optional

from cacheseek.errors import PlanTableError

__all__ = ["PLAN_MAGIC", "plan_table_nbytes", "encode_plan_table", "decode_plan_table"]

PLAN_MAGIC = 0x4658504C414E5631
_WORD = 8


def plan_table_nbytes(n: int) -> int:
    """Bytes of a table of ``n`` pointers."""
    return (2 + n) * _WORD


def encode_plan_table(ptr: int, pointers: Sequence[int]) -> None:
    """Write a table of ``pointers`` at address ``ptr`` (which must hold `plan_table_nbytes`)."""
    if not ptr or ptr % _WORD:
        raise PlanTableError(f"plan table address {ptr:#x} is null or not 8-byte aligned")
    data = struct.pack(f"<{2 + len(pointers)}Q", PLAN_MAGIC, len(pointers), *pointers)
    ctypes.memmove(ptr, data, len(data))


def decode_plan_table(
    ptr: int, expected_n: int, *, arena: Optional[tuple[int, int]] = None
) -> list[int]:
    """The ``expected_n`` value pointers of the table at ``ptr``.

    ``arena``: ``(base, length)`` of the memory every table of this client lies in; when given,
    the whole table must lie inside it. Raises `PlanTableError` on a null or misaligned address,
    an address outside the arena, a wrong magic, a count other than ``expected_n`` or a null
    value pointer.
    """
    if not isinstance(ptr, int) or ptr <= 0:
        raise PlanTableError(f"plan table address is null or invalid: {ptr!r}")
    if ptr % _WORD:
        raise PlanTableError(f"plan table address {ptr:#x} is not 8-byte aligned")
    if expected_n < 0:
        raise PlanTableError(f"expected pointer count must be >= 0, got {expected_n}")
    if arena is not None:
        base, length = arena
        if not (base <= ptr and ptr + plan_table_nbytes(expected_n) <= base + length):
            raise PlanTableError(
                f"plan table [{ptr:#x}, +{plan_table_nbytes(expected_n)}) lies outside the client's "
                f"table arena [{base:#x}, +{length})"
            )
    magic, n = struct.unpack("<2Q", ctypes.string_at(ptr, 2 * _WORD))
    if magic != PLAN_MAGIC:
        raise PlanTableError(
            f"plan table at {ptr:#x} has magic {magic:#018x}, expected {PLAN_MAGIC:#018x}"
        )
    if n != expected_n:
        raise PlanTableError(f"plan table at {ptr:#x} holds {n} pointers, expected {expected_n}")
    pointers = list(struct.unpack(f"<{n}Q", ctypes.string_at(ptr + 2 * _WORD, n * _WORD)))
    for i, p in enumerate(pointers):
        if p == 0:
            raise PlanTableError(f"plan table at {ptr:#x}: value pointer {i} is null")
    return pointers
