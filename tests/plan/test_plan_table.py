"""FXPLANV1 tables: layout, and address/magic/count validation before any pointer is used."""

from __future__ import annotations

import ctypes
import struct

import pytest

from cacheseek.errors import PlanTableError
from cacheseek.plan.table import PLAN_MAGIC, decode_plan_table, encode_plan_table, plan_table_nbytes


@pytest.fixture
def arena():
    buf = (ctypes.c_uint64 * 64)()
    return buf, ctypes.addressof(buf), ctypes.sizeof(buf)


def test_magic_spells_fxplanv1():
    assert PLAN_MAGIC.to_bytes(8, "big") == b"FXPLANV1"


def test_layout_is_little_endian_u64_words(arena):
    _, ptr, _ = arena
    encode_plan_table(ptr, [0x1000, 0x2000, 0x3000])
    raw = ctypes.string_at(ptr, plan_table_nbytes(3))
    assert raw == struct.pack("<5Q", PLAN_MAGIC, 3, 0x1000, 0x2000, 0x3000)


def test_round_trip_inside_arena(arena):
    _, ptr, size = arena
    encode_plan_table(ptr + 16, [11, 22])
    assert decode_plan_table(ptr + 16, 2, arena=(ptr, size)) == [11, 22]
    encode_plan_table(ptr, [])
    assert decode_plan_table(ptr, 0) == []


@pytest.mark.parametrize("bad", [0, None, -8])
def test_null_address_rejected(bad):
    with pytest.raises(PlanTableError, match="null"):
        decode_plan_table(bad, 1)


def test_misaligned_address_rejected(arena):
    _, ptr, _ = arena
    encode_plan_table(ptr, [1])
    with pytest.raises(PlanTableError, match="aligned"):
        decode_plan_table(ptr + 4, 1)


def test_address_outside_arena_rejected_before_reading(arena):
    _, ptr, size = arena
    encode_plan_table(ptr, [1, 2])
    with pytest.raises(PlanTableError, match="outside"):
        decode_plan_table(ptr, 2, arena=(ptr + 8, size - 8))
    # a table that starts inside but runs past the end of the arena
    with pytest.raises(PlanTableError, match="outside"):
        decode_plan_table(ptr + size - 16, 4, arena=(ptr, size))


def test_wrong_magic_rejected(arena):
    _, ptr, _ = arena
    encode_plan_table(ptr, [1, 2])
    ctypes.c_uint64.from_address(ptr).value = PLAN_MAGIC + 1
    with pytest.raises(PlanTableError, match="magic"):
        decode_plan_table(ptr, 2)


@pytest.mark.parametrize("expected", [1, 3])
def test_wrong_count_rejected(arena, expected):
    _, ptr, _ = arena
    encode_plan_table(ptr, [1, 2])
    with pytest.raises(PlanTableError, match="holds 2 pointers, expected"):
        decode_plan_table(ptr, expected)


def test_null_value_pointer_rejected(arena):
    _, ptr, _ = arena
    encode_plan_table(ptr, [5, 0])
    with pytest.raises(PlanTableError, match="value pointer 1 is null"):
        decode_plan_table(ptr, 2)
