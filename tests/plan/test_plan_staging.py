"""The Fluxon public client's host staging, alone: sizing from the geometry, the construction
check, and carving a plan's region (full, free, quarantine). No Fluxon, no torch."""

from __future__ import annotations

import ctypes

import pytest

from cacheseek.errors import ConfigError, StoreFullError
from cacheseek.plan.fluxon_staging import (
    STAGING_ALIGN,
    Staging,
    block_bytes,
    max_values,
    resolve_staging_bytes,
    staging_for,
)
from cacheseek.plan.segment import PAGE

MiB = 1 << 20


def test_blocks_are_256_byte_aligned():
    assert block_bytes(1) == STAGING_ALIGN == 256
    assert block_bytes(256) == 256 and block_bytes(257) == 512
    assert max_values(4096, 1000) == 4  # 1000 B take 1024-byte blocks
    assert max_values(1000, 1024) == 0  # not even one fits


def test_sizing_from_the_geometry():
    assert staging_for(None, None) == 256 * MiB  # unknown geometry
    assert staging_for(10 * MiB, 100 * MiB) == 100 * MiB  # one chunk is one wave
    assert staging_for(30 * MiB, 40 * MiB) == 120 * MiB  # at least four values
    assert staging_for(1000, 40_000) == 64 * MiB  # the floor
    assert staging_for(None, 8 << 30) == 4 << 30  # the cap: larger chunks go in waves
    assert staging_for(5 << 30, None) == 5 << 30  # but one value always fits
    assert staging_for(None, 100 * MiB + 1) % STAGING_ALIGN == 0


def test_resolve_takes_a_size_auto_or_null_and_refuses_one_that_stages_nothing():
    assert resolve_staging_bytes("2MiB", None, None) == 2 * MiB
    assert resolve_staging_bytes("auto", 10 * MiB, 100 * MiB) == 100 * MiB
    assert resolve_staging_bytes(None, None, None) == 256 * MiB
    with pytest.raises(ConfigError, match="store.client_options.staging_bytes") as info:
        resolve_staging_bytes(MiB, 2 * MiB, None)
    assert "cannot stage one value of 2097152 bytes" in str(info.value)
    assert "set it to at least 2097152" in str(info.value)
    with pytest.raises(ConfigError, match="store.client_options.staging_bytes"):
        resolve_staging_bytes("12 parsecs", None, None)
    with pytest.raises(ConfigError, match="store.client_options.staging_bytes"):
        resolve_staging_bytes(100, None, None)  # below one block


def test_staging_carves_plan_regions_and_reports_full():
    staging = Staging(10_000, prefault=True)
    try:
        assert staging.length == -(-10_000 // PAGE) * PAGE and staging.length >= 10_000
        assert staging.timers().fault_method in ("madvise", "touch") and staging.timers().fault_threads == 1
        off, block = staging.reserve(3, 1000)
        assert block == 1024 and staging.used == 3 * 1024
        ctypes.memset(staging.ptr + off, 7, 3 * block)  # writable memory
        with pytest.raises(StoreFullError) as info:
            staging.reserve(staging.length // 1024, 1000)
        msg = str(info.value)
        assert "fluxon Plan staging full: need" in msg and "raise store.client_options.staging_bytes" in msg
        assert "stuck puts" not in msg
        staging.quarantine(3 * block)  # a timed-out put keeps its region for good
        with pytest.raises(StoreFullError, match=r"\(3072 left to stuck puts\)"):
            staging.reserve(staging.length // 1024, 1000)
        staging.free(off)
        assert staging.used == 0
    finally:
        staging.close()
        staging.close()  # idempotent


def test_staging_without_prefault_touches_nothing():
    staging = Staging(MiB, prefault=False)
    try:
        t = staging.timers()
        assert t.fault_method == "none" and t.fault_threads == 0 and t.segment_bytes == MiB
        assert t.huge_page_bytes == -1
    finally:
        staging.close()
